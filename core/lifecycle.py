"""Bring a cluster up and down, preflight its nodes, and explain or re-measure its plan: the command line's side
of the controller's life (a running controller's status and runs are core.client)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.client import DOWN_TIMEOUT_S, DownResult, state_for, status, stop_controller, wait_gone, watch
from core.endpoints.control import ask
from core.errors import ClusterError, ConnectError, DeployError, InventoryError
from core.inventory import Inventory, Node
from core.model import check_draft_model, demo_model, read_model
from core.nodes import worker
from core.nodes.build import TARGET, Progress, cache_dir, worker_binary
from core.nodes.deploy import Deployment, decide_deployment, deployable, node_root
from core.nodes.devices import backend_environment, describe, vulkan_device
from core.nodes.probe import PARALLEL_NODES, EphemeralPorts, NodeFacts, local_cpu_flags, node_backend, probe_node
from core.nodes.remote import remote_for
from core.nodes.shell import Remote
from core.nodes.worker import worker_dir
from core.plan_explained import PlanRow, plan_rows
from core.planner import Plan
from core.state import Launch, StateDir, fingerprint, read_launch
from core.status import ClusterStatus, CoordinatorState, NodeState

UP_TIMEOUT_S = 3600.0  # a first build on a small ARM board takes a while


@dataclass(frozen=True)
class UpResult:
    """What `up` did."""

    status: ClusterStatus
    already_up: bool
    restarted: bool
    adopted: bool


async def bring_up(inventory: Inventory, on_status: Callable[[ClusterStatus], None],
                   on_build: Progress, require_all: bool = False) -> UpResult:
    """Start the cluster (or find it already running with the same configuration) and wait until ready.

    A node that fails is left out when the rest can hold the model, unless ``require_all``. Two `up`s of
    one cluster at once take turns: the second waits, then finds the cluster up.
    """
    state = state_for(inventory).create()
    async with _exclusive(state.root / "up.lock", on_build):
        return await _bring_up(inventory, state, on_status, on_build, require_all)


@asynccontextmanager
async def _exclusive(path: Path, on_wait: Progress) -> AsyncIterator[None]:
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait("waiting for another `ggml-cluster up` of this cluster to finish", None)
            await asyncio.to_thread(fcntl.flock, handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def checked_model(inventory: Inventory) -> Path:
    """The inventory's model (the demo's when it names none), read, and its draft model checked against it;
    InventoryError, one line naming the field, when either is missing, unreadable or they do not match."""
    model = inventory.model_path
    if model is None:
        model = demo_model(cache_dir())
    elif not model.is_file():
        raise InventoryError(f"{inventory.source}: model: no such file {model}",
                             "fix: point 'model' at a GGUF file on this machine")
    read_model(model)
    if (draft := inventory.draft_model_path) is not None:
        check_draft_model(draft, model, inventory.source)
    return model


async def _bring_up(inventory: Inventory, state: StateDir, on_status: Callable[[ClusterStatus], None],
                    on_build: Progress, require_all: bool) -> UpResult:
    model = checked_model(inventory)
    binary = await asyncio.to_thread(worker_binary, "cpu", on_build)
    inventory_text = json.dumps(inventory.model_dump(mode="json", exclude={"source"}), sort_keys=True)
    launch = Launch(binary=str(binary.path), protocol=binary.protocol, model=str(model.resolve()))
    # The controller runs in another folder: it gets the inventory's absolute path to resolve relative paths
    # against, and `-i inv.yaml` and `-i $PWD/inv.yaml` make one fingerprint.
    launch_text = json.dumps({**launch.to_dict(), "source": inventory.location}, sort_keys=True)
    wanted = fingerprint(inventory_text, launch_text, inventory.api_key)

    restarted = False
    pid = state.controller_pid()
    if pid is not None:
        answer: dict[str, Any] | None = None
        with contextlib.suppress(ConnectError, ConnectionError, json.JSONDecodeError):
            answer = await asyncio.wait_for(ask(state, {"op": "ping"}), 10)
        if answer is not None and answer.get("inventory") == wanted:
            return UpResult(await _settle(state, on_status, on_build), already_up=True, restarted=False,
                            adopted=False)
        if answer is not None:
            await shut_down(state)
            restarted = True
        else:
            # A hung controller: replace it, but keep its workers for the new one to adopt.
            state.signal_controller(signal.SIGKILL)
            await wait_gone(pid, DOWN_TIMEOUT_S)
    state.socket.unlink(missing_ok=True)  # a dead controller's socket would answer "refused"
    state.pid.unlink(missing_ok=True)
    state.inventory.write_text(inventory_text)
    state.launch.write_text(launch_text)
    process = _spawn_controller(state)
    try:
        snapshot = await _wait_ready(state, process, on_status)
        failed = failed_nodes(snapshot)
        if require_all and failed:
            raise ClusterError(f"{len(failed)} of {len(snapshot.nodes)} nodes failed ({'; '.join(failed)})",
                               "fix the node or drop --require-all to run on the rest")
    except ClusterError as exc:
        await shut_down(state)
        raise type(exc)(f"{exc.message}; the cluster was stopped", exc.hint) from None
    except (asyncio.CancelledError, KeyboardInterrupt):
        await shut_down(state)
        raise
    adopted = any("adopted" in event.message for event in snapshot.events)
    return UpResult(snapshot, already_up=False, restarted=restarted, adopted=adopted)


async def _settle(state: StateDir, on_status: Callable[[ClusterStatus], None], on_build: Progress) -> ClusterStatus:
    """`up` on a cluster that runs already: still starting (an earlier `up` was killed while it waited), wait as
    that `up` would have; failed or short of nodes, have it try them again now and say what it still waits for.
    The cluster is left running either way: it goes on trying those nodes by itself."""
    snapshot = await status(state)
    if snapshot.coordinator.state == CoordinatorState.FAILED or away_nodes(snapshot):
        on_build(f"trying again: {'; '.join(away_nodes(snapshot)) or snapshot.coordinator.last_error}", None)
        snapshot = ClusterStatus.from_dict(await ask(state, {"op": "retry"}))
    if snapshot.coordinator.state == CoordinatorState.FAILED:
        waiting = "; ".join(away_nodes(snapshot)) or "no node is away"
        raise ClusterError(f"the cluster cannot serve yet: {snapshot.coordinator.last_error}; waiting for {waiting}",
                           "it goes on trying those nodes by itself; `ggml-cluster status` follows it, "
                           "`ggml-cluster up` tries again now")
    return await _wait_ready(state, None, on_status)


def failed_nodes(snapshot: ClusterStatus) -> list[str]:
    """``name: reason`` for every failed node."""
    return [f"{node.name}: {node.last_error}" for node in snapshot.nodes if node.left_out]


def away_nodes(snapshot: ClusterStatus) -> list[str]:
    """``name: reason`` for every node that is failed or unreachable."""
    return [f"{node.name}: {node.last_error or node.state}" for node in snapshot.nodes
            if node.left_out or node.state == NodeState.RECONNECTING]


def _spawn_controller(state: StateDir) -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with state.controller_log.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "core.controller", str(state.root)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=root,
                                start_new_session=True)


async def _wait_ready(state: StateDir, process: subprocess.Popen[bytes] | None,
                      on_status: Callable[[ClusterStatus], None]) -> ClusterStatus:
    """Watch the controller (``process``, or one already running) until its coordinator is ready."""
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not state.socket.exists():
        if process is None or process.poll() is not None:
            raise DeployError(f"the controller exited at start-up: {_tail(state.controller_log)}",
                              f"see {state.controller_log}")
        if time.monotonic() > deadline:
            raise DeployError("the controller did not open its socket", f"see {state.controller_log}")
        await asyncio.sleep(0.05)
    async for snapshot in watch(state, interval=0.5):
        on_status(snapshot)
        if snapshot.coordinator.state in (CoordinatorState.READY, CoordinatorState.GENERATING):
            return snapshot
        if snapshot.coordinator.state == CoordinatorState.FAILED:
            raise ClusterError(f"the cluster could not start: {snapshot.coordinator.last_error}")
        if time.monotonic() > deadline:
            raise ClusterError(f"the cluster was not ready after {UP_TIMEOUT_S:g}s")
    raise ConnectError(f"the controller stopped during start-up: {_tail(state.controller_log)}",
                       f"see {state.controller_log}")


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else "no output"
    return "no log"


async def shut_down(state: StateDir, keep_workers: bool = False) -> DownResult:
    """Stop the controller, coordinator and every worker; works even when the controller is dead.

    With ``keep_workers`` the workers (and the model tensors they cache) stay up for the next `up` to adopt.
    """
    settled = await stop_controller(state, keep_workers)
    return settled if settled is not None else await stop_leftover_workers(state)


async def stop_leftover_workers(state: StateDir) -> DownResult:
    """Stop workers whose supervisor still runs after the controller is gone (killed, crashed)."""
    if not (state.inventory.is_file() and state.launch.is_file()):
        return DownResult([], [])
    inventory, _ = read_launch(state)

    async def stop(node: Node) -> str | None:
        remote = remote_for(node)
        try:
            await remote.connect()
            spec = _folder_spec(inventory, node, state, remote)
            if await worker.running_supervisor(remote, spec) is None:
                return None
            await worker.stop(remote, spec)
            return node.name
        finally:
            await remote.close()

    results = await asyncio.gather(*(stop(node) for node in inventory.nodes), return_exceptions=True)
    unreachable = [f"{node.name}: {result}" for node, result in zip(inventory.nodes, results, strict=True)
                   if isinstance(result, ClusterError)]
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, ClusterError):
            raise result
    return DownResult([result for result in results if isinstance(result, str)], unreachable)


def _folder_spec(inventory: Inventory, node: Node, state: StateDir, remote: Remote) -> worker.WorkerSpec:
    """Enough of a worker's spec to find, check or stop it: its folder."""
    return worker.WorkerSpec(node=node.name, workdir=worker_dir(inventory, node, state, remote), binary=TARGET,
                             port=node.rpc_port)


