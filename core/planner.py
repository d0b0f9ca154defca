"""Pure planning: which layers go where, and the `tensor_split` that makes llama.cpp do exactly that."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import PlanError
from core.model import ModelFacts

# Head-room kept free on each node: compute buffers and the allocator's own needs.
RESERVE_FRACTION = 0.10
RESERVE_MIN_BYTES = 64 << 20


@dataclass(frozen=True)
class NodeCapacity:
    """What the planner knows of one node."""

    name: str
    mem_free: int
    mem_cap: int | None = None  # the inventory's `memory:` limit

    @property
    def usable(self) -> int:
        """Bytes the planner may fill on this node."""
        free = self.mem_free if self.mem_cap is None else min(self.mem_free, self.mem_cap)
        return max(0, free - max(RESERVE_MIN_BYTES, int(free * RESERVE_FRACTION)))


@dataclass(frozen=True)
class Plan:
    """Layer ranges per node (inclusive, None for none) and the tensor_split that produces them."""

    nodes: tuple[str, ...]
    tensor_split: tuple[float, ...]
    layers: tuple[tuple[int, int] | None, ...]
    bytes_needed: tuple[int, ...]
    strategy: str

    def to_dict(self) -> dict[str, object]:
        """Plain dict for plan.json."""
        return {
            "strategy": self.strategy,
            "nodes": [
                {"name": name, "split": split, "layers": list(layers) if layers else None, "bytes": need}
                for name, split, layers, need in zip(
                    self.nodes, self.tensor_split, self.layers, self.bytes_needed, strict=True)
            ],
            "tensor_split": list(self.tensor_split),
        }


def assign_layers(tensor_split: Sequence[float], n_layers: int) -> list[int]:
    """Device index of each of llama.cpp's ``n_layers + 1`` slots (the last is the output layer).

    Mirrors llama_model::load_tensors with all layers offloaded: cumulative float32 split points
    normalised to 1, then ``upper_bound(splits, il / (n_layers + 1))``.
    """
    split = np.asarray(tensor_split, dtype=np.float32)
    if split.size == 0 or float(split.sum()) <= 0:
        raise PlanError("tensor_split must have a positive entry")
    points = np.cumsum(split, dtype=np.float32) / np.float32(split.sum())
    slots = n_layers + 1
    positions = np.arange(slots, dtype=np.float32) / np.float32(slots)
    device = np.searchsorted(points, positions, side="right")
    return [int(index) for index in np.minimum(device, split.size - 1)]


def layer_ranges(assignment: Sequence[int], n_devices: int, n_layers: int) -> list[tuple[int, int] | None]:
    """Inclusive repeating-layer range per device (the output slot is not a repeating layer)."""
    ranges: list[tuple[int, int] | None] = [None] * n_devices
    for layer, device in enumerate(assignment[:n_layers]):
        current = ranges[device]
        ranges[device] = (layer, layer) if current is None else (current[0], layer)
    return ranges


def plan_memory(model: ModelFacts, nodes: Sequence[NodeCapacity], context: int) -> Plan:
    """llama.cpp's default policy made explicit: split in proportion to usable memory, then check fit."""
    if not nodes:
        raise PlanError("no worker is available to hold the model")
    usable = np.array([node.usable for node in nodes], dtype=np.float64)
    if usable.sum() <= 0:
        raise PlanError("no node has free memory for the model",
                        "fix: free memory on the nodes or raise their 'memory:' caps")
    # Round before assigning, so the ranges shown are those of the split llama.cpp actually receives.
    split = tuple(round(float(value), 6) for value in usable / usable.sum())
    assignment = assign_layers(split, model.n_layers)
    ranges = layer_ranges(assignment, len(nodes), model.n_layers)
    needed = [0] * len(nodes)
    for slot, device in enumerate(assignment):
        if slot < model.n_layers:
            needed[device] += model.layer_bytes[slot] + model.kv_bytes(context)
        else:
            needed[device] += model.output_bytes
    short = [(node, need) for node, need in zip(nodes, needed, strict=True) if need > node.usable]
    if short:
        total_need = sum(needed)
        names = ", ".join(f"{node.name} needs {_mib(need)} but has {_mib(node.usable)} usable"
                          for node, need in short)
        raise PlanError(f"the model ({_mib(total_need)} with a {context}-token KV cache) does not fit: {names}",
                        "fix: add nodes, lower 'context', or use a smaller quantisation")
    return Plan(
        nodes=tuple(node.name for node in nodes),
        tensor_split=split,
        layers=tuple(ranges),
        bytes_needed=tuple(needed),
        strategy="memory",
    )


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
