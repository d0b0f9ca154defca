"""Layer placement: llama.cpp's own split arithmetic, and the memory-proportional plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import PlanError
from core.model import ModelFacts
from core.planner import NodeCapacity, assign_layers, layer_ranges, plan_memory

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