@dataclass(frozen=True)
class NodeCheck:
    """What `check` found on one node."""

    name: str
    host: str
    system: str = ""     # os/arch
    hardware: str = ""   # cores, memory, GPUs
    backend: str = ""
    reason: str = ""     # why that backend
    worker: str = ""     # cached | push | remote | installed | build here (a local node)
    device: str = ""     # the backend's device: the worker's own listing when it is there, else the probe's
    port: str = ""       # free | used by this cluster's worker | …
    problem: str = ""    # empty when the node is good to go
    note: str = ""       # advice that does not stop the node (e.g. a port the kernel may hand out)

    def to_dict(self) -> dict[str, str]:
        """Plain dict for JSON."""
        return dict(vars(self))


async def check(inventory: Inventory) -> list[NodeCheck]:
    """Preflight the model (and the draft model's vocabulary), then every node (reach, probe, toolchain, worker,
    port) in parallel, starting nothing."""
    await asyncio.to_thread(checked_model, inventory)
    state = state_for(inventory)
    flags = local_cpu_flags()
    gate = asyncio.Semaphore(PARALLEL_NODES)

    async def one(node: Node) -> NodeCheck:
        remote = remote_for(node)
        row = NodeCheck(node.name, node.host or "localhost")
        async with gate:
            try:
                facts = await probe_node(remote)
                gpus = ", ".join(f"{gpu.name}" + (f" {gpu.memory_total / (1 << 30):.0f} GiB" if gpu.memory_total
                                                  else "") for gpu in facts.gpus)
                row = replace(row, system=f"{facts.os.system}/{facts.arch}",
                              hardware=f"{facts.cpu.cores} cores, {facts.memory.total / (1 << 30):.1f} GiB"
                              + (f", {gpus}" if gpus else ""))
                backend, reason = node_backend(node.backend, facts)  # shown also when no worker can be had
                row = replace(row, backend=backend, reason=reason)
                plan = await decide_deployment(remote, deployable(inventory, node), facts,
                                               node_root(remote, node.workdir), flags)
                row = replace(row, backend=plan.backend, reason=plan.reason, worker=plan.how)
                row = replace(row, device=await _device(inventory, node, state, remote, plan=plan, facts=facts))
                ours = await worker.running_supervisor(remote, _folder_spec(inventory, node, state, remote)) is not None
                used = await remote.port_open(node.rpc_port)
                port = "used by this cluster's worker" if ours else "in use by another process" if used else "free"
                row = replace(row, port=f"{node.rpc_port} {port}")
                if facts.ephemeral is not None and facts.ephemeral.may_take(node.rpc_port):
                    row = replace(row, note=ephemeral_note(node.rpc_port, facts.ephemeral, facts.os.system == "linux"))
                if used and not ours:
                    row = replace(row, problem=f"port {node.rpc_port} is in use by another process")
            except ClusterError as exc:
                row = replace(row, problem=str(exc))
            finally:
                await remote.close()
        return row

    return list(await asyncio.gather(*(one(node) for node in inventory.nodes)))


