"""The plan learns from the relay's times: drift, the corrected profile and the re-plan verdict (pure; no workers)."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from core.controller.adapt import Adaptation, Traffic
from core.controller.drift import (
    COOLDOWN_S,
    FLOOR_MS,
    WINDOW,
    Live,
    corrected,
    drifted,
    expected_tokens,
    live_time,
    verdict,
)
from core.controller.events import EventLog
from core.engine.profile import NodeProfile, Profiles, node_speed
from core.model import ModelFacts
from core.planner import NodeCapacity, Plan, node_share, plan_compute
from core.status import NodeStatus

MIB = 1 << 20
MODEL = ModelFacts(path=Path("m.gguf"), name="m.gguf", architecture="llama", n_layers=8, n_embd=64,
                   layer_bytes=(10 * MIB,) * 8, output_bytes=2 * MIB, input_bytes=MIB, kv_bytes_per_token_layer=0)
# 1 ms fixed (0.25 of it the coordinator's), 1 ms per layer, 0.5 ms for the output layer.
PROFILE = NodeProfile(fixed_s=0.001, seconds_per_byte=0.001 / (10 * MIB), measured_at=100.0, samples=16,
                      output_s=0.0005)
OVERHEAD_S = 0.00025


def steady(ms: float) -> Live:
    return Live(ms, (ms, ms), 2 * WINDOW)


def test_live_time_is_the_median_of_the_latest_two_windows_and_waits_for_both() -> None:
    assert live_time([1.0] * (2 * WINDOW - 1)) is None
    # A prompt's batches and a busy moment among the computes move a window's median not at all.
    samples = [50.0] * 10 + [2.0] * (2 * WINDOW - 3) + [40.0, 2.1, 90.0]
    assert live_time(samples) == Live(2.0, (2.0, 2.0), len(samples))
    assert live_time([3.0, 1.0, 5.0, 7.0], window=2) == Live(4.0, (2.0, 6.0), 4)


def test_drift_needs_both_bounds_in_both_windows_on_the_same_side() -> None:
    assert drifted("a", None, 10.0) is None  # not measured long enough
    assert drifted("a", steady(12.0), 10.0) is None  # +20 %: within what fresh profiles miss by
    slow = drifted("a", steady(13.0), 10.0)
    assert slow is not None and slow.change == pytest.approx(0.3)
    assert slow.describe() == (f"live 13.00 ms per compute against 10.00 ms predicted (+30%, median of the last "
                               f"{2 * WINDOW} computes)")
    fast = drifted("a", steady(15.5), 21.3)  # the busy-machine profile: 27 % too slow
    assert fast is not None and fast.change < 0
    # One busy window is not drift, nor two that depart on opposite sides.
    assert drifted("a", Live(13.0, (10.0, 16.0), 2 * WINDOW), 10.0) is None
    assert drifted("a", Live(10.0, (5.0, 15.0), 2 * WINDOW), 10.0) is None
    # On a fast node half the prediction is a fraction of a ms: scheduling noise, not drift.
    assert drifted("a", steady(0.1 + FLOOR_MS * 0.9), 0.1) is None
    assert drifted("a", steady(0.1 + FLOOR_MS * 1.1), 0.1) is not None
    assert drifted("a", steady(5.0), None) is None  # no prediction: nothing to depart from


def test_the_corrected_profile_predicts_the_live_time_and_keeps_the_coordinators_share() -> None:
    layers = (0, 7)  # all eight and the output: 0.75 + 8 + 0.5 = 9.25 ms predicted
    assert node_share(node_speed(MODEL, PROFILE, OVERHEAD_S), layers, MODEL) == pytest.approx(0.00925)
    busy = corrected(PROFILE, OVERHEAD_S, MODEL, layers, live_s=0.0185, measured_at=200.0, samples=40)
    assert node_share(node_speed(MODEL, busy, OVERHEAD_S), layers, MODEL) == pytest.approx(0.0185)
    assert busy.fixed_s == pytest.approx(OVERHEAD_S + 0.00075 * 2)
    assert busy.seconds_per_byte == pytest.approx(PROFILE.seconds_per_byte * 2)
    assert busy.output_s == pytest.approx(0.001)
    assert (busy.measured_at, busy.samples, busy.source) == (200.0, 40, "live")
    # Over other layers the corrected profile predicts them scaled alike.
    middle = (2, 4)
    assert node_share(node_speed(MODEL, busy, OVERHEAD_S), middle, MODEL) == pytest.approx(
        2 * node_share(node_speed(MODEL, PROFILE, OVERHEAD_S), middle, MODEL))
    # A profile that predicted nothing for the node: the whole live time is fixed cost.
    nothing = NodeProfile(fixed_s=OVERHEAD_S, seconds_per_byte=0.0, measured_at=1.0, samples=1)
    fixed = corrected(nothing, OVERHEAD_S, MODEL, layers, live_s=0.004, measured_at=2.0, samples=32)
    assert node_share(node_speed(MODEL, fixed, OVERHEAD_S), layers, MODEL) == pytest.approx(0.004)


def test_a_corrected_profile_moves_the_layers_to_the_node_that_is_now_faster() -> None:
    """Two equal nodes; the first's profile claimed it ten times faster than it is, so it got every layer."""
    nodes = [NodeCapacity("a", 1 << 40), NodeCapacity("b", 1 << 40)]
    claimed = NodeProfile(fixed_s=OVERHEAD_S + 0.000075, seconds_per_byte=PROFILE.seconds_per_byte / 10,
                          measured_at=1.0, samples=16, output_s=0.00005)
    speeds = [node_speed(MODEL, claimed, OVERHEAD_S), node_speed(MODEL, PROFILE, OVERHEAD_S)]
    assert plan_compute(MODEL, nodes, speeds, 256).layers == ((0, 7), None)
    fixed = corrected(claimed, OVERHEAD_S, MODEL, (0, 7), live_s=0.0095, measured_at=2.0, samples=32)
    speeds[0] = node_speed(MODEL, fixed, OVERHEAD_S)
    assert plan_compute(MODEL, nodes, speeds, 256).layers == (None, (0, 7))


