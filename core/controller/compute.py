"""Failed graph computes that patched workers report (on the next answer the coordinator waits for anyway) and the
coordinator retries in place: an event and counters on the node, and no restart of anything. Only when the
coordinator gives up on one (``persistent``, then it exits with EXIT_COMPUTE_FAILED) is that node's worker
restarted, the way the watchdog restarts a hung one: killed, for its supervisor to start afresh (with backoff,
and the crash-loop rule); the coordinator's own restart and the request's resume are those of any lost
coordinator."""

from __future__ import annotations

import time
from collections.abc import Mapping

from core.controller.events import EventLog
from core.controller.fleet import Fleet
from core.controller.health import NodeRuntime
from core.engine.protocol import EXIT_COMPUTE_FAILED, ComputeFailed, ComputeRetried, status_name
from core.errors import ClusterError
from core.status import NodeState


class ComputeFaults:
    """What the running coordinator reports of failed computes, by node (its RPC endpoints name them)."""

    def __init__(self, fleet: Fleet, log: EventLog) -> None:
        self.fleet = fleet
        self.log = log
        self.endpoints: dict[str, str] = {}  # the running coordinator's RPC endpoints → node names
        self.gave_up: str | None = None      # where it gave up on a persistent failure (a node, else the endpoint)

    def connect(self, endpoints: Mapping[str, str]) -> None:
        """A new coordinator, with these endpoints (``host:port`` → node name)."""
        self.endpoints = dict(endpoints)
        self.gave_up = None

    def seen(self, answer: ComputeFailed | ComputeRetried) -> None:
        """A report from the coordinator: an event, and the node's counters."""
        name = self.endpoints.get(answer.endpoint)
        runtime = self.fleet.nodes.get(name) if name is not None else None
        where = "" if runtime is not None else f" at {answer.endpoint}"  # a worker the controller did not plan
        if isinstance(answer, ComputeRetried):
            if runtime is not None:
                runtime.status.compute_retries += 1
                runtime.status.compute_retry_ms_total += answer.retry_ms
            self.log.record("compute-retried", f"retried in place{where} in {answer.retry_ms:.1f} ms after "
                            f"{answer.attempts} attempt{'s' if answer.attempts != 1 else ''}", name)
            return
        failure = f"device {answer.device}: {status_name(answer.status)}"
        if runtime is not None:
            runtime.status.compute_failures += answer.failures
            runtime.status.last_compute_failure = failure
            runtime.status.last_compute_failure_at = time.time()
        several = f" ({answer.failures} failed computes)" if answer.failures > 1 else ""
        if not answer.persistent:
            self.log.record("compute-failed", f"compute failed{where} on {failure}{several}; retrying in place "
                            f"(attempt {answer.attempt})", name)
            return
        self.gave_up = name if name is not None else answer.endpoint
        self.log.record("compute-failed", f"compute failed{where} on {failure}{several}; persistent (attempt "
                        f"{answer.attempt}): the coordinator gives up, its worker and the coordinator are restarted",
                        name)
        if runtime is not None:
            # Not ready from now on: the coordinator's restart waits for the worker's (see `restart_worker`).
            runtime.ready.clear()
            runtime.status.state = NodeState.RESTARTING
            self.log.notify()

    def cause(self, code: int) -> str:
        """Why the coordinator exited with ``code``, when it gave up on a persistent compute failure ('' else)."""
        if code != EXIT_COMPUTE_FAILED or self.gave_up is None:
            return ""
        node = "" if self.gave_up in self.fleet.nodes else "the worker at "
        return f"it gave up on a persistent compute failure on {node}{self.gave_up}"

    async def restart_worker(self) -> None:
        """Once the coordinator that gave up has exited: kill that node's worker for its supervisor to restart
        (killed earlier, the worker would take the coordinator down with a lost connection instead)."""
        runtime: NodeRuntime | None = self.fleet.nodes.get(self.gave_up or "")
        if runtime is None:
            return
        try:
            await self.fleet.health.kill(runtime, "a persistent compute failure")
        except ClusterError as exc:  # the node is unreachable: its reconnect adopts or restarts the worker
            self.log.record("worker-restart", f"could not kill the worker after a persistent compute failure: {exc}",
                            runtime.name)
