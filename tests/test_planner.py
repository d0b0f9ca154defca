"""Layer placement: llama.cpp's own split arithmetic, and the memory-proportional plan."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from pathlib import Path

import pytest

from core.errors import PlanError
from core.inventory import embedded_inventory
from core.model import ModelFacts, read_model, write_demo_model
from core.planner import (
    AUTO_SLOTS,
    NodeCapacity,
    NodeSpeed,
    assign_layers,
    choose,
    choose_slots,
    depths_for,
    device_bytes,
    layer_ranges,
    plan_compute,
    plan_equal,
    plan_memory,
    predict_seconds,
    slots_note,
    split_for_counts,
    with_prediction,
)

GIB = 1 << 30


def model(n_layers: int = 8, layer_bytes: int = 100 << 20) -> ModelFacts:
    return ModelFacts(path=Path("m.gguf"), name="m.gguf", architecture="llama", n_layers=n_layers, n_embd=64,
                      layer_bytes=(layer_bytes,) * n_layers, output_bytes=50 << 20, input_bytes=50 << 20,
                      kv_bytes_per_token_layer=256)


def test_equal_split_matches_llama_cpp_load_log() -> None:
    # Seen in llama.cpp's log for two equal RPC workers: layers 0-4 on RPC0, 5-8 (8 = output) on RPC1.
    assert assign_layers([0.5, 0.5], 8) == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert assign_layers([1, 1, 1], 8) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_zero_share_gets_no_layers() -> None:
    assignment = assign_layers([0.0, 1.0, 3.0], 7)
    assert 0 not in assignment
    assert layer_ranges(assignment, 3, 7) == [None, (0, 1), (2, 6)]


def test_split_is_normalised() -> None:
    assert assign_layers([2, 2], 8) == assign_layers([0.5, 0.5], 8)


def test_all_zero_split_is_an_error() -> None:
    with pytest.raises(PlanError):
        assign_layers([0, 0], 8)


def test_memory_plan_is_proportional_to_usable_memory() -> None:
    plan = plan_memory(model(), [NodeCapacity("big", 30 * GIB), NodeCapacity("small", 10 * GIB)], 1024)
    assert plan.tensor_split == (0.75, 0.25)
    assert plan.layers == ((0, 6), (7, 7))
    assert plan.strategy == "memory"


def test_memory_cap_limits_a_node() -> None:
    plan = plan_memory(model(), [NodeCapacity("a", 30 * GIB, mem_cap=10 * GIB), NodeCapacity("b", 10 * GIB)], 1024)
    assert plan.tensor_split == (0.5, 0.5)


def test_model_that_does_not_fit_names_the_shortfall() -> None:
    nodes = [NodeCapacity("pi", 300 << 20), NodeCapacity("nano", 300 << 20)]
    with pytest.raises(PlanError) as caught:
        plan_memory(model(), nodes, 1024)
    message = str(caught.value)
    assert "does not fit" in message and "pi needs" in message and "usable" in message


def test_no_nodes() -> None:
    with pytest.raises(PlanError):
        plan_memory(model(), [], 1024)


def speeds(*pairs: tuple[float, float]) -> list[NodeSpeed]:
    return [NodeSpeed(fixed_s=fixed, per_layer_s=per_layer) for fixed, per_layer in pairs]


def counts_of(plan) -> list[int]:
    return [layers[1] - layers[0] + 1 if layers else 0 for layers in plan.layers]


def test_split_for_counts_reproduces_any_counts_in_llama_cpp() -> None:
    rng = random.Random(7)
    for _ in range(500):
        counts = [rng.choice([0, 0, 1, 2, 3, 7, 20]) for _ in range(rng.randint(1, 6))]
        if not any(counts):
            continue
        assignment = assign_layers(split_for_counts(counts), sum(counts))
        assert [assignment[:-1].count(device) for device in range(len(counts))] == counts
        assert assignment[-1] == max(i for i, count in enumerate(counts) if count)  # output on the last used


def test_speed_bound_puts_everything_on_the_fast_node() -> None:
    nodes = [NodeCapacity("gpu", 30 * GIB), NodeCapacity("pi", 30 * GIB)]
    plan = plan_compute(model(), nodes, speeds((0.001, 0.001), (0.001, 0.010)), 1024)
    assert counts_of(plan) == [8, 0]
    assert predict_seconds(plan, speeds((0.001, 0.001), (0.001, 0.010)), model()) == pytest.approx((0.009, 0.0))


def test_memory_bound_fills_the_fast_node_then_spills() -> None:
    # The fast node can hold three 100 MiB layers after its 64 MiB reserve; the rest go to the slow one.
    nodes = [NodeCapacity("gpu", (64 + 330) << 20), NodeCapacity("cpu", 30 * GIB)]
    plan = plan_compute(model(), nodes, speeds((0.001, 0.001), (0.001, 0.010)), 1024)
    assert counts_of(plan) == [3, 5]


def test_a_node_behind_a_slow_link_gets_nothing() -> None:
    nodes = [NodeCapacity("a", 30 * GIB), NodeCapacity("far", 30 * GIB)]
    plan = plan_compute(model(), nodes, speeds((0.001, 0.002), (0.050, 0.001)), 1024)
    assert counts_of(plan) == [8, 0] and plan.layers[1] is None


def test_throughput_objective_balances_the_bottleneck() -> None:
    nodes = [NodeCapacity("a", 30 * GIB), NodeCapacity("b", 30 * GIB)]
    plan = plan_compute(model(), nodes, speeds((0.0, 0.001), (0.0, 0.001)), 1024, objective="throughput")
    assert counts_of(plan) == [4, 4]


def test_compute_plan_that_does_not_fit_names_the_shortfall() -> None:
    nodes = [NodeCapacity("a", 300 << 20), NodeCapacity("b", 300 << 20)]
    with pytest.raises(PlanError, match=r"does not fit on 2 node\(s\) with .* usable in all"):
        plan_compute(model(), nodes, speeds((0.0, 0.001), (0.0, 0.001)), 1024)


def test_dynamic_programme_matches_brute_force() -> None:
    rng = random.Random(11)
    for _ in range(80):
        n_layers = rng.randint(1, 6)
        sizes = tuple(rng.choice([50, 100, 200]) << 20 for _ in range(n_layers))  # like mixed K-quants
        facts = replace(model(n_layers=n_layers), layer_bytes=sizes)
        mean = sum(sizes) / n_layers
        n = rng.randint(1, 3)
        nodes = [NodeCapacity(f"n{i}", (64 << 20) + rng.randint(0, 900) * (1 << 20)) for i in range(n)]
        cost = [NodeSpeed(rng.uniform(0, 0.02), rng.uniform(0.001, 0.01), rng.uniform(0, 0.005)) for _ in range(n)]
        best = None
        for counts in itertools.product(range(n_layers + 1), repeat=n):
            if sum(counts) != n_layers:
                continue
            start, fits, total = 0, True, 0.0
            last = max(i for i, count in enumerate(counts) if count)
            for i, count in enumerate(counts):
                layers = facts.layer_bytes[start:start + count]
                need = sum(layers) + count * facts.kv_bytes(1024) + (facts.output_bytes if i == last else 0)
                fits &= need <= nodes[i].usable
                if count:
                    total += cost[i].fixed_s + cost[i].per_layer_s * sum(layers) / mean
                    total += cost[i].output_s if i == last else 0.0
                start += count
            if fits and (best is None or total < best - 1e-12):
                best = total
        if best is None:
            with pytest.raises(PlanError):
                plan_compute(facts, nodes, cost, 1024)
        else:
            plan = plan_compute(facts, nodes, cost, 1024)
            assert sum(predict_seconds(plan, cost, facts)) == pytest.approx(best)
            assert all(need <= node.usable for need, node in zip(plan.bytes_needed, nodes, strict=True))


def test_output_layer_cost_moves_the_last_layer_off_a_node_that_is_slow_at_it() -> None:
    # Equal nodes, but the output matrix is costly on b: a takes every layer, so the output stays on a.
    nodes = [NodeCapacity("a", 30 * GIB), NodeCapacity("b", 30 * GIB)]
    cost = [NodeSpeed(0.0, 0.001, 0.001), NodeSpeed(0.0, 0.001, 0.050)]
    plan = plan_compute(model(), nodes, cost, 1024)
    assert counts_of(plan) == [8, 0]
    assert predict_seconds(plan, cost, model()) == pytest.approx((0.009, 0.0))


def test_prediction_is_carried_by_the_plan() -> None:
    nodes = [NodeCapacity("a", 30 * GIB), NodeCapacity("b", 30 * GIB)]
    cost = speeds((0.002, 0.001), (0.002, 0.001))
    plan = with_prediction(plan_equal(model(), nodes, 1024), cost, model(), overhead_s=0.003)
    # llama.cpp's equal split of 8 layers gives a five (its output slot is the ninth, on b).
    assert plan.predicted_s == pytest.approx((0.007, 0.005))
    assert plan.predicted_total_s == pytest.approx(0.015)
    assert plan.to_dict()["predicted_ms"] == pytest.approx(15.0)


@pytest.mark.parametrize("cost", [((0.001, 0.0005), (0.001, 0.0005)),   # identical workers
                                  ((0.0001, 0.00001), (0.05, 0.05)),     # b far slower: a would take all
                                  ((0.05, 0.05), (0.0001, 0.00001))])    # a far slower: b would take all
def test_the_embedded_default_puts_layers_on_both_demo_workers(tmp_path: Path, cost: tuple) -> None:
    """The demo is a cluster: neither demo worker's memory holds the demo model with the KV cache of the 4 slots
    api.parallel: auto (the default) chooses, the two together do, and each can still be timed (profiled) before
    the first plan."""
    inventory = embedded_inventory()
    demo = read_model(write_demo_model(tmp_path / "demo.gguf"))
    nodes = [NodeCapacity(node.name, 64 * GIB, node.memory) for node in inventory.nodes]
    plan = choose_slots("compute", demo, nodes, inventory.context, inventory.api.parallel, speeds=speeds(*cost))
    assert all(plan.layers) and plan.slots == 4, plan
    for other in (plan_memory, plan_equal):
        assert all(other(demo, nodes, inventory.context * plan.slots).layers)
    for node in nodes:
        with pytest.raises(PlanError, match="does not fit"):
            plan_compute(demo, [node], speeds(cost[0]), inventory.context * plan.slots)
        low, high = depths_for(demo, node.usable) or (0, 0)
        assert 1 <= low < high


# KV cells that matter: 64 KiB per token and layer, 512 MiB for 1024 tokens of 8 layers.
KV_HEAVY = replace(model(8, 10 << 20), kv_bytes_per_token_layer=64 << 10)


def holding(slots: int, less: int = 0) -> NodeCapacity:
    """A node whose usable memory holds KV_HEAVY with 1024 tokens for each of ``slots`` slots (less ``less``)."""
    need = device_bytes(KV_HEAVY, (0, 7), 1024 * slots, output=True) - less
    node = NodeCapacity("a", 1 << 50, need)
    while node.usable < need:
        node = replace(node, mem_cap=(node.mem_cap or 0) + (1 << 20))
    return node


@pytest.mark.parametrize(("room", "slots"), [(4, 4), (3, 2), (2, 2), (1, 1)])
def test_auto_chooses_the_most_slots_whose_kv_cache_fits(room: int, slots: int) -> None:
    plan = choose_slots("memory", KV_HEAVY, [holding(room)], 1024, "auto")
    assert plan.slots == slots and plan.to_dict()["slots"] == slots
    assert plan == replace(choose("memory", KV_HEAVY, [holding(room)], 1024 * slots), slots=slots)
    assert AUTO_SLOTS == (4, 2, 1)  # llama-server's own default (-np auto) is 4


def test_auto_fails_as_one_slot_does_when_not_even_one_fits() -> None:
    with pytest.raises(PlanError) as one:
        choose("memory", KV_HEAVY, [holding(1, less=1 << 20)], 1024)
    with pytest.raises(PlanError) as auto:
        choose_slots("memory", KV_HEAVY, [holding(1, less=1 << 20)], 1024, "auto")
    assert str(auto.value) == str(one.value) and "with a 1024-token KV cache" in str(auto.value)


def test_a_number_of_slots_is_exactly_that_many_or_the_plan_error() -> None:
    assert choose_slots("equal", KV_HEAVY, [holding(4)], 1024, 3).slots == 3
    with pytest.raises(PlanError, match="with a 4096-token KV cache\\) does not fit"):
        choose_slots("memory", KV_HEAVY, [holding(2)], 1024, 4)  # no fewer slots than asked for
    compute = choose_slots("compute", KV_HEAVY, [holding(2)], 1024, "auto", speeds=speeds((0.001, 0.001)))
    assert (compute.slots, compute.strategy) == (2, "compute (latency)")


def test_slots_note_says_whether_auto_chose_them() -> None:
    assert (slots_note(4, "auto"), slots_note(1, "auto"), slots_note(2, 2)) == ("4 slots (auto)", "1 slot (auto)",
                                                                                 "2 slots")


def test_one_list_of_strategies_and_objectives_and_one_dispatch(tmp_path: Path) -> None:
    from typing import get_args

    from core.errors import PlanError
    from core.inventory import Objective, Strategy
    from core.planner import OBJECTIVES, STRATEGIES, choice_problem, choose

    assert get_args(Strategy) == STRATEGIES and get_args(Objective) == OBJECTIVES
    assert choice_problem("memory", None) is None and choice_problem("compute", "throughput") is None
    assert choice_problem("fastest", None) == "unknown strategy 'fastest': use one of compute, memory, equal"
    assert choice_problem("compute", "speed") == "unknown objective 'speed': use latency or throughput"
    demo = read_model(write_demo_model(tmp_path / "demo.gguf"))
    nodes = [NodeCapacity("a", 8 * GIB), NodeCapacity("b", 8 * GIB)]
    assert choose("equal", demo, nodes, 512) == plan_equal(demo, nodes, 512)
    assert choose("memory", demo, nodes, 512) == plan_memory(demo, nodes, 512)
    with pytest.raises(PlanError, match="measured speeds"):
        choose("compute", demo, nodes, 512)
    with pytest.raises(PlanError, match="unknown strategy"):
        choose("fastest", demo, nodes, 512)