def test_expected_tokens_follow_the_rate_so_far() -> None:
    assert expected_tokens(600, 60.0) == pytest.approx(6000.0)  # 10 tok/s for the next ten minutes
    assert expected_tokens(600, 60.0, horizon_s=60.0) == pytest.approx(600.0)
    assert expected_tokens(10, 0.0) == 0.0


def test_replan_only_when_the_gain_pays_for_the_reload() -> None:
    same = verdict(0.010, 0.010, same=True, tokens=1e6, reload_s=1.0)
    assert not same.replan and same.message == "kept the plan: it is still the fastest on the corrected profiles"
    small = verdict(0.010, 0.0098, same=False, tokens=1e6, reload_s=1.0)
    assert not small.replan
    assert small.message == "kept the plan: predicted gain 0.20 ms/token (2%) is under the 5% threshold"
    few = verdict(0.010, 0.008, same=False, tokens=200, reload_s=1.0)  # 2 ms x 200 tokens = 0.4 s
    assert not few.replan and few.gain_ms == pytest.approx(2.0)
    assert few.message == ("kept the plan: predicted gain 2.00 ms/token (20%) over 200 expected tokens (10 min at "
                           "the rate so far) is 0.4 s, less than a reload (1.0 s)")
    many = verdict(0.010, 0.008, same=False, tokens=2000, reload_s=1.0)  # 4 s against 1 s
    assert many.replan
    assert many.message == ("re-planning: predicted gain 2.00 ms/token (20%) over 2000 expected tokens (10 min at "
                            "the rate so far) is 4.0 s, more than a reload (1.0 s)")
    assert not verdict(0.010, 0.008, same=False, tokens=1e9, reload_s=float("inf")).replan  # never loaded yet
    # Two nodes taking turns being slow on a shared machine: one re-plan, then none for a while.
    assert verdict(0.010, 0.008, same=False, tokens=2000, reload_s=1.0, since_replan_s=COOLDOWN_S + 1).replan
    soon = verdict(0.010, 0.008, same=False, tokens=2000, reload_s=1.0, since_replan_s=42.0)
    assert not soon.replan
    assert soon.message.endswith(f"is 4.0 s, but the last re-plan was 42 s ago (at most one per {COOLDOWN_S:.0f} s)")


