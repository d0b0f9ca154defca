"""The plan learns from what the relay measures (pure): when a node's live time per compute departs from the plan's
prediction by more than noise, its profile is corrected from the live numbers, and a re-plan is weighed against
what a reload costs.

The relay times every GRAPH_COMPUTE to the worker's first answer after it: the node's compute, its round trip and
the next tensor's transfer, which is the node's share of a token that the plan predicts. Single computes are noisy
(a prompt's batch, a draft's rows, the machine's other work), so a node's live time is the median of its latest
computes under the running plan, and it counts as drifted only when two windows in a row depart past both a
relative and an absolute bound, the same way (one busy moment on a shared machine moves one window).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from core.engine.profile import NodeProfile, node_speed
from core.model import ModelFacts
from core.planner import node_share

# Computes in each of the two windows behind a node's live time: a median over this many shrugs off a prompt's
# batches and a draft's rows (README, "The plan learns from the relay", has the numbers measured here).
WINDOW = 32
# A live median this far from the prediction, both relatively and in ms, is drift rather than noise: on the real
# model fresh profiles predicted within 4-13 % of the live times, a profile cached while the machine was busy 27-31 %
# off; the floor is above what the relay cannot see on a small model (the coordinator's own work for the node).
RELATIVE = 0.25
FLOOR_MS = 1.0
# What a re-plan must predict to save, as a share of a token: less is within the profiles' own error.
MIN_GAIN = 0.05
# The tokens a re-plan is expected to pay back over: those of the next ten minutes, at the rate seen so far.
HORIZON_S = 600.0
# At most one re-plan of its own per this long: on a shared machine two nodes' live times can take turns being slow,
# and each turn would otherwise cost a reload.
COOLDOWN_S = 120.0


@dataclass(frozen=True)
class Live:
    """A node's live time per compute under the running plan: the median of its latest two windows of computes,
    and of each window alone (earlier, later)."""

    ms: float
    windows: tuple[float, float]
    samples: int  # computes timed under the running plan


def live_time(samples_ms: Sequence[float], window: int = WINDOW) -> Live | None:
    """The median of the latest two ``window``s of compute times, and of each; None before there are that many."""
    if len(samples_ms) < 2 * window:
        return None
    earlier, later = samples_ms[-2 * window:-window], samples_ms[-window:]
    return Live(statistics.median([*earlier, *later]), (statistics.median(earlier), statistics.median(later)),
                len(samples_ms))


@dataclass(frozen=True)
class Drift:
    """A node whose live time departs from its predicted share by more than noise."""

    node: str
    live_ms: float
    predicted_ms: float

    @property
    def change(self) -> float:
        """Live against predicted, as a fraction (+0.3: 30 % slower than predicted)."""
        return self.live_ms / self.predicted_ms - 1

    def describe(self) -> str:
        """One line for the event log."""
        return (f"live {self.live_ms:.2f} ms per compute against {self.predicted_ms:.2f} ms predicted "
                f"({self.change:+.0%}, median of the last {2 * WINDOW} computes)")


def drifted(node: str, live: Live | None, predicted_ms: float | None, *, relative: float = RELATIVE,
            floor_ms: float = FLOOR_MS) -> Drift | None:
    """The node's drift when both its windows are further than ``relative`` of the prediction and ``floor_ms`` from
    it, on the same side; None while within noise, not yet measured long enough, or without a prediction."""
    if live is None or not predicted_ms:
        return None
    bound = max(relative * predicted_ms, floor_ms)
    earlier, later = (median - predicted_ms for median in live.windows)
    if min(abs(earlier), abs(later)) <= bound or (earlier > 0) != (later > 0):
        return None
    return Drift(node, live.ms, predicted_ms)


def corrected(profile: NodeProfile, overhead_s: float, model: ModelFacts, layers: tuple[int, int], *, live_s: float,
              measured_at: float, samples: int) -> NodeProfile:
    """``profile`` rescaled so that it predicts ``live_s`` for the node holding ``layers``.

    One operating point cannot tell the fixed cost from the per-layer one, so both (and the output layer's) scale
    by the same factor: a busy machine slows all of them alike. The coordinator's share is not the node's and stays.
    """
    predicted = node_share(node_speed(model, profile, overhead_s), layers, model)
    own_fixed = max(0.0, profile.fixed_s - overhead_s)
    if predicted <= 0:  # nothing to scale: the whole difference is fixed cost
        return replace(profile, fixed_s=overhead_s + own_fixed + live_s, measured_at=measured_at, samples=samples,
                       source="live")
    factor = live_s / predicted
    return NodeProfile(fixed_s=overhead_s + own_fixed * factor, seconds_per_byte=profile.seconds_per_byte * factor,
                       measured_at=measured_at, samples=samples, output_s=profile.output_s * factor, source="live",
                       round_trip_s=profile.round_trip_s)


def expected_tokens(tokens: int, elapsed_s: float, horizon_s: float = HORIZON_S) -> float:
    """Tokens a new plan would serve over ``horizon_s``, at the rate of ``tokens`` in ``elapsed_s`` so far."""
    return tokens / elapsed_s * horizon_s if elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class Verdict:
    """Whether to reload with the best plan, and why in one line."""

    replan: bool
    gain_ms: float  # predicted per token, the running plan's time less the best plan's
    message: str


def verdict(current_s: float, best_s: float, *, same: bool, tokens: float, reload_s: float,
            since_replan_s: float | None = None, min_gain: float = MIN_GAIN) -> Verdict:
    """Re-plan when the best plan differs, saves at least ``min_gain`` of a token, its saving over ``tokens``
    expected tokens outweighs a reload (``reload_s``: the last load's time, during which nothing is served), and the
    last re-plan of its own (``since_replan_s`` ago; None: none yet) is COOLDOWN_S past."""
    gain = current_s - best_s
    gain_ms = gain * 1000
    if same or gain <= 0:
        return Verdict(False, 0.0, "kept the plan: it is still the fastest on the corrected profiles")
    share = gain / current_s if current_s > 0 else 0.0
    if share < min_gain:
        return Verdict(False, gain_ms, f"kept the plan: predicted gain {gain_ms:.2f} ms/token ({share:.0%}) is "
                                       f"under the {min_gain:.0%} threshold")
    saved = gain * tokens
    payback = (f"predicted gain {gain_ms:.2f} ms/token ({share:.0%}) over {tokens:.0f} expected tokens "
               f"({HORIZON_S / 60:.0f} min at the rate so far) is {saved:.1f} s")
    if saved <= reload_s:
        return Verdict(False, gain_ms, f"kept the plan: {payback}, less than a reload ({reload_s:.1f} s)")
    if since_replan_s is not None and since_replan_s < COOLDOWN_S:
        return Verdict(False, gain_ms, f"kept the plan for now: {payback}, but the last re-plan was "
                                       f"{since_replan_s:.0f} s ago (at most one per {COOLDOWN_S:.0f} s)")
    return Verdict(True, gain_ms, f"re-planning: {payback}, more than a reload ({reload_s:.1f} s)")
