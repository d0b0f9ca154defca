"""Is a node's worker fit to serve? Its HELLO answer, told apart from a worker that is down, hung or stopped.

A worker serves one client at a time: it is probed only while the coordinator does not use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from core.controller.events import EventLog
from core.errors import ClusterError, ConnectError, WorkerDown, WorkerError
from core.inventory import Node
from core.nodes import worker
from core.nodes.shell import Remote
from core.rpc.relay import Relay
from core.rpc.wire import WorkerInfo, probe_worker
from core.status import NodeState, NodeStatus
from core.version import Version

READY_TIMEOUT_S = 60.0  # a started worker must answer HELLO within this
PROBE_TIMEOUT_S = 3.0

Probe = Callable[[str, int], Awaitable[WorkerInfo]]


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
    relay: Relay | None = None               # the observing relay on the coordinator's path to it (not direct)
    relayed: tuple[str, int] | None = None   # where the coordinator connects: the relay, or the worker itself
    failed: asyncio.Event = field(default_factory=asyncio.Event)  # set: give up on this worker, try again later
    retry: asyncio.Event = field(default_factory=asyncio.Event)   # set: try a failed or unreachable node now
    attempts: int = 0                         # tries to bring it back after it failed
    outcomes: int = 0                         # tries that ended: ready, failed, or a reconnect that did not work
    offset: int = 0                           # bytes of the worker's events.jsonl handled so far
    down_since: float | None = None           # when the connection to it was lost (monotonic)
    killed_for: str | None = None             # why the controller killed its worker, until that exit is seen
    # Failed for a reason that does not pass by itself (a worker built for another CPU, or one without its
    # backend's device): tried again only when asked (`up`), never on a timer.
    held: bool = False
    built_for: str | None = None              # the -march its worker was built with, when known
    features: frozenset[str] = frozenset()    # its CPU's features, as probed

    @property
    def name(self) -> str:
        """The node's name."""
        return self.node.name


