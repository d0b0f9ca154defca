"""The fleet of nodes: which a plan may count on, their relays and samples, stopping them. Each node's own life is
a NodeWatcher's (core.controller.watcher)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from core.controller.events import EventLog, Tasks
from core.controller.health import READY_TIMEOUT_S, NodeRuntime, Probe, WorkerHealth
from core.controller.watcher import NodeWatcher
from core.errors import ClusterError, ConnectError, PlanError, WorkerError
from core.inventory import Inventory, Node
from core.nodes import worker
from core.nodes.probe import PARALLEL_NODES, local_cpu_flags
from core.nodes.remote import remote_for
from core.nodes.sample import Sample, parse_sample, sample_command, usage
from core.nodes.shell import Remote
from core.nodes.ssh import SshRemote
from core.rpc.relay import Link, RelayHost
from core.state import StateDir
from core.status import NodeState, NodeStatus
from core.version import Version

# A node whose connection is gone is waited for this long (a network blip, a restarted sshd) before the cluster
# re-plans without it; it is tried for as long as the controller runs, and used again once it is back.
RECONNECT_GRACE_S = 30.0
METRICS_INTERVAL_S = 2.0    # how often each worker's CPU, memory and GPU use is sampled on its node


@dataclass(frozen=True)
class FleetHooks:
    """What the nodes tell the rest of the daemon, and ask of it."""

    in_use: Callable[[str], bool]             # the running coordinator holds this node's worker
    # Its worker exited (False) or the node failed (True): the coordinator's link to that worker is gone.
    worker_lost: Callable[[str, bool], None]
    node_ready: Callable[[str], None]         # a node became ready (a failed plan may fit; a left-out one be used)


class Fleet:
    """Every node of the cluster: their lives, which of them a plan may count on now, their relays (the
    coordinator's observed path to each worker) and samples, and stopping them all."""

    def __init__(self, inventory: Inventory, state: StateDir, log: EventLog, tasks: Tasks, hooks: FleetHooks, *,
                 client: Version, probe: Probe | None = None, reach: Callable[[Node], Remote] = remote_for) -> None:
        """``client``: the RPC version the coordinator speaks (workers must match it); ``probe``: how a worker
        is asked HELLO, and ``reach``: how a node is reached (a test's stand-ins; by default TCP, and SSH or
        this machine)."""
        self.inventory = inventory
        self.state = state
        self.log = log
        self.tasks = tasks
        self.hooks = hooks
        self.health = WorkerHealth(log, client, hooks.in_use, hooks.node_ready, probe)
        self.nodes = {node.name: NodeRuntime(node=node, remote=reach(node), status=NodeStatus(
            name=node.name, host=node.host or "localhost", kind=node.kind, rpc_port=node.rpc_port,
            backend=node.backend, mem_cap=node.memory))  # backend: until the probe chooses one for `auto`
            for node in inventory.nodes}
        self.parallel = asyncio.Semaphore(PARALLEL_NODES)
        self.local_flags = local_cpu_flags()
        self.relays = RelayHost(inventory.worker_ports)
        self.stopping = False
        self._lives: dict[str, asyncio.Future[None]] = {}
        self._sampled: set[str] = set()
        self._rpc_remotes: list[SshRemote] = []  # the SSH nodes' RPC connections, on the relays' loop

    def start(self) -> None:
        """Begin every node's life."""
        for runtime in self.nodes.values():
            self._lives[runtime.name] = asyncio.ensure_future(NodeWatcher(runtime, self).run())

    def statuses(self) -> list[NodeStatus]:
        """A copy of every node's status, with its relay's counters."""
        copies = []
        for runtime in self.nodes.values():
            status = NodeStatus(**vars(runtime.status))
            if runtime.endpoint is not None:
                status.endpoint = f"{runtime.endpoint[0]}:{runtime.endpoint[1]}"
            if runtime.relay is not None:
                seen = runtime.relay.stats
                status.computes, status.recomputes = seen.computes, seen.recomputes
                status.bytes_to, status.bytes_from = seen.bytes_to, seen.bytes_from
                status.compute_ms, status.link = seen.compute_ms, "connected" if seen.connected else "idle"
                status.compute_ms_total, status.computes_timed = seen.compute_ms_total, seen.computes_timed
                status.connections = seen.connections
                status.session = seen.session.status() if seen.session is not None else None
            elif runtime.relayed is not None:
                status.link = "direct"
            copies.append(status)
        return copies

    def usable(self) -> list[NodeRuntime]:
        """Nodes a plan may count on: not failed, and not unreachable for longer than a blip."""
        now = time.monotonic()
        return [runtime for runtime in self.nodes.values() if not runtime.status.left_out
                and (runtime.down_since is None or now - runtime.down_since < RECONNECT_GRACE_S)]

    async def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[NodeRuntime]:
        """Wait until every usable node is ready; ``timeout`` runs from the last node done deploying."""
        deadline = time.monotonic() + timeout
        while True:
            if any(r.status.state in (NodeState.PENDING, NodeState.CONNECTING, NodeState.DEPLOYING)
                   for r in self.nodes.values()):
                deadline = time.monotonic() + timeout  # builds take as long as they take
            usable = self.usable()
            if usable and all(runtime.ready.is_set() for runtime in usable):
                return usable
            if not usable:
                reasons = "; ".join(f"{r.name}: {r.status.last_error or r.status.state}" for r in self.nodes.values())
                raise PlanError(f"every node has failed or is unreachable ({reasons})")
            if time.monotonic() > deadline:
                waiting = ", ".join(f"{r.name} ({r.status.state})" for r in usable if not r.ready.is_set())
                raise WorkerError(f"workers not ready after {timeout:g}s: {waiting}")
            await self.log.wait_change(0.5)

    async def verified(self) -> list[NodeRuntime]:
        """Ready nodes whose workers answer HELLO right now (the coordinator aborts on one that does not)."""
        while True:
            usable = await self.wait_ready()
            if all(await asyncio.gather(*(self.health.verify(runtime) for runtime in usable))):
                return usable

    async def relay(self, runtime: NodeRuntime, endpoint: tuple[str, int]) -> None:
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
            name, spec = runtime.name, runtime.spec

            def report(message: str) -> None:
                self.log.record("relay", message, name)

            connect = None
            if runtime.node.kind == "ssh" and spec is not None:
                rpc = SshRemote(runtime.node)
                self._rpc_remotes.append(rpc)

                def connect(link: Link) -> Coroutine[Any, Any, None]:
                    return rpc.open_channel(spec.port, link)

            runtime.relay, runtime.relayed = await self.relays.relay(endpoint, report, connect)
        runtime.relay.target = endpoint

    def sample(self, runtime: NodeRuntime) -> None:
        """Sample the node's worker from now on (once per node)."""
        if runtime.name not in self._sampled:
            self._sampled.add(runtime.name)
            self.tasks.spawn(self._sample(runtime))

    async def _sample(self, runtime: NodeRuntime) -> None:
        """The worker's CPU, memory and GPU use, read on its node every few seconds over its own connection."""
        status = runtime.status
        if runtime.spec is None:
            return
        command = sample_command(runtime.spec.workdir, status.backend)  # both are settled once the worker runs
        previous: tuple[Sample, float] | None = None
        while not self.stopping:
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
            self.log.notify()

    def retry(self) -> list[NodeRuntime]:
        """Try every failed or unreachable node now; the nodes being tried."""
        waiting = [runtime for runtime in self.nodes.values()
                   if runtime.status.left_out or runtime.status.state == NodeState.RECONNECTING]
        for runtime in waiting:
            runtime.retry.set()
        return waiting

    async def stop_lives(self) -> None:
        """End every node's life (a worker start under way finishes first; none begins after)."""
        self.stopping = True
        for runtime in self.nodes.values():
            runtime.retry.set()
            async with runtime.starting:
                life = self._lives.get(runtime.name)
                if life is not None:
                    life.cancel()

    async def stop_workers(self) -> list[str]:
        """Stop every worker; ``node: why`` for each that could not be reached, with the worker left running."""
        left = await asyncio.gather(*(self._stop_worker(runtime) for runtime in self.nodes.values()))
        return [line for line in left if line]

    async def _stop_worker(self, runtime: NodeRuntime) -> str | None:
        if runtime.spec is None:
            return None
        try:
            if runtime.down_since is not None or runtime.status.state == NodeState.RECONNECTING:
                await runtime.remote.connect()
            await worker.stop(runtime.remote, runtime.spec)
        except ClusterError as exc:
            pid = f" (pid {runtime.status.pid})" if runtime.status.pid else ""
            return (f"{runtime.name}: could not reach {runtime.status.host} ({exc}); its worker{pid} may still "
                    "be running there: `ggml-cluster down` again stops it once the node is back")
        return None

    async def close(self) -> None:
        """Close the relays, the RPC connections and every node's connection."""
        for rpc in self._rpc_remotes:
            await self.relays.run(rpc.close())
        await self.relays.close([runtime.relay for runtime in self.nodes.values() if runtime.relay])
        for runtime in self.nodes.values():
            await runtime.remote.close()