def ephemeral_note(port: int, ephemeral: EphemeralPorts, linux: bool) -> str:
    """Advice for an ``rpc_port`` in the node's ephemeral range: until its worker listens, any outgoing connection
    on the node may be given that port, and the worker then cannot start."""
    reserve = f", or reserve it (sysctl net.ipv4.ip_local_reserved_ports={port})" if linux else ""
    return (f"port {port} is in this node's ephemeral range {ephemeral.low}-{ephemeral.high}, where an outgoing "
            f"connection can hold it when the worker starts: pick an rpc_port below {ephemeral.low}{reserve}")


async def _device(inventory: Inventory, node: Node, state: StateDir, remote: Remote, *, plan: Deployment,
                  facts: NodeFacts) -> str:
    """The device the node's worker would serve its backend on. A worker already on the node lists its own, in the
    environment `up` gives it (raising MissingDevice, as `up` would, when it has none); one still to be built or
    pushed has only the probe's word, and that only for Vulkan."""
    env = worker.environment(node, backend_environment(plan.backend, facts.vulkan_devices))
    if plan.how in ("cached", "installed"):
        spec = replace(_folder_spec(inventory, node, state, remote), binary=plan.binary, env=env)
        device = await worker.backend_device(remote, spec, plan.backend)
        return describe(device) if device else ""
    return vulkan_device(facts.vulkan_devices) if plan.backend == "vulkan" else ""


async def explain_plan(inventory: Inventory, strategy: str, objective: str | None = None
                       ) -> tuple[Plan, list[PlanRow]]:
    """`plan`: the running cluster's measured memory and speed, planned with ``strategy`` (nothing changes)."""
    state = state_for(inventory)
    try:
        snapshot = await status(state)
    except ConnectError:
        raise ConnectError(f"cluster '{inventory.cluster}' is not running; `plan` uses its workers' measured "
                           "memory and speed", "fix: run `ggml-cluster up` first") from None
    model = read_model(Path(json.loads(state.launch.read_text())["model"]), speculative=inventory.speculates)
    return plan_rows(snapshot, inventory, model, strategy, objective)


async def reprofile(inventory: Inventory) -> None:
    """`profile`: measure every node again, re-plan and restart the coordinator (between requests)."""
    await ask(state_for(inventory), {"op": "profile"})