def test_status_carries_each_nodes_live_time_under_the_running_plan_alone() -> None:
    """Computes timed before the plan was made (the profiler's, an earlier plan's) are not the plan's live time."""
    before, under = [50.0] * 40, [2.0] * WINDOW + [3.0] * WINDOW
    stats = SimpleNamespace(recent=deque(before + under, maxlen=256), computes_timed=len(before) + len(under))
    fleet = SimpleNamespace(nodes={"a": SimpleNamespace(relay=SimpleNamespace(stats=stats)),
                                   "b": SimpleNamespace(relay=None)})
    placement = SimpleNamespace(since={"a": len(before), "b": 0})
    adaptation = Adaptation(cast(Any, fleet), cast(Any, placement), cast(Any, None),
                            Traffic(tokens=lambda: 0, started_at=0.0, reload_s=lambda: None), replan=print)
    assert adaptation.live("a") == Live(2.5, (2.0, 3.0), 2 * WINDOW)
    a = NodeStatus(name="a", host="h", kind="local", rpc_port=1, layers=(0, 7), predicted_ms=2.0)
    b = NodeStatus(name="b", host="h", kind="local", rpc_port=2, layers=None)
    adaptation.annotate([a, b])
    assert (a.live_ms, a.drift, b.live_ms, b.drift) == (2.5, pytest.approx(0.25), None, None)
    placement.since["a"] = len(before) + 1  # one compute fewer under the plan than two windows
    assert adaptation.live("a") is None


def test_a_drifted_node_is_corrected_and_the_replan_weighed_once(tmp_path: Path) -> None:
    """The controller's check over stand-ins for the fleet and the placement (no processes)."""
    def plan(layers: tuple[tuple[int, int] | None, ...], shares: tuple[float, ...]) -> Plan:
        return Plan(nodes=("a", "b"), tensor_split=(0.5, 0.5), layers=layers, bytes_needed=(0, 0), strategy="compute",
                    predicted_s=shares)

    stats = SimpleNamespace(recent=deque([18.5] * (2 * WINDOW)), computes_timed=2 * WINDOW)
    fleet = SimpleNamespace(nodes={"a": SimpleNamespace(relay=SimpleNamespace(stats=stats)),
                                   "b": SimpleNamespace(relay=None)})
    corrections: list[tuple[str, NodeProfile]] = []
    replans: list[str] = []
    running = plan(((0, 7), None), (0.00925, 0.0))  # PROFILE's prediction for a holding everything
    placement = SimpleNamespace(
        plan=running, profiles=Profiles({"a": PROFILE, "b": PROFILE}, OVERHEAD_S, ()), model=MODEL, since={"a": 0},
        inventory=SimpleNamespace(strategy="memory", objective="latency"), best=lambda: None,
        correct=lambda name, profile, _every: corrections.append((name, profile)))
    log = EventLog(tmp_path / "events.jsonl")
    adaptation = Adaptation(cast(Any, fleet), cast(Any, placement), log,
                            Traffic(tokens=lambda: 6000, started_at=time.time() - 600, reload_s=lambda: 1.0),
                            replan=replans.append)
    adaptation.check()
    [(name, profile)] = corrections
    assert name == "a" and profile.source == "live"
    assert node_share(node_speed(MODEL, profile, OVERHEAD_S), (0, 7), MODEL) == pytest.approx(0.0185)
    drift, kept = [(event.kind, event.node, event.message) for event in log.recent]
    assert drift[:2] == ("profile-drift", "a") and drift[2].startswith("live 18.50 ms per compute against 9.25 ms")
    assert kept == ("plan-kept", None, "kept the plan after correcting a: the inventory's strategy is memory, not "
                    "compute")
    # Under the compute strategy, a plan that moves the layers to b and saves half a token is worth a reload (10 tok/s
    # so far: 6000 tokens over the next ten minutes, 55.5 s saved against a 1 s reload).
    placement.inventory.strategy = "compute"
    placement.plan = plan(((0, 7), None), (0.0185, 0.0))
    placement.best = lambda: plan((None, (0, 7)), (0.0, 0.00925))
    placement.since["a"] = 0  # the stand-in's correct() does not restart the window, as the real one does
    stats.recent.extend([30.0] * (2 * WINDOW))
    stats.computes_timed += 2 * WINDOW
    adaptation.check()
    assert log.recent[-1].kind == "replan" and log.recent[-1].message.startswith(
        "after correcting a: re-planning: predicted gain 9.25 ms/token (50%) over ")
    assert replans == ["re-planning on the corrected profile of a"]
