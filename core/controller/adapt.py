"""The running plan checked against what the relays measure: a node whose live time drifted from its profile gets
its profile corrected (and cached), and the cluster re-plans when the predicted gain is worth a reload (the
deciding rules are core.controller.drift's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from core.controller.drift import Live, corrected, drifted, expected_tokens, live_time, verdict
from core.controller.events import EventLog
from core.controller.fleet import Fleet
from core.controller.placement import Placement
from core.planner import Plan
from core.status import NodeStatus


@dataclass(frozen=True)
class Traffic:
    """What the controller has served, for the tokens a new plan is expected to serve."""

    tokens: Callable[[], int]          # completion tokens since the controller started
    started_at: float                  # when it started (epoch seconds)
    reload_s: Callable[[], float | None]  # the last model load's time: what a reload costs (None: none yet)


class Adaptation:
    """Compares each node's live time under the running plan with the plan's prediction, between checks."""

    def __init__(self, fleet: Fleet, placement: Placement, log: EventLog, traffic: Traffic,
                 replan: Callable[[str], None]) -> None:
        """``replan``: reload with a fresh plan for the reason given (between requests)."""
        self.fleet = fleet
        self.placement = placement
        self.log = log
        self.traffic = traffic
        self.replan = replan
        self.replanned_at: float | None = None  # monotonic time of the last re-plan asked for here

    def live(self, name: str) -> Live | None:
        """Node ``name``'s live time under the running plan, once there are enough computes."""
        runtime = self.fleet.nodes[name]
        since = self.placement.since.get(name)
        if runtime.relay is None or since is None:
            return None
        stats = runtime.relay.stats
        fresh = min(stats.computes_timed - since, len(stats.recent))
        return live_time(list(stats.recent)[len(stats.recent) - fresh:]) if fresh > 0 else None

    def annotate(self, statuses: list[NodeStatus]) -> None:
        """Add each node's live time and its departure from the prediction to its status (`status --json`)."""
        for status in statuses:
            live = self.live(status.name) if status.layers else None
            status.live_ms = live.ms if live else None
            status.drift = live.ms / status.predicted_ms - 1 if live and status.predicted_ms else None

    def check(self) -> None:
        """Correct every drifted node's profile, then weigh a re-plan once for all of them."""
        plan, profiles = self.placement.plan, self.placement.profiles
        if plan is None or profiles is None or not plan.predicted_s:
            return
        fixed = []
        for index, (name, layers) in enumerate(zip(plan.nodes, plan.layers, strict=True)):
            profile = profiles.nodes.get(name)
            live = self.live(name)
            drift = drifted(name, live, plan.predicted_s[index] * 1000)
            if drift is None or layers is None or profile is None or live is None:
                continue
            better = corrected(profile, profiles.overhead_s, self.placement.model, layers,
                               live_s=drift.live_ms / 1000, measured_at=time.time(), samples=live.samples)
            self.placement.correct(name, better, self.fleet.nodes)
            self.log.record("profile-drift", f"{drift.describe()}; profile corrected from the live numbers and "
                            "cached", node=name)
            fixed.append(name)
        if fixed:
            self._weigh(", ".join(fixed))

    def _weigh(self, names: str) -> None:
        """Re-plan, or say why not, after the profiles of ``names`` were corrected."""
        current, best = self.placement.plan, self.placement.best()
        if current is None:
            return
        if best is None:
            reason = ("no other plan fits" if self.placement.inventory.strategy == "compute"
                      else f"the inventory's strategy is {self.placement.inventory.strategy}, not compute")
            self.log.record("plan-kept", f"kept the plan after correcting {names}: {reason}")
            return
        reload_s = self.traffic.reload_s()
        tokens = expected_tokens(self.traffic.tokens(), time.time() - self.traffic.started_at)
        decision = verdict(_cost(current, self.placement.inventory.objective),
                           _cost(best, self.placement.inventory.objective), same=best.layers == current.layers,
                           tokens=tokens, reload_s=reload_s if reload_s is not None else float("inf"),
                           since_replan_s=None if self.replanned_at is None else time.monotonic() - self.replanned_at)
        if decision.replan:
            self.replanned_at = time.monotonic()
            self.log.record("replan", f"after correcting {names}: {decision.message}")
            self.replan(f"re-planning on the corrected profile of {names}")
        else:
            self.log.record("plan-kept", f"after correcting {names}: {decision.message}")


def _cost(plan: Plan, objective: str) -> float:
    """What the objective minimises: the predicted time per token, or the pipeline's slowest share."""
    if objective == "latency":
        return plan.predicted_total_s or 0.0
    return max(plan.predicted_s, default=0.0) + plan.overhead_s
