"""One node's life: reach and deploy it, start or adopt its worker, follow its supervisor, reopen a lost
connection, and after a failure try again with backoff (the fleet, core.controller.fleet, runs one per node)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from core.controller.health import NodeRuntime
from core.errors import ClusterError, DeployError, MissingDevice
from core.nodes import worker
from core.nodes.deploy import built_for, deploy_worker, deployable, node_root
from core.nodes.devices import backend_environment, describe
from core.nodes.probe import node_backend, probe_node
from core.status import NodeState

if TYPE_CHECKING:
    from core.controller.fleet import Fleet

NODE_RETRY_MIN_S = 5.0      # a failed node is tried again after this, then twice as long each time ...
NODE_RETRY_MAX_S = 60.0     # ... up to this
RECONNECT_MAX_DELAY_S = 10.0  # between tries to reopen a lost connection


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