class WorkerHealth:
    """Probes workers until they are ready, checks them before a coordinator starts, and marks and kills what
    fails. ``in_use(name)``: whether the running coordinator holds that worker (then it is never probed)."""

    def __init__(self, log: EventLog, client: Version, in_use: Callable[[str], bool], on_ready: Callable[[str], None],
                 probe: Probe | None = None) -> None:
        self.log = log
        self.in_use = in_use
        self.on_ready = on_ready
        self._probe: Probe = probe or (lambda host, port: probe_worker(host, port, PROBE_TIMEOUT_S, client))

    def ready(self, runtime: NodeRuntime) -> None:
        """Mark a node ready (it answered, or the coordinator uses it)."""
        runtime.status.state = NodeState.READY
        runtime.status.failures = 0
        runtime.outcomes += 1
        runtime.ready.set()
        self.log.notify()
        self.on_ready(runtime.name)

    def fail(self, runtime: NodeRuntime, reason: str, *, held: bool = False) -> None:
        """Leave the node out: its life tries it again later, or with ``held`` only when `up` asks."""
        runtime.ready.clear()
        runtime.held = held
        runtime.status.state = NodeState.FAILED
        runtime.status.last_error = reason
        runtime.status.failures += 1
        runtime.outcomes += 1
        runtime.failed.set()
        then = "tried again on the next `ggml-cluster up`" if held else "tried again later"
        self.log.record("node-failed", f"{reason}; node excluded, {then}", runtime.name)

    async def fail_gone(self, runtime: NodeRuntime, reason: str, last: worker.WorkerEvent | None = None) -> None:
        """Leave out a node whose supervisor gave up, for the reason it gave (``last``, else its last event) when it
        gave one that no retry would change: a worker built for another CPU."""
        if last is None and runtime.spec is not None:
            last = await worker.last_event(runtime.remote, runtime.spec)
        if last is not None and last.kind == "failed" and last.cause == worker.ILLEGAL_INSTRUCTION:
            self.fail(runtime, worker.wrong_cpu(runtime.name, runtime.built_for, runtime.features), held=True)
        else:
            self.fail(runtime, reason)

    async def until_ready(self, runtime: NodeRuntime, stopping: Callable[[], bool]) -> None:
        """Probe a starting worker until it answers HELLO (ready), answers wrongly or not in time (failed)."""
        status = runtime.status
        if runtime.endpoint is None:
            return
        host, port = runtime.endpoint
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not stopping() and status.state == NodeState.STARTING:
            if self.in_use(runtime.name) and runtime.ready.is_set():
                return  # in use by the coordinator: never probe a busy worker
            try:
                info = await self._probe(host, port)
            except WorkerError as exc:
                self.fail(runtime, str(exc))
                return
            except ClusterError as exc:
                if time.monotonic() > deadline:
                    self.fail(runtime, f"no HELLO answer within {READY_TIMEOUT_S:g}s: {exc}")
                    return
                await asyncio.sleep(0.2)
                continue
            status.mem_total, status.mem_free = info.mem_total, info.mem_free
            status.rtt_ms = None if info.rtt_s is None else info.rtt_s * 1000
            status.compute_status = info.compute_status
            self.log.record("worker-ready", f"RPC {info.version}, {len(info.devices)} device(s), "
                            f"{info.mem_free >> 20} MiB free of {info.mem_total >> 20} MiB"
                            + ("; reports failed computes (retried in place)" if info.compute_status else ""),
                            runtime.name)
            self.ready(runtime)
            return

    async def verify(self, runtime: NodeRuntime) -> bool:
        """Whether a ready worker answers HELLO right now (the coordinator aborts on one that does not). One
        that does not is down (its supervisor restarts it), hung (killed, for its supervisor to restart) or gone
        with its supervisor (failed)."""
        if runtime.endpoint is None or runtime.spec is None:
            return False
        pid = runtime.status.pid
        try:
            info = await self._probe(*runtime.endpoint)
            runtime.status.compute_status = info.compute_status
            runtime.status.rtt_ms = None if info.rtt_s is None else info.rtt_s * 1000
            return True
        except WorkerError as exc:
            self.fail(runtime, str(exc))
            return False
        except ClusterError as exc:
            try:
                supervisor = await worker.running_supervisor(runtime.remote, runtime.spec)
            except ConnectError:
                return False  # the node's connection is down: it reconnects, and is waited for a while
            if supervisor is None:
                await self.fail_gone(runtime, f"its worker and supervisor are gone ({exc})")
                return False
            if isinstance(exc, WorkerDown):
                # Died a moment ago and its supervisor's "exit" is still on the way: killing it again now
                # would kill its replacement and double the supervisor's backoff. Wait for it to come back
                # instead (unless that exit, and maybe the restart, were handled while we probed).
                if runtime.status.pid == pid and runtime.status.state == NodeState.READY:
                    runtime.ready.clear()
                    runtime.status.state = NodeState.RESTARTING
                    self.log.record("worker-down", f"worker is not listening ({exc}); waiting for its supervisor "
                                    "to restart it", runtime.name)
                return False
            runtime.ready.clear()
            runtime.status.state = NodeState.RESTARTING
            self.log.record("worker-hung", f"worker does not answer ({exc}); killing it for its supervisor to "
                            "restart", runtime.name)
            await self.kill(runtime, f"it did not answer ({exc})")
            return False

    @staticmethod
    async def kill(runtime: NodeRuntime, why: str) -> None:
        """Kill the node's worker (SIGKILL) for its supervisor to restart; ``why`` becomes the exit's cause (not
        "killed by SIGKILL", which would read as if something else had killed it)."""
        if runtime.spec is not None:
            runtime.killed_for = why
            await worker.kill(runtime.remote, runtime.spec)

    @staticmethod
    async def stopped(runtime: NodeRuntime) -> bool:
        """Whether the node's worker is in the stopped state (an unreachable node's is not known to be)."""
        if runtime.status.pid is None:
            return False
        try:
            return await worker.stopped(runtime.remote, runtime.status.pid)
        except ConnectError:
            return False
