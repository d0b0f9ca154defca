"""The nodes: each one's life (deploy, start or adopt its worker, follow its supervisor, reconnect, try again),
and the fleet of them (which a plan may count on, their relays and samples, stopping them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from core.controller.events import EventLog, Tasks
from core.controller.health import READY_TIMEOUT_S, NodeRuntime, Probe, WorkerHealth
from core.errors import ClusterError, ConnectError, DeployError, MissingDevice, PlanError, WorkerError
from core.inventory import Inventory, Node
from core.nodes import worker
from core.nodes.deploy import built_for, deploy_worker, deployable, node_root
from core.nodes.devices import backend_environment, describe
from core.nodes.probe import PARALLEL_NODES, local_cpu_flags, node_backend, probe_node
from core.nodes.remote import remote_for
from core.nodes.sample import Sample, parse_sample, sample_command, usage
from core.nodes.shell import Remote
from core.nodes.ssh import SshRemote
from core.rpc.relay import Link, RelayHost
from core.state import StateDir
from core.status import NodeState, NodeStatus
from core.version import Version

NODE_RETRY_MIN_S = 5.0      # a failed node is tried again after this, then twice as long each time ...
NODE_RETRY_MAX_S = 60.0     # ... up to this
RECONNECT_MAX_DELAY_S = 10.0  # between tries to reopen a lost connection
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


class NodeWatcher:
    """One node's life: reach and deploy it, start its worker under supervision (or adopt the running one),
    follow the supervisor's events, reopen a lost connection, and after a failure try again with backoff."""

    def __init__(self, runtime: NodeRuntime, fleet: Fleet) -> None:
        self.runtime = runtime
        self.fleet = fleet
        self.log = fleet.log
        self.health = fleet.health

    async def run(self) -> None:
        """For as long as the controller runs."""
        runtime = self.runtime
        backoff = NODE_RETRY_MIN_S
        while not self.fleet.stopping:
            runtime.failed.clear()
            try:
                await self._bring_up()
                await self._watch()
                backoff = NODE_RETRY_MIN_S
            except ClusterError as exc:
                self.health.fail(runtime, str(exc), held=isinstance(exc, MissingDevice))
            if self.fleet.stopping:
                return
            if runtime.status.state == NodeState.FAILED:
                runtime.status.retry_at = None if runtime.held else time.time() + backoff
                self.log.notify()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.retry.wait(), None if runtime.held else backoff)
                runtime.held = False
                runtime.retry.clear()
                runtime.status.retry_at = None
                backoff = min(backoff * 2, NODE_RETRY_MAX_S)
                if not self.fleet.stopping:
                    runtime.attempts += 1
                    self.log.record("node-retry", f"trying the node again (attempt {runtime.attempts})",
                                    runtime.name)

    async def _bring_up(self) -> None:
        """Reach and deploy the node (once), then start its worker under supervision or adopt the running one."""
        runtime = self.runtime
        status = runtime.status
        if runtime.spec is None:
            runtime.spec = await self._prepare()
        else:
            await runtime.remote.connect()  # a retry: whatever the connection went through since
        spec = runtime.spec
        runtime.offset = await worker.events_size(runtime.remote, spec)
        status.state = NodeState.STARTING
        self.log.notify()
        current = await worker.running_supervisor(runtime.remote, spec)
        if current is None and await runtime.remote.port_open(runtime.node.rpc_port, spec.bind):
            # Probing it would talk to somebody else's server as if it were ours.
            raise DeployError(f"node {runtime.name}: port {runtime.node.rpc_port} on {status.host} is already in "
                              "use by another process", "fix: stop that process or set another rpc_port")
        if current is None or current[1] != spec.command():
            # Before it starts: a worker without its backend's device would serve the CPU alone, unnoticed.
            device = await worker.backend_device(runtime.remote, spec, status.backend)
        else:
            # The running worker is adopted whatever its listing says: it has served as it is (a busy GPU may
            # even refuse a second process); the listing only names its device.
            device = None
            with contextlib.suppress(ClusterError):
                device = await worker.backend_device(runtime.remote, spec, status.backend)
        status.device = describe(device) if device else ""
        async with runtime.starting:
            if self.fleet.stopping:
                return  # `down` came first
            adopted = await worker.start(runtime.remote, spec)
        if adopted:
            # Its "started" event came before the events followed from now on; the watchdog's look for a stopped
            # worker and a reconnect while the coordinator uses it both go by this pid.
            status.pid = await worker.running_worker(runtime.remote, spec)
        self.log.record("worker", "adopted the running worker" if adopted else "worker started", runtime.name)
        await self._connect_worker()
        self.fleet.sample(runtime)

    async def _prepare(self) -> worker.WorkerSpec:
        """Reach, probe and deploy the node; a local node's worker is this machine's build for its backend."""
        runtime, fleet = self.runtime, self.fleet
        node, status, remote = runtime.node, runtime.status, runtime.remote
        status.state = NodeState.CONNECTING
        self.log.notify()
        loop = asyncio.get_running_loop()

        def progress(message: str, fraction: float | None) -> None:
            loop.call_soon_threadsafe(self._show_progress, message, fraction)

        async with fleet.parallel:
            facts = await probe_node(remote)
            status.arch = facts.arch
            status.backend = node_backend(node.backend, facts)[0]  # shown while it deploys, and if that fails
            status.state = NodeState.DEPLOYING
            self.log.notify()
            deployment = await deploy_worker(remote, deployable(fleet.inventory, node), facts,
                                             node_root(remote, node.workdir), local_flags=fleet.local_flags,
                                             progress=progress)
        status.backend = deployment.backend
        runtime.features = facts.cpu.flags
        runtime.built_for = await built_for(remote, deployment)
        status.detail = f"{deployment.reason}; worker {deployment.how}"
        status.progress = None
        status.last_status = ""  # it held deployment progress
        self.log.record("deploy", f"{deployment.backend} worker {deployment.how} ({deployment.reason})", node.name)
        direct = node.kind == "ssh" and node.transport == "direct"
        return worker.WorkerSpec(node=node.name, workdir=worker.worker_dir(fleet.inventory, node, fleet.state, remote),
                                 binary=deployment.binary, port=node.rpc_port, threads=node.threads,
                                 bind=node.host if direct and node.host else "127.0.0.1",
                                 cache=str(fleet.state.worker_cache) if node.kind == "local" else None,
                                 env=worker.environment(node, backend_environment(deployment.backend,
                                                                                  facts.vulkan_devices)))

    def _show_progress(self, message: str, fraction: float | None) -> None:
        self.runtime.status.last_status = message
        self.runtime.status.progress = fraction
        self.log.notify()

    async def _connect_worker(self) -> None:
        """Reach the node's worker (again): the endpoint this machine probes it on, the relay, and readiness.

        A worker the running coordinator uses is ready as it is: it serves one client at a time, so a probe
        would hang behind the coordinator (and the coordinator would have died had the worker gone)."""
        runtime = self.runtime
        spec = runtime.spec
        if spec is None:
            return
        direct = runtime.node.kind == "ssh" and runtime.node.transport == "direct"
        runtime.endpoint = (spec.bind, spec.port) if direct else await runtime.remote.endpoint(spec.port)
        await self.fleet.relay(runtime, runtime.endpoint)
        if self.fleet.hooks.in_use(runtime.name) and runtime.status.pid is not None:
            self.health.ready(runtime)
        else:
            runtime.status.state = NodeState.STARTING
            runtime.ready.clear()
            self.fleet.tasks.spawn(self.health.until_ready(runtime, lambda: self.fleet.stopping))

    async def _watch(self) -> None:
        """Follow the worker's events until the node fails (or the controller stops); a follow that ends
        means the connection to the node was lost: reconnect and carry on where it left off. Returns early
        when the worker did not survive the lost connection: it is started afresh."""
        runtime = self.runtime
        while not self.fleet.stopping:
            follow = asyncio.ensure_future(self._follow())
            failed = asyncio.ensure_future(runtime.failed.wait())
            await asyncio.wait([follow, failed], return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            if not follow.done():
                follow.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClusterError):
                    await follow
                return  # failed: the node's life starts over after a backoff
            with contextlib.suppress(ClusterError):
                follow.result()
            if self.fleet.stopping or runtime.failed.is_set() or not await self._reconnect():
                return

    async def _reconnect(self) -> bool:
        """The connection to the node is gone (its worker may well be running): reopen it with backoff; False
        when the worker is gone as well."""
        runtime = self.runtime
        status = runtime.status
        lost = time.monotonic()
        runtime.down_since = lost
        status.state = NodeState.RECONNECTING
        runtime.ready.clear()
        self.log.record("node-reconnecting", f"lost the connection to {status.host}; reconnecting (its worker is "
                        "left running)", runtime.name)
        delay = 1.0
        while not self.fleet.stopping:
            try:
                await runtime.remote.connect()
                break
            except ClusterError as exc:
                status.last_error = str(exc)
                runtime.outcomes += 1
                self.log.notify()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.retry.wait(), delay)
                runtime.retry.clear()
                delay = min(delay * 2, RECONNECT_MAX_DELAY_S)
        if self.fleet.stopping:
            return False
        runtime.down_since = None
        spec = runtime.spec
        current = await worker.running_supervisor(runtime.remote, spec) if spec is not None else None
        if spec is not None and current is not None and current[1] == spec.command():
            self.log.record("node-reconnected", f"reconnected after {time.monotonic() - lost:.1f}s; its worker "
                            "ran on and was adopted", runtime.name)
            await self._connect_worker()
            return True
        self.log.record("node-reconnected", f"reconnected after {time.monotonic() - lost:.1f}s; its worker is "
                        "gone, starting a new one", runtime.name)
        return False

    async def _follow(self) -> None:
        """The supervisor's events from where the last follow left off, until the connection ends."""
        runtime = self.runtime
        if runtime.spec is None:
            return
        async for line in runtime.remote.follow(worker.follow_command(runtime.spec, runtime.offset)):
            runtime.offset += len(line.encode()) + 1
            event = worker.parse_event(line)
            if event is not None and not self.fleet.stopping:
                await self._on_event(event)

    async def _on_event(self, event: worker.WorkerEvent) -> None:
        runtime = self.runtime
        status = runtime.status
        if event.kind == "started":
            status.pid = event.pid
            # Every restart follows an "exit", which clears `ready`; a "started" while ready is the
            # process the probe has already checked (its event can arrive after the probe's answer).
            if status.state != NodeState.STARTING and not runtime.ready.is_set():
                status.state = NodeState.STARTING
                self.fleet.tasks.spawn(self.health.until_ready(runtime, lambda: self.fleet.stopping))
            self.log.notify()
        elif event.kind == "exit":
            runtime.ready.clear()
            status.state = NodeState.RESTARTING
            status.restarts += 1
            status.pid = None
            text = await worker.read_log(runtime.remote, runtime.spec, event.log_offset or 0) if runtime.spec else ""
            cause = worker.classify_exit(event.code if event.code is not None else -1, text)
            if runtime.killed_for is not None:
                cause, runtime.killed_for = f"killed by the controller: {runtime.killed_for}", None
            status.last_status = cause
            status.last_error = cause
            self.log.record("worker-exit", f"worker exited after {event.ran_s}s: {cause}", runtime.name)
            self.fleet.hooks.worker_lost(runtime.name, False)
        elif event.kind == "backoff":
            self.log.record("worker-restart", f"restarting the worker in {event.seconds}s", runtime.name)
        elif event.kind == "failed":
            await self.health.fail_gone(runtime, f"crash loop: {status.last_status}", event)
            self.fleet.hooks.worker_lost(runtime.name, True)


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
        self.relays = RelayHost()
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
