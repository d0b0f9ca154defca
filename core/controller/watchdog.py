"""The watchdog: is a silent pipeline hung, or still at work?

A long prompt, a replay after a recovery or a model load over a slow link can go for longer than the watchdog
without a single message from the coordinator; a stopped worker goes silent the same way. What tells them apart
is whether anything moves: bytes through the relays, CPU time of the coordinator or of a worker. Two readings a
moment apart answer that; only nothing moving at all (or a worker in the stopped state) is a hang. None of this
runs on the hot path: only after the watchdog's bound has passed without a message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from core.controller.events import EventLog
from core.controller.fleet import Fleet
from core.controller.health import NodeRuntime
from core.controller.placement import Placement
from core.errors import ConnectError
from core.nodes.sample import parse_sample, process_cpu_seconds, sample_command

LIVENESS_WINDOW_S = 1.0  # a silent pipeline is looked at twice this far apart before it is called hung
# Less CPU than this in a reading's window is a process waiting, not working (the sampling's own noise).
MIN_CPU_S = 0.02


@dataclass(frozen=True)
class Reading:
    """What the pipeline had done by one moment: counters that only grow while it works."""

    relay_bytes: int = 0                                  # both ways, summed over the observed nodes
    coordinator_cpu_s: float | None = None
    worker_cpu_s: dict[str, float | None] = field(default_factory=dict)  # node → its worker's CPU seconds


def moved(before: Reading, after: Reading) -> list[str]:
    """What made progress between two readings, in words (empty: nothing did)."""
    seen = []
    if after.relay_bytes > before.relay_bytes:
        seen.append(f"{after.relay_bytes - before.relay_bytes} bytes through the relays")
    if _grew(before.coordinator_cpu_s, after.coordinator_cpu_s):
        seen.append("the coordinator's CPU")
    for name, cpu_s in after.worker_cpu_s.items():
        if _grew(before.worker_cpu_s.get(name), cpu_s):
            seen.append(f"worker {name}'s CPU")
    return seen


def _grew(before: float | None, after: float | None) -> bool:
    return before is not None and after is not None and after - before >= MIN_CPU_S


class Watchdog:
    """Decides, once the bound passed in silence, whether the pipeline is hung, and kills what is stuck.

    ``coordinator_pid`` and ``kill_coordinator`` reach the coordinator's owner, which restarts it."""

    def __init__(self, fleet: Fleet, placement: Placement, log: EventLog, bound_s: float,
                 window_s: float = LIVENESS_WINDOW_S) -> None:
        """``bound_s``: the silence (seconds) after which it looks; ``window_s``: how far apart its two readings
        are. `watch` names the coordinator to kill."""
        self.fleet = fleet
        self.placement = placement
        self.log = log
        self.bound_s = bound_s
        self.window_s = window_s
        self._coordinator_pid: Callable[[], int | None] = lambda: None
        self._kill_coordinator: Callable[[], Awaitable[None]] | None = None

    def watch(self, pid: Callable[[], int | None], kill: Callable[[], Awaitable[None]]) -> None:
        """The coordinator whose CPU counts as work, and how to kill it when the pipeline is hung."""
        self._coordinator_pid, self._kill_coordinator = pid, kill

    async def hung(self, waiting: str, arrived: Callable[[], bool]) -> str | None:
        """None while the pipeline still works (``arrived``: a message came meanwhile), else the cause, once a
        stopped worker (if any) and the coordinator have been killed for recovery."""
        stuck = await self.stopped()
        if not stuck:
            before = await self.reading()
            await asyncio.sleep(self.window_s)
            if arrived() or moved(before, await self.reading()):
                return None
        names = ", ".join(runtime.name for runtime in stuck)
        cause = f"watchdog: no progress for {self.bound_s}s {waiting}" + (
            f"; worker {names} is stopped" if stuck else "; nothing moved (no bytes, no CPU), no stopped worker found")
        self.log.record("watchdog", f"{cause}; killing {'it' if stuck else 'the coordinator'} and recovering")
        for runtime in stuck:
            await self.fleet.health.kill(runtime, f"stopped, with no progress for {self.bound_s}s")
        if self._kill_coordinator is not None:
            await self._kill_coordinator()
        return cause

    def _planned(self) -> list[NodeRuntime]:
        return [runtime for runtime in self.fleet.nodes.values() if self.placement.uses(runtime.name)]

    async def stopped(self) -> list[NodeRuntime]:
        """Planned workers that are stopped (SIGSTOP, a debugger): they hold the pipeline forever."""
        planned = self._planned()
        stopped = await asyncio.gather(*(self.fleet.health.stopped(runtime) for runtime in planned))
        return [runtime for runtime, stop in zip(planned, stopped, strict=True) if stop]

    async def reading(self) -> Reading:
        """What the planned part of the pipeline has done so far (bytes relayed, CPU used)."""
        planned = self._planned()
        relayed = sum(runtime.relay.stats.bytes_to + runtime.relay.stats.bytes_from
                      for runtime in planned if runtime.relay is not None)
        pid = self._coordinator_pid()
        coordinator = await asyncio.to_thread(process_cpu_seconds, pid) if pid is not None else None
        workers = await asyncio.gather(*(_worker_cpu(runtime) for runtime in planned))
        return Reading(relayed, coordinator, {runtime.name: cpu for runtime, cpu in zip(planned, workers,
                                                                                         strict=True)})


async def _worker_cpu(runtime: NodeRuntime) -> float | None:
    if runtime.spec is None:
        return None
    try:
        result = await runtime.remote.run(sample_command(runtime.spec.workdir, "cpu"), timeout=10)
    except ConnectError:
        return None
    sample = parse_sample(result.stdout)
    return sample.cpu_s if sample is not None else None
