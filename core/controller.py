"""The controller: one detached process per cluster that owns the workers, the plan and the coordinator.

It starts (or adopts) each node's supervised worker, follows its events, checks it with a HELLO probe,
plans the layers, runs the coordinator as a child, restarts it when it dies and resumes the request in
flight. Clients talk to it over a Unix socket with JSON lines (see `core.client`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import worker
from core.api import ApiServer, serve_api
from core.build import cache_dir, deploy_worker, node_root
from core.coordinator import FLASH_ATTENTION, CoordinatorConfig
from core.errors import (
    ClusterError,
    ConnectError,
    DeployError,
    PlanError,
    ProfileError,
    PromptError,
    RequestError,
    WorkerDown,
    WorkerError,
)
from core.inventory import BuildPath, Inventory, Node, parse_inventory
from core.metrics import MetricsServer, Sample, parse_sample, sample_command, serve_metrics, usage
from core.model import ModelFacts, read_model
from core.planner import (
    NodeCapacity,
    Plan,
    assign_layers,
    plan_compute,
    plan_equal,
    plan_memory,
    with_prediction,
)
from core.probe import PROBE_COMMAND, parse_cpuinfo, parse_node
from core.profile import ProfileCache, Profiles, Target, measure, model_fingerprint, profile_key
from core.relay import Link, Relay, RelayHost
from core.remote import Remote, SshRemote, remote_for, shell_command
from core.rpc import Version, probe_worker
from core.state import StateDir
from core.status import (
    ClusterStatus,
    CoordinatorState,
    CoordinatorStatus,
    Event,
    NodeState,
    NodeStatus,
)

log = logging.getLogger("ggml-cluster.controller")

READY_TIMEOUT_S = 60.0      # a started worker must answer HELLO within this
RECOVERY_TIMEOUT_S = 120.0  # a request waits this long for the cluster to come back
MAX_RECOVERIES = 5          # per request
PARALLEL_NODES = 16         # nodes connected, probed and deployed at once
EVENT_MEMORY = 50
GIL_SWITCH_S = 0.0002        # the GIL switch interval in the controller (see main)
METRICS_INTERVAL_S = 2.0    # how often each worker's CPU, memory and GPU use is sampled on its node


@dataclass(frozen=True)
class Launch:
    """What `up` hands the controller besides the inventory."""

    binary: str
    protocol: Version
    model: str

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for launch.json."""
        return {"binary": self.binary, "model": self.model,
                "protocol": [self.protocol.major, self.protocol.minor, self.protocol.patch]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Launch:
        """Parse launch.json."""
        return cls(binary=data["binary"], model=data["model"], protocol=Version(*data["protocol"]))


def worker_dir(inventory: Inventory, node: Node, state: StateDir, remote: Remote) -> str:
    """Where a node's worker lives: a local node's ``workdir`` or <state>/nodes/<node>; an ssh node's
    <workdir or ~/.ggml-cluster>/<cluster>/<node> (``remote`` connected, to expand ``~``)."""
    if node.kind == "local":
        return str(inventory.workdir(node) or state.node_dir(node.name))
    return f"{node_root(remote, node.workdir)}/{inventory.cluster}/{node.name}"


def read_launch(state: StateDir) -> tuple[Inventory, Launch]:
    """The inventory and launch settings `up` wrote into the state dir."""
    data = json.loads(state.launch.read_text())
    inventory = parse_inventory(state.inventory.read_text(), str(state.inventory))
    return inventory.model_copy(update={"source": data["source"]}), Launch.from_dict(data)


def local_cpu_flags() -> frozenset[str]:
    """This machine's CPU features: what a pushed (GGML_NATIVE) build may use."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text()).flags
    except OSError:
        return frozenset()


def deployable(inventory: Inventory, node: Node) -> Node:
    """The node as deployment sees it: a local node's ``build: {path: …}`` resolved like every other path of
    the inventory (an SSH node's path is the node's)."""
    if node.kind == "local" and isinstance(node.build, BuildPath):
        return node.model_copy(update={"build": BuildPath(path=str(inventory.resolve(node.build.path)))})
    return node


@dataclass
class _Progress:
    """One request's state, kept across coordinator restarts so that it can resume."""

    prompt_tokens: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


@dataclass
class NodeRuntime:
    """The controller's live view of one node."""

    node: Node
    remote: Remote
    status: NodeStatus
    spec: worker.WorkerSpec | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    starting: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while its worker is started or stopped
    endpoint: tuple[str, int] | None = None  # the worker, as this machine reaches it
    relay: Relay | None = None
    relayed: tuple[str, int] | None = None   # where the coordinator connects: the relay, or the worker itself


class Controller:
    """The daemon's state and tasks."""

    def __init__(self, inventory: Inventory, launch: Launch, state: StateDir) -> None:
        self.inventory = inventory
        self.launch = launch
        self.state = state
        self.model: ModelFacts = read_model(Path(launch.model))
        self.nodes: dict[str, NodeRuntime] = {}
        for node in inventory.nodes:
            self.nodes[node.name] = NodeRuntime(
                node=node, remote=remote_for(node),
                status=NodeStatus(name=node.name, host=node.host or "localhost", kind=node.kind,
                                  rpc_port=node.rpc_port))
        self._parallel = asyncio.Semaphore(PARALLEL_NODES)
        self._relays = RelayHost()
        self._rpc_remotes: list[SshRemote] = []  # the SSH nodes' RPC connections, on the relays' loop
        self._local_flags = local_cpu_flags()
        self.coordinator = CoordinatorStatus(endpoint=f"unix:{state.socket}")
        self.events: deque[Event] = deque(maxlen=EVENT_MEMORY)
        self.plan: Plan | None = None
        self.profiles: Profiles | None = None
        self._profile_cache = ProfileCache(cache_dir() / "profiles")
        self._model_id = model_fingerprint(Path(launch.model))
        self._reprofile = False  # set by `profile`: measure again before the next plan
        self._replanning = False  # the coordinator is being restarted on purpose
        self.started_at = time.time()
        self.requests_served = 0
        self.requests_waiting = 0  # in flight: generating, or queued behind the one that is
        self.recoveries = 0
        self.rates: dict[str, float | None] = {"prompt": None, "decode": None}  # tokens/s of the last request
        self._current: _Progress | None = None  # the request generating now
        self.metrics: MetricsServer | None = None
        self.api: ApiServer | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._coordinator_ready = asyncio.Event()
        self._request_lock = asyncio.Lock()
        self._changed = asyncio.Event()  # set and replaced on every change
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.finished = asyncio.Event()

    # --- status and events -------------------------------------------------------------------------

    def snapshot(self) -> ClusterStatus:
        """The current status of everything."""
        return ClusterStatus(
            cluster=self.inventory.cluster, model=self.model.name,
            coordinator=CoordinatorStatus(**vars(self.coordinator)),
            nodes=[self._node_status(runtime) for runtime in self.nodes.values()],
            events=list(self.events), n_layers=self.model.n_layers,
            tensor_split=list(self.plan.tensor_split) if self.plan else [],
            controller_pid=os.getpid(), started_at=self.started_at, requests_served=self.requests_served,
            requests_in_flight=self.requests_waiting, recoveries=self.recoveries,
            prompt_tokens_per_s=self.rates["prompt"], decode_tokens_per_s=self._decode_rate(),
            metrics_endpoint=self.metrics.address if self.metrics else "",
            api_endpoint=self.api.address if self.api else "",
            strategy=self.plan.strategy if self.plan else "",
            predicted_ms=None if self.plan is None or self.plan.predicted_total_s is None
            else self.plan.predicted_total_s * 1000,
            overhead_ms=None if self.profiles is None else self.profiles.overhead_s * 1000)

    def _decode_rate(self) -> float | None:
        """Tokens/s of the request generating now (since its first token), else of the last one."""
        current = self._current
        if current is None or current.first_token_s is None or len(current.generated) < 2:
            return self.rates["decode"]
        return (len(current.generated) - 1) / (time.perf_counter() - current.started - current.first_token_s)

    @staticmethod
    def _node_status(runtime: NodeRuntime) -> NodeStatus:
        """A copy of the node's status with its relay's counters."""
        status = NodeStatus(**vars(runtime.status))
        if runtime.endpoint is not None:
            status.endpoint = f"{runtime.endpoint[0]}:{runtime.endpoint[1]}"
        if runtime.relay is not None:
            seen = runtime.relay.stats
            status.computes, status.recomputes = seen.computes, seen.recomputes
            status.bytes_to, status.bytes_from = seen.bytes_to, seen.bytes_from
            status.compute_ms, status.link = seen.compute_ms, "connected" if seen.connected else "idle"
        elif runtime.relayed is not None:
            status.link = "direct"
        return status

    def record(self, kind: str, message: str, node: str | None = None) -> None:
        """Log an event, keep it for `status`, and wake watchers."""
        event = Event(time=time.time(), kind=kind, message=message, node=node)
        self.events.append(event)
        with contextlib.suppress(OSError), self.state.events.open("a") as handle:
            handle.write(json.dumps(event.to_dict()) + "\n")
        log.info("%s%s: %s", f"[{node}] " if node else "", kind, message)
        self.notify()

    def notify(self) -> None:
        """Wake every watcher: something changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Return on the next change or after ``timeout``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- nodes -------------------------------------------------------------------------------------

    async def start_nodes(self) -> None:
        """Start or adopt every worker, then follow each node."""
        for runtime in self.nodes.values():
            self._spawn(self._run_node(runtime))

    async def _run_node(self, runtime: NodeRuntime) -> None:
        name = runtime.node.name
        status = runtime.status
        try:
            spec = runtime.spec = await self._prepare(runtime)
            offset = await self._events_size(spec, runtime.remote)
            status.state = NodeState.STARTING
            self.notify()
            if await worker.running_supervisor(runtime.remote, spec) is None and await runtime.remote.port_open(
                    runtime.node.rpc_port, spec.bind):
                # Probing it would talk to somebody else's server as if it were ours.
                raise DeployError(f"node {name}: port {runtime.node.rpc_port} on {status.host} is already in "
                                  "use by another process", "fix: stop that process or set another rpc_port")
            async with runtime.starting:
                if self._stopping:
                    return  # `down` came first
                adopted = await worker.start(runtime.remote, spec)
            self.record("worker", "adopted the running worker" if adopted else "worker started", name)
            direct = runtime.node.kind == "ssh" and runtime.node.transport == "direct"
            runtime.endpoint = (spec.bind, spec.port) if direct else await runtime.remote.endpoint(spec.port)
            await self._relay(runtime, runtime.endpoint)
            self._spawn(self._probe_until_ready(runtime))
            self._spawn(self._sample(runtime))
            await self._follow(runtime, offset)
        except ClusterError as exc:
            self._fail_node(runtime, str(exc))

    async def _relay(self, runtime: NodeRuntime, endpoint: tuple[str, int]) -> None:
        """The observing relay the coordinator reaches this worker through (started once per node).

        Relays run on the relays' uvloop thread. A local node's connects over TCP; an SSH node's opens each
        link as a channel on an SSH connection of its own (opened by the first link, on that loop), so RPC
        never waits for the controller's loop. A `transport: direct` node has none: the user opened the
        worker's port to take the shortest path, and a relay would add a hop to every RPC message (2-3% of
        decode with two nodes, bench/relay.py), so its traffic is not observed.
        """
        if runtime.node.kind == "ssh" and runtime.node.transport == "direct":
            runtime.relayed = endpoint
            return
        if runtime.relay is None:
            name, spec = runtime.node.name, runtime.spec

            def report(message: str) -> None:
                self.record("relay", message, name)

            connect = None
            if runtime.node.kind == "ssh" and spec is not None:
                rpc = SshRemote(runtime.node)
                self._rpc_remotes.append(rpc)

                def connect(link: Link) -> Coroutine[Any, Any, None]:
                    return rpc.open_rpc(spec.port, link)

            runtime.relay, runtime.relayed = await self._relays.relay(endpoint, report, connect)
        runtime.relay.target = endpoint

    async def _sample(self, runtime: NodeRuntime) -> None:
        """Sample the worker's CPU, memory and GPU use on its node, over the node's own connection."""
        status = runtime.status
        if runtime.spec is None:
            return
        command = sample_command(runtime.spec.workdir, status.backend)  # both are settled once the worker runs
        previous: tuple[Sample, float] | None = None
        while not self._stopping:
            await asyncio.sleep(METRICS_INTERVAL_S)
            try:
                result = await runtime.remote.run(command, timeout=10)
            except ConnectError:
                result = None  # the node's connection is down; its events say so
            sample = parse_sample(result.stdout) if result else None
            now = time.monotonic()
            seen = usage(previous[0] if previous else None, sample, now - previous[1] if previous else 0.0)
            for key, value in vars(seen).items():
                setattr(status, key, value)
            previous = (sample, now) if sample else None
            self.notify()

    async def _prepare(self, runtime: NodeRuntime) -> worker.WorkerSpec:
        """Reach, probe and deploy a node; a local node's worker is this machine's build for its backend."""
        node, status, remote = runtime.node, runtime.status, runtime.remote
        status.state = NodeState.CONNECTING
        self.notify()
        loop = asyncio.get_running_loop()

        def progress(message: str, fraction: float | None) -> None:
            loop.call_soon_threadsafe(self._show_progress, runtime, message, fraction)

        async with self._parallel:
            await remote.connect()
            facts = parse_node((await remote.run(PROBE_COMMAND, timeout=120)).stdout)
            status.arch = facts.arch
            status.state = NodeState.DEPLOYING
            self.notify()
            deployment = await deploy_worker(remote, deployable(self.inventory, node), facts,
                                             node_root(remote, node.workdir), local_flags=self._local_flags,
                                             progress=progress)
        status.backend = deployment.backend
        status.detail = f"{deployment.reason}; worker {deployment.how}"
        status.progress = None
        status.last_status = ""  # it held deployment progress
        self.record("deploy", f"{deployment.backend} worker {deployment.how} ({deployment.reason})", node.name)
        direct = node.kind == "ssh" and node.transport == "direct"
        return worker.WorkerSpec(node=node.name, workdir=worker_dir(self.inventory, node, self.state, remote),
                                 binary=deployment.binary, port=node.rpc_port, threads=node.threads,
                                 bind=node.host if direct and node.host else "127.0.0.1",
                                 cache=str(self.state.worker_cache) if node.kind == "local" else None)

    def _show_progress(self, runtime: NodeRuntime, message: str, fraction: float | None) -> None:
        runtime.status.last_status = message
        runtime.status.progress = fraction
        self.notify()

    async def _events_size(self, spec: worker.WorkerSpec, remote: Remote) -> int:
        path = worker.event_path(spec)
        result = await remote.run(f"wc -c < {shell_command([path])} 2>/dev/null || echo 0")
        text = result.stdout.strip()
        return int(text) if text.isdigit() else 0

    async def _follow(self, runtime: NodeRuntime, offset: int) -> None:
        if runtime.spec is None:
            return
        path = shell_command([worker.event_path(runtime.spec)])
        async for line in runtime.remote.follow(f"tail -c +{offset + 1} -F {path} 2>/dev/null"):
            event = worker.parse_event(line)
            if event is not None and not self._stopping:
                await self._on_worker_event(runtime, event)

    async def _on_worker_event(self, runtime: NodeRuntime, event: worker.WorkerEvent) -> None:
        status = runtime.status
        name = runtime.node.name
        if event.kind == "started":
            status.pid = event.pid
            # Every restart follows an "exit", which clears `ready`; a "started" while ready is the
            # process the probe has already checked (its event can arrive after the probe's answer).
            if status.state != NodeState.STARTING and not runtime.ready.is_set():
                status.state = NodeState.STARTING
                self._spawn(self._probe_until_ready(runtime))
            self.notify()
        elif event.kind == "exit":
            runtime.ready.clear()
            status.state = NodeState.RESTARTING
            status.restarts += 1
            status.pid = None
            text = await worker.read_log(runtime.remote, runtime.spec, event.log_offset or 0) if runtime.spec else ""
            cause = worker.classify_exit(event.code if event.code is not None else -1, text)
            status.last_status = cause
            status.last_error = cause
            self.record("worker-exit", f"worker exited after {event.ran_s}s: {cause}", name)
            if not self._request_lock.locked():
                # Idle, the coordinator would only find out on the next request; reconnect it now.
                self._spawn(self._replan_after_loss(name))
        elif event.kind == "backoff":
            self.record("worker-restart", f"restarting the worker in {event.seconds}s", name)
        elif event.kind == "failed":
            runtime.ready.clear()
            status.state = NodeState.FAILED
            status.last_error = f"crash loop: {status.last_status}"
            self.record("node-failed", f"worker keeps exiting ({status.last_status}); node excluded", name)
            self._spawn(self._replan_after_loss(name))

    async def _probe_until_ready(self, runtime: NodeRuntime) -> None:
        status = runtime.status
        if runtime.endpoint is None:
            return
        host, port = runtime.endpoint
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._stopping and status.state == NodeState.STARTING:
            if self._process is not None and runtime.ready.is_set():
                return  # in use by the coordinator: never probe a busy worker
            try:
                info = await probe_worker(host, port, timeout=3.0, client=self.launch.protocol)
            except WorkerError as exc:
                self._fail_node(runtime, str(exc))
                return
            except ClusterError as exc:
                if time.monotonic() > deadline:
                    self._fail_node(runtime, f"no HELLO answer within {READY_TIMEOUT_S:g}s: {exc}")
                    return
                await asyncio.sleep(0.2)
                continue
            status.mem_total, status.mem_free = info.mem_total, info.mem_free
            status.state = NodeState.READY
            runtime.ready.set()
            self.record("worker-ready", f"RPC {info.version}, {len(info.devices)} device(s), "
                        f"{info.mem_free >> 20} MiB free of {info.mem_total >> 20} MiB", runtime.node.name)
            return

    def _fail_node(self, runtime: NodeRuntime, reason: str) -> None:
        runtime.ready.clear()
        runtime.status.state = NodeState.FAILED
        runtime.status.last_error = reason
        self.record("node-failed", f"{reason}; node excluded", runtime.node.name)

    # --- plan and coordinator ----------------------------------------------------------------------

    def _usable_nodes(self) -> list[NodeRuntime]:
        return [runtime for runtime in self.nodes.values() if runtime.status.state != NodeState.FAILED]

    async def _wait_nodes(self, timeout: float) -> list[NodeRuntime]:
        """Wait until every usable node is ready; ``timeout`` runs from the last node done deploying."""
        deadline = time.monotonic() + timeout
        while True:
            if any(r.status.state in (NodeState.PENDING, NodeState.CONNECTING, NodeState.DEPLOYING)
                   for r in self.nodes.values()):
                deadline = time.monotonic() + timeout  # builds take as long as they take
            usable = self._usable_nodes()
            if usable and all(runtime.ready.is_set() for runtime in usable):
                return usable
            if not usable:
                reasons = "; ".join(f"{r.node.name}: {r.status.last_error or 'failed'}" for r in self.nodes.values())
                raise PlanError(f"every node has failed ({reasons})")
            if time.monotonic() > deadline:
                waiting = ", ".join(f"{r.node.name} ({r.status.state})" for r in usable if not r.ready.is_set())
                raise WorkerError(f"workers not ready after {timeout:g}s: {waiting}")
            await self.wait_change(0.5)

    async def _verified_nodes(self) -> list[NodeRuntime]:
        """Ready nodes whose workers answer HELLO right now (the coordinator aborts on one that does not)."""
        while True:
            usable = await self._wait_nodes(READY_TIMEOUT_S)
            answers = await asyncio.gather(*(self._verify(runtime) for runtime in usable))
            if all(answers):
                return usable

    async def _verify(self, runtime: NodeRuntime) -> bool:
        if runtime.endpoint is None or runtime.spec is None:
            return False
        pid = runtime.status.pid
        try:
            await probe_worker(*runtime.endpoint, timeout=3.0, client=self.launch.protocol)
            return True
        except WorkerError as exc:
            self._fail_node(runtime, str(exc))
            return False
        except ClusterError as exc:
            if await worker.running_supervisor(runtime.remote, runtime.spec) is None:
                self._fail_node(runtime, f"its worker and supervisor are gone ({exc})")
                return False
            if isinstance(exc, WorkerDown):
                # Died a moment ago and its supervisor's "exit" is still on the way: killing it again now
                # would kill its replacement and double the supervisor's backoff. Wait for it to come back
                # instead (unless that exit, and maybe the restart, were handled while we probed).
                if runtime.status.pid == pid and runtime.status.state == NodeState.READY:
                    runtime.ready.clear()
                    runtime.status.state = NodeState.RESTARTING
                    self.record("worker-down", f"worker is not listening ({exc}); waiting for its supervisor "
                                "to restart it", runtime.node.name)
                return False
            runtime.ready.clear()
            runtime.status.state = NodeState.RESTARTING
            self.record("worker-hung", f"worker does not answer ({exc}); killing it for its supervisor to "
                        "restart", runtime.node.name)
            await self._kill_worker(runtime)
            return False

    async def _kill_worker(self, runtime: NodeRuntime) -> None:
        if runtime.spec is not None:
            await worker.kill(runtime.remote, runtime.spec)

    async def _stopped_workers(self) -> list[NodeRuntime]:
        """Planned workers that are stopped (SIGSTOP, a debugger): they hold the pipeline forever."""
        planned = [runtime for runtime in self.nodes.values() if self.plan is not None
                   and runtime.node.name in self.plan.used and runtime.status.pid is not None]
        states = await asyncio.gather(*(runtime.remote.run(f"ps -o stat= -p {int(runtime.status.pid or 0)}")
                                        for runtime in planned))
        return [runtime for runtime, state in zip(planned, states, strict=True)
                if state.stdout.strip().startswith("T")]

    async def _watchdog_fired(self, generated: int) -> str:
        """No progress within the bound: kill what is stuck, restart the coordinator; returns the cause."""
        bound = self.inventory.watchdog
        stuck = await self._stopped_workers()
        names = ", ".join(runtime.node.name for runtime in stuck)
        cause = f"watchdog: no progress for {bound}s after {generated} tokens" + (
            f"; worker {names} is stopped" if stuck else "; no stopped worker found")
        self.record("watchdog", f"{cause}; killing {'it' if stuck else 'the coordinator'} and recovering")
        for runtime in stuck:
            await self._kill_worker(runtime)
        await self._kill_coordinator()
        return cause

    def _capacities(self, usable: list[NodeRuntime]) -> list[NodeCapacity]:
        return [NodeCapacity(r.node.name, r.status.mem_free, r.node.memory) for r in usable]

    def _profile_target(self, runtime: NodeRuntime, capacity: NodeCapacity) -> Target:
        node, spec = runtime.node, runtime.spec
        # Same node, same path to it, same worker build and settings, same graph, same model file: same speed.
        identity = [node.name, node.kind, node.host, node.port, node.user, node.transport, runtime.status.backend,
                    spec.binary if spec else "", spec.threads if spec else None, self.launch.protocol,
                    f"flash_attn={FLASH_ATTENTION}"]
        endpoint = runtime.relayed or ("", 0)  # timed on the coordinator's own path to the worker
        return Target(node.name, f"{endpoint[0]}:{endpoint[1]}", profile_key(identity, self._model_id),
                      capacity.usable)

    async def _measure(self, usable: list[NodeRuntime]) -> Profiles | None:
        """Each usable node's speed for this model (cached, or timed now); None when that fails."""
        capacities = self._capacities(usable)
        targets = [self._profile_target(r, c) for r, c in zip(usable, capacities, strict=True)]
        refresh, self._reprofile = self._reprofile, False
        overhead_key = profile_key(["coordinator", platform.node(), 1], self._model_id)
        try:
            profiles = await measure(self.model, targets, self._profile_cache, overhead_key,
                                     self.state.profile_log, refresh=refresh)
        except ProfileError as exc:
            self.record("profile-failed", f"{exc}; placing layers by free memory instead")
            return None
        if profiles.measured:
            self.record("profile", "measured " + ", ".join(profiles.measured) + "; coordinator "
                        f"{profiles.overhead_s * 1000:.2f} ms/token")
        return profiles

    def make_plan(self, usable: list[NodeRuntime], profiles: Profiles | None) -> Plan:
        """The inventory's strategy over the usable nodes, applied to their statuses."""
        capacities = self._capacities(usable)
        names = [r.node.name for r in usable]
        context, strategy = self.inventory.context, self.inventory.strategy
        # Only measured nodes have a speed; a node that could not hold a layer was never timed.
        measured = {} if profiles is None else {
            name: speed for name, speed in zip(self.nodes, profiles.speeds(self.model, list(self.nodes)), strict=True)
            if profiles.nodes.get(name)}
        if strategy == "compute" and profiles is not None:
            plan = plan_compute(self.model, capacities, profiles.speeds(self.model, names), context,
                                self.inventory.objective)
        elif strategy == "equal":
            plan = plan_equal(self.model, capacities, context)
        else:
            plan = plan_memory(self.model, capacities, context)
        if profiles is not None and all(name in measured for name in plan.used):
            plan = with_prediction(plan, profiles.speeds(self.model, names), self.model, profiles.overhead_s)
        self.plan = plan
        self.profiles = profiles
        for name, runtime in self.nodes.items():
            status, speed = runtime.status, measured.get(name)
            status.layers = status.predicted_ms = None
            status.fixed_ms = speed.fixed_s * 1000 if speed else None
            status.layer_ms = speed.per_layer_s * 1000 if speed else None
            status.output_ms = speed.output_s * 1000 if speed else None
        for index, (name, layers) in enumerate(zip(plan.nodes, plan.layers, strict=True)):
            self.nodes[name].status.layers = layers
            if plan.predicted_s and layers:
                self.nodes[name].status.predicted_ms = plan.predicted_s[index] * 1000
        self.state.plan.write_text(json.dumps(plan.to_dict(), indent=2))
        return plan

    async def start_coordinator(self) -> None:
        """Wait for the workers, plan, and start the coordinator; raises when it cannot load."""
        self.coordinator.state = CoordinatorState.LOADING
        self.notify()
        usable = await self._verified_nodes()
        measure_now = self.inventory.strategy == "compute" or self._reprofile
        profiles = await self._measure(usable) if measure_now else self.profiles
        plan = self.make_plan(usable, profiles)
        endpoints = []
        # A node without layers stays out: it would only add a connection the coordinator dies with.
        for name in plan.used:
            endpoint = self.nodes[name].relayed
            if endpoint is None:
                raise WorkerError(f"node {name} has no endpoint")
            endpoints.append(f"{endpoint[0]}:{endpoint[1]}")
        config = CoordinatorConfig(model=self.launch.model, endpoints=tuple(endpoints),
                                   tensor_split=plan.used_split, context=self.inventory.context)
        layout = ", ".join(f"{name} {_layers(layers)}" for name, layers in zip(plan.nodes, plan.layers,
                                                                             strict=True))
        total = plan.predicted_total_s
        predicted = "" if total is None else f"; predicted {total * 1000:.1f} ms/token"
        self.record("plan", f"{plan.strategy} split {list(plan.tensor_split)}: {layout}{predicted}")
        started = time.monotonic()
        with self.state.coordinator_log.open("ab") as log_file:
            log_start = log_file.tell()
            # ggml's abort handler attaches gdb and prints a backtrace on stdout, our protocol channel.
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "core.coordinator", config.to_json(),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                cwd=str(Path(__file__).resolve().parent.parent), env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        self.coordinator.pid = self._process.pid
        messages = self._messages = asyncio.Queue()
        self._spawn(self._read_coordinator(self._process, messages))
        message = await messages.get()
        if message.get("event") != "ready":
            self.coordinator.state = CoordinatorState.FAILED
            reason = message.get("message") or f"exited with code {message.get('code')}"
            self.coordinator.last_error = str(reason)
            self.record("coordinator-failed", f"coordinator could not load the model: {reason}")
            raise ClusterError(f"the coordinator could not load the model: {reason}",
                               f"see {self.state.coordinator_log}")
        self._check_assignment(plan, log_start)
        self.coordinator.state = CoordinatorState.READY
        self._coordinator_ready.set()
        self.record("coordinator-ready", f"model loaded across {len(plan.used)} worker(s) in "
                    f"{time.monotonic() - started:.1f}s")

    def _check_assignment(self, plan: Plan, log_start: int) -> None:
        """Compare llama.cpp's own layer placement (this coordinator's part of the log) with the plan."""
        with self.state.coordinator_log.open("rb") as log_file:
            log_file.seek(log_start)
            seen = parse_layer_devices(log_file.read().decode(errors="replace"))
        expected = assign_layers(plan.used_split, self.model.n_layers)
        if seen and [seen.get(layer) for layer in range(len(expected))] != expected:
            self.record("plan-mismatch", f"llama.cpp placed layers as {seen}, the plan expected {expected}")

    async def _read_coordinator(self, process: asyncio.subprocess.Process,
                                messages: asyncio.Queue[dict[str, Any]]) -> None:
        """Pass one coordinator's lines to its own queue (a later coordinator has another)."""
        if process.stdout is None:
            return
        async for raw in process.stdout:
            try:
                messages.put_nowait(json.loads(raw))
            except json.JSONDecodeError:
                log.warning("coordinator wrote a non-JSON line: %r", raw[:200])
        code = await process.wait()
        messages.put_nowait({"event": "exit", "code": code})
        if process is self._process:
            self._process = None
            self._coordinator_ready.clear()
            self.coordinator.pid = None
            if not self._stopping and not self._replanning:
                self._spawn(self._on_coordinator_exit(code))

    async def _on_coordinator_exit(self, code: int) -> None:
        cause = "aborted: a worker connection was lost" if code in (-6, 134) else worker.classify_exit(
            code if code >= 0 else 128 - code, "")
        self.coordinator.restarts += 1
        self.coordinator.last_error = f"exit {code} ({cause})"
        self.coordinator.state = CoordinatorState.LOADING
        self.record("coordinator-exit", f"coordinator exited with {code} ({cause}); restarting it")
        await self._restart_coordinator()

    async def _restart_coordinator(self) -> None:
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not self._stopping and time.monotonic() < deadline:
            try:
                await self.start_coordinator()
                return
            except PlanError as exc:
                self.coordinator.state = CoordinatorState.FAILED
                self.coordinator.last_error = str(exc)
                self.record("coordinator-failed", f"cannot re-plan: {exc}")
                return
            except ClusterError as exc:
                self.record("coordinator-retry", f"restart failed: {exc}")
                await self._kill_coordinator()
                await asyncio.sleep(1.0)
        if not self._stopping:
            self.coordinator.state = CoordinatorState.FAILED
            self.record("coordinator-failed", f"could not restart within {RECOVERY_TIMEOUT_S:g}s")

    async def reprofile(self) -> None:
        """Measure the nodes again, re-plan and restart the coordinator, between requests."""
        async with self._request_lock:
            self._reprofile = True
            self._replanning = True
            try:
                self.record("replan", "measuring the nodes again and re-planning")
                await self._kill_coordinator()
                while self._process is not None:  # until its reader has seen it go
                    await self.wait_change(0.1)
                self._coordinator_ready.clear()
                self.coordinator.state = CoordinatorState.LOADING
                await self._restart_coordinator()
            finally:
                self._replanning = False

    async def _replan_after_loss(self, name: str) -> None:
        """The coordinator's connection to ``name`` is gone: restart it (on the survivors if ``name`` failed)."""
        if self.plan is not None and name in self.plan.used and self._process is not None:
            self.record("coordinator-restart", f"its connection to {name} is gone; restarting it")
            await self._kill_coordinator()

    async def _kill_coordinator(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.kill()
        await process.wait()

    # --- requests ----------------------------------------------------------------------------------

    async def generate(self, request: dict[str, Any], send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Run one request to completion, resuming it across coordinator restarts."""
        self.requests_waiting += 1
        self.notify()
        try:
            await self._generate(request, send)
        finally:
            self.requests_waiting -= 1
            self.notify()

    async def _generate(self, request: dict[str, Any], send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        async with self._request_lock:
            progress = self._current = _Progress()
            try:
                await self._resume_until_done(request, progress, send)
            finally:
                self._current = None

    async def _resume_until_done(self, request: dict[str, Any], progress: _Progress,
                                 send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        rid = 0
        while True:
            await self._await_coordinator(progress.recoveries)
            rid += 1
            process, messages = self._process, self._messages
            if process is None or process.stdin is None:
                continue
            cause = await self._attempt(request, progress, rid, process=process, messages=messages, send=send)
            if cause is None:
                return
            self.recoveries += 1
            progress.recoveries.append({"at_token": len(progress.generated), "time": time.time(),
                                        "cause": cause})
            if len(progress.recoveries) > MAX_RECOVERIES:
                raise RequestError(f"gave up after {MAX_RECOVERIES} recoveries; last: {cause}")
            await send({"event": "notice", "message": f"recovering: {cause}; resuming"})

    async def _attempt(self, request: dict[str, Any], progress: _Progress, rid: int, *,
                       process: asyncio.subprocess.Process, messages: asyncio.Queue[dict[str, Any]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> str | None:
        """Run the request on this coordinator: None once it is done, else why the coordinator was lost."""
        message: dict[str, Any] = {
            "op": "generate", "id": rid, "max_tokens": int(request.get("max_tokens", 128)),
            "temperature": float(request.get("temperature", 0.0)), "seed": request.get("seed"),
            "replay": progress.generated}
        if progress.prompt_tokens is None and request.get("messages"):
            message["messages"] = request["messages"]  # rendered with the model's chat template, there
        elif progress.prompt_tokens is None:
            message["prompt"] = str(request.get("prompt", ""))
        else:
            message["prompt_tokens"] = progress.prompt_tokens
        self.coordinator.state = CoordinatorState.GENERATING
        self.notify()
        if process.stdin is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):  # it died: its "exit" is on the way
                process.stdin.write((json.dumps(message) + "\n").encode())
                await process.stdin.drain()
        while True:
            try:
                async with asyncio.timeout(self.inventory.watchdog):  # no task per token, unlike wait_for
                    answer = await messages.get()
            except TimeoutError:
                cause = await self._watchdog_fired(len(progress.generated))
                await _drain(messages, lambda answer: answer.get("event") == "exit", 10)
                return cause
            kind = answer.get("event")
            if kind == "exit":
                return f"coordinator exited with {answer.get('code')} after {len(progress.generated)} tokens"
            if answer.get("id") != rid:
                continue
            if kind == "prompt":
                progress.prompt_tokens = list(answer["tokens"])
            elif kind == "token":
                self._note_token(progress, answer)
                try:
                    await send({"event": "token", "text": answer["text"]})
                except ConnectionError:
                    await self._cancel(process, messages, rid)
                    raise
            elif kind == "error":
                self._set_ready()
                raise PromptError(str(answer.get("message")))
            elif kind == "done":
                self._set_ready()
                self.requests_served += 1
                self.rates = {"prompt": _rate(answer.get("prompt_tokens"), answer.get("prompt_s")),
                              "decode": _rate(answer.get("completion_tokens"), answer.get("decode_s"))}
                await self._finish(progress, answer, send)
                return None

    def _note_token(self, progress: _Progress, answer: dict[str, Any]) -> None:
        progress.generated.append(int(answer["token"]))
        progress.texts.append(answer["text"])
        if progress.first_token_s is None:
            progress.first_token_s = time.perf_counter() - progress.started
        last = progress.recoveries[-1] if progress.recoveries else None
        if last is not None and "first_token_after_s" not in last:
            last["first_token_after_s"] = time.time() - last["time"]
            self.record("recovered", f"request resumed at token {last['at_token']}, "
                        f"{last['first_token_after_s']:.2f}s after the fault was seen")

    @staticmethod
    async def _finish(progress: _Progress, answer: dict[str, Any],
                      send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if answer.get("text"):
            progress.texts.append(answer["text"])
            await send({"event": "token", "text": answer["text"]})
        await send({
            "event": "done", "text": "".join(progress.texts), "reason": answer.get("reason"),
            "prompt_tokens": len(progress.prompt_tokens or []), "completion_tokens": len(progress.generated),
            "timings": {"total_s": time.perf_counter() - progress.started, "first_token_s": progress.first_token_s,
                        "prompt_s": answer.get("prompt_s"), "decode_s": answer.get("decode_s"),
                        "decode_tokens_per_s": _rate(answer.get("completion_tokens"), answer.get("decode_s"))},
            "recoveries": progress.recoveries})

    async def _cancel(self, process: asyncio.subprocess.Process, messages: asyncio.Queue[dict[str, Any]],
                      rid: int) -> None:
        """The client went away: stop its request and wait until the coordinator is free again."""
        self.record("cancelled", f"client disconnected; cancelling request {rid}")
        if process.stdin is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                process.stdin.write((json.dumps({"op": "cancel", "id": rid}) + "\n").encode())
                await process.stdin.drain()
        await _drain(messages, lambda answer: answer.get("event") == "exit" or (
            answer.get("id") == rid and answer.get("event") in ("done", "error")), self.inventory.watchdog)
        self._set_ready()

    def _set_ready(self) -> None:
        if self._process is not None:
            self.coordinator.state = CoordinatorState.READY
            self.notify()

    async def _await_coordinator(self, recoveries: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not self._coordinator_ready.is_set():
            if self.coordinator.state == CoordinatorState.FAILED:
                failed = "; ".join(f"{r.node.name} failed: {r.status.last_error}" for r in self.nodes.values()
                                   if r.status.state == NodeState.FAILED)
                raise RequestError(f"the cluster cannot serve ({failed or 'no node failed'}): "
                                   f"{self.coordinator.last_error}")
            if time.monotonic() > deadline:
                raise RequestError(f"the cluster did not recover within {RECOVERY_TIMEOUT_S:g}s "
                                   f"({self.coordinator.last_error or 'coordinator not ready'})")
            await self.wait_change(0.5)
        if recoveries and "resumed_after_s" not in recoveries[-1]:
            recoveries[-1]["resumed_after_s"] = time.time() - recoveries[-1]["time"]

    # --- shutdown ----------------------------------------------------------------------------------

    async def shutdown(self, stop_workers: bool = True) -> None:
        """Stop the coordinator and (normally) every worker; then let the process exit."""
        if self._stopping:
            return
        self._stopping = True
        self.record("down", "stopping the cluster")
        process = self._process
        if process is not None and process.returncode is None:
            if process.stdin is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    process.stdin.write(b'{"op": "shutdown"}\n')
                    process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                process.kill()
                await process.wait()
        if stop_workers:
            await asyncio.gather(*(self._stop_worker(runtime) for runtime in self.nodes.values()),
                                 return_exceptions=True)
        for rpc in self._rpc_remotes:
            await self._relays.run(rpc.close())
        await self._relays.close([runtime.relay for runtime in self.nodes.values() if runtime.relay])
        for runtime in self.nodes.values():
            await runtime.remote.close()
        self.finished.set()


    async def _stop_worker(self, runtime: NodeRuntime) -> None:
        # A start under way finishes first, so that its worker is stopped too; none begins after `_stopping`.
        async with runtime.starting:
            if runtime.spec is not None:
                await worker.stop(runtime.remote, runtime.spec)


async def _drain(messages: asyncio.Queue[dict[str, Any]], until: Callable[[dict[str, Any]], bool],
                 timeout: float) -> None:
    """Skip a coordinator's messages up to the first for which ``until`` holds (or a silence of ``timeout``)."""
    with contextlib.suppress(TimeoutError):
        while not until(await asyncio.wait_for(messages.get(), timeout)):
            pass


def parse_layer_devices(log_text: str) -> dict[int, int]:
    """llama.cpp's 'layer N assigned to device RPCk' lines → {layer: k} (RPC devices only)."""
    import re

    seen: dict[int, int] = {}
    for match in re.finditer(r"layer\s+(\d+) assigned to device RPC(\d+)", log_text):
        seen[int(match.group(1))] = int(match.group(2))
    return seen


def _layers(layers: tuple[int, int] | None) -> str:
    return f"layers {layers[0]}-{layers[1]}" if layers else "no layers"


def _rate(count: object, seconds: object) -> float | None:
    if isinstance(count, int) and isinstance(seconds, float) and seconds > 0:
        return count / seconds
    return None


# --- the control socket ----------------------------------------------------------------------------


def peer_uid(connection: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (Linux), or None where unknown."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


def checked_request(request: dict[str, Any]) -> dict[str, Any]:
    """A `run` request whose fields have the types the coordinator expects; ValueError names a bad one.

    The control socket takes JSON from any process of this user: a wrong type must be an answer, not a
    coordinator that crashes on every resume until the request gives up.
    """
    def number(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    prompt, messages = request.get("prompt", ""), request.get("messages")
    if not isinstance(prompt, str):
        raise ValueError("'prompt' must be text")
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(message, dict) and all(isinstance(key, str) for key in message) for message in messages)):
        raise ValueError("'messages' must be a list of objects")
    max_tokens = request.get("max_tokens", 128)
    if not (number(max_tokens) and 1 <= max_tokens <= 1 << 24 and max_tokens == int(max_tokens)):
        raise ValueError("'max_tokens' must be a whole number from 1")
    temperature, seed = request.get("temperature", 0.0), request.get("seed")
    if not (number(temperature) and 0.0 <= temperature <= 100.0):
        raise ValueError("'temperature' must be a number from 0")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
        raise ValueError("'seed' must be a whole number")
    return {**request, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": float(temperature)}


async def _serve_client(controller: Controller, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
    async def send(message: dict[str, Any]) -> None:
        # A client gone is a ConnectionError on any loop (uvloop would raise RuntimeError on the write).
        if writer.is_closing():
            raise ConnectionResetError("the client went away")
        writer.write((json.dumps(message) + "\n").encode())
        await writer.drain()

    try:
        # The socket is 0600 in a 0700 folder; this also turns away a user who was let in by a chmod.
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid is not None and uid != os.getuid():
            controller.record("refused", f"refused a control connection from uid {uid} (only uid {os.getuid()} "
                              f"may control this cluster)")
            await send({"error": "this cluster belongs to another user"})
            return
        line = await reader.readline()
        request = json.loads(line) if line else {}
        op = request.get("op") if isinstance(request, dict) else None
        if op == "ping":
            await send({"ok": True, "pid": os.getpid(), "inventory": controller.state.fingerprint()})
        elif op == "status":
            await send(controller.snapshot().to_dict())
        elif op == "watch":
            interval = float(request.get("interval", 1.0))
            while not controller.finished.is_set():
                await send(controller.snapshot().to_dict())
                await controller.wait_change(interval)
        elif op == "run":
            try:
                await controller.generate(checked_request(request), send)
            except ClusterError as exc:
                await send({"event": "error", "message": str(exc)})
        elif op == "profile":
            await controller.reprofile()
            ready = controller.coordinator.state == CoordinatorState.READY
            await send({"ok": ready} if ready else {"error": f"the coordinator did not come back: "
                                                            f"{controller.coordinator.last_error}"})
        elif op == "down":
            await controller.shutdown(stop_workers=not request.get("keep_workers", False))
            await send({"ok": True})
        else:
            await send({"error": f"unknown op {op!r}"})
    except (ConnectionError, json.JSONDecodeError, asyncio.IncompleteReadError):
        pass
    except (ValueError, TypeError) as exc:  # a line over the reader's limit, or a field of the wrong type
        with contextlib.suppress(ConnectionError):
            await send({"error": f"bad request: {exc}"})
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def serve(state: StateDir) -> int:
    """Run the controller for the cluster whose launch files are in ``state``."""
    controller = Controller(*read_launch(state), state)
    state.socket.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(
        lambda r, w: _serve_client(controller, r, w), path=str(state.socket))
    state.socket.chmod(0o600)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(controller.shutdown()))
    controller.record("controller", f"controller started (pid {os.getpid()})")
    _serve_metrics(controller, loop)
    await _serve_api(controller)
    await controller.start_nodes()

    async def first_start() -> None:
        try:
            await controller.start_coordinator()
        except ClusterError as exc:
            controller.coordinator.state = CoordinatorState.FAILED
            controller.coordinator.last_error = str(exc)
            controller.record("error", str(exc))

    controller._spawn(first_start())
    await controller.finished.wait()
    if controller.api is not None:
        await controller.api.close()
    if controller.metrics is not None:
        await asyncio.to_thread(controller.metrics.close)  # a scrape in progress needs this loop to finish
    server.close()
    state.socket.unlink(missing_ok=True)
    state.pid.unlink(missing_ok=True)
    return 0


async def _serve_api(controller: Controller) -> None:
    """Start the OpenAI-compatible API; a port in use is an event and a warning, not a reason to stop."""
    settings = controller.inventory.api
    try:
        controller.api = await serve_api(controller, settings.host, settings.port)
    except OSError as exc:
        controller.record("api-failed", f"no API endpoint: cannot listen on {settings.host}:{settings.port} "
                          f"({exc.strerror or exc}); fix: set api.port (0: any free port)")
        return
    controller.record("api", f"OpenAI-compatible API on http://{controller.api.address}/v1")


def _serve_metrics(controller: Controller, loop: asyncio.AbstractEventLoop) -> None:
    """Start the Prometheus endpoint; a port in use is an event and a warning, not a reason to stop."""
    settings = controller.inventory.metrics
    if not settings.enabled:
        return
    try:
        controller.metrics = serve_metrics(settings.host, settings.port, controller.snapshot, loop)
    except OSError as exc:
        controller.record("metrics-failed", f"no metrics endpoint: cannot listen on {settings.host}:{settings.port} "
                          f"({exc.strerror or exc}); fix: set metrics.port (0: any free port) or "
                          "metrics.enabled: false")
        return
    controller.record("metrics", f"Prometheus metrics on http://{controller.metrics.address}/metrics")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached controller process."""
    parser = argparse.ArgumentParser(description="ggml-cluster controller (started by `ggml-cluster up`)")
    parser.add_argument("state_dir")
    args = parser.parse_args(argv)
    state = StateDir(Path(args.state_dir))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("asyncssh").setLevel(logging.WARNING)  # one line per channel otherwise
    state.write_pid()
    # The relays' thread (RPC to the workers) shares the GIL with this loop, which handles each token as the
    # coordinator starts the next one: a waiting thread gets the GIL after this interval at the latest (5 ms by
    # default). 0.2 ms: ssh decode +2-3% (paired rounds, two runs of 6 and 8).
    sys.setswitchinterval(GIL_SWITCH_S)
    return asyncio.run(serve(state))


if __name__ == "__main__":
    sys.exit(main())
