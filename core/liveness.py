"""Is the pipeline still working? What the watchdog looks at before it calls a silent request hung.

A long prompt, a replay after a recovery or a model load over a slow link can go for longer than the watchdog
without a single message from the coordinator; a stopped worker goes silent the same way. What tells them apart
is whether anything moves: bytes through the relays, CPU time of the coordinator or of a worker. Two readings a
moment apart answer that; only nothing moving at all (or a worker in the stopped state) is a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
