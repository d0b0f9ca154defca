"""Pure planning: which layers go where, and the `tensor_split` that makes llama.cpp do exactly that."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import numpy as np

from core.errors import PlanError
from core.inventory import Objective, Strategy
from core.model import BATCH, ModelFacts

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
    predicted_s: tuple[float, ...] = ()  # each node's share of a token, when the nodes were measured
    overhead_s: float = 0.0               # the coordinator's own share of a token
    slots: int = 1                        # requests decoded together, each with KV cells for the whole context

    @property
    def used(self) -> tuple[str, ...]:
        """The nodes that hold layers: the only ones the coordinator connects to."""
        return tuple(name for name, layers in zip(self.nodes, self.layers, strict=True) if layers)

    @property
    def used_split(self) -> tuple[float, ...]:
        """The tensor_split over ``used`` alone that gives each the same layers."""
        return split_for_counts([layers[1] - layers[0] + 1 for layers in self.layers if layers])

    @property
    def predicted_total_s(self) -> float | None:
        """Predicted seconds per token, or None without measurements."""
        return self.overhead_s + sum(self.predicted_s) if self.predicted_s else None

    def to_dict(self) -> dict[str, object]:
        """Plain dict for plan.json."""
        predicted = self.predicted_s or (None,) * len(self.nodes)
        return {
            "strategy": self.strategy,
            "nodes": [
                {"name": name, "split": split, "layers": list(layers) if layers else None, "bytes": need,
                 "predicted_ms": share * 1000 if share is not None and layers else None}
                for name, split, layers, need, share in zip(
                    self.nodes, self.tensor_split, self.layers, self.bytes_needed, predicted, strict=True)
            ],
            "tensor_split": list(self.tensor_split),
            "overhead_ms": self.overhead_s * 1000,
            "predicted_ms": None if self.predicted_total_s is None else self.predicted_total_s * 1000,
            "slots": self.slots,
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


def plan_memory(model: ModelFacts, nodes: Sequence[NodeCapacity], context: int, slots: int = 1) -> Plan:
    """llama.cpp's default policy made explicit: split in proportion to usable memory, then check fit."""
    if not nodes:
        raise PlanError("no worker is available to hold the model")
    usable = np.array([node.usable for node in nodes], dtype=np.float64)
    if usable.sum() <= 0:
        raise PlanError("no node has free memory for the model",
                        "fix: free memory on the nodes or raise their 'memory:' caps")
    return plan_split(model, nodes, usable / usable.sum(), context, "memory", slots=slots)


def plan_equal(model: ModelFacts, nodes: Sequence[NodeCapacity], context: int, slots: int = 1) -> Plan:
    """The same share of layers for every node, whatever its memory or speed."""
    if not nodes:
        raise PlanError("no worker is available to hold the model")
    return plan_split(model, nodes, np.full(len(nodes), 1.0 / len(nodes)), context, "equal", slots=slots)


def plan_split(model: ModelFacts, nodes: Sequence[NodeCapacity], shares: np.ndarray, context: int,
               strategy: str, *, slots: int = 1) -> Plan:
    """The plan a given split produces in llama.cpp, checked against each node's usable memory."""
    # Round before assigning, so the ranges shown are those of the split llama.cpp actually receives.
    split = tuple(round(float(value), 6) for value in shares)
    assignment = assign_layers(split, model.n_layers)
    ranges = layer_ranges(assignment, len(nodes), model.n_layers)
    output_device = assignment[model.n_layers]
    needed = [device_bytes(model, ranges[device], context, output=device == output_device, slots=slots)
              for device in range(len(nodes))]
    short = [(node, need) for node, need in zip(nodes, needed, strict=True) if need > node.usable]
    if short:
        total_need = sum(needed)
        names = ", ".join(f"{node.name} needs {mib(need)} but has {mib(node.usable)} usable"
                          for node, need in short)
        raise PlanError(f"the model ({mib(total_need)} with a {context}-token KV cache) does not fit: {names}",
                        "fix: add nodes, lower 'context', or use a smaller quantisation")
    return Plan(
        nodes=tuple(node.name for node in nodes),
        tensor_split=split,
        layers=tuple(ranges),
        bytes_needed=tuple(needed),
        strategy=strategy,
    )


def device_bytes(model: ModelFacts, layers: tuple[int, int] | None, context: int, *, output: bool,
                 batch: int = BATCH, slots: int = 1) -> int:
    """What llama.cpp allocates on a device that holds ``layers`` (inclusive) and, with ``output``, the output layer:
    weights, KV cache, and the compute buffer (with the logits when it holds the output layer)."""
    if layers is None and not output:
        return 0
    size = 0
    if layers is not None:
        size += sum(model.layer_bytes[layers[0]:layers[1] + 1])
        size += sum(model.layer_kv_bytes(layer, context) for layer in range(layers[0], layers[1] + 1))
    if output:
        size += model.output_bytes
    return size + model.compute_bytes(context, last=output, batch=batch, slots=slots)


def mib(size: int) -> str:
    """Bytes in MiB, for messages."""
    return f"{size / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class NodeSpeed:
    """A node's cost per token for one model.

    ``fixed_s`` if it holds any layer, ``per_layer_s`` for a layer of the model's mean size (scaled by
    each layer's weight bytes: decode reads every byte once), and ``output_s`` if it holds the output layer.
    """

    fixed_s: float
    per_layer_s: float
    output_s: float = 0.0


def split_for_counts(counts: Sequence[int]) -> tuple[float, ...]:
    """The tensor_split that makes llama.cpp give device i exactly ``counts[i]`` repeating layers.

    The output slot (index sum(counts)) goes to the last device that holds layers. Each cumulative split
    point sits half a slot past that device's last slot, so float32 rounding cannot move a boundary.
    """
    n_layers = sum(counts)
    slots = n_layers + 1
    last = max(index for index, count in enumerate(counts) if count > 0)
    ends, end = [], 0
    for index, count in enumerate(counts):
        end += count + (1 if index == last else 0)
        ends.append(end)
    points = [(value - 0.5) / slots if value > 0 else 0.0 for value in ends]
    points[-1] = 1.0
    shares = [points[0], *(later - earlier for earlier, later in itertools.pairwise(points))]
    return tuple(max(0.0, round(share, 9)) for share in shares)


def plan_compute(model: ModelFacts, nodes: Sequence[NodeCapacity], speeds: Sequence[NodeSpeed], context: int,
                 objective: str = "latency", *, slots: int = 1) -> Plan:
    """Exact dynamic programme over contiguous layer ranges, in node order.

    ``latency`` minimises the predicted time per token, a sum over the nodes used (decode is sequential
    through the pipeline); ``throughput`` minimises the slowest node's share (the pipeline's bottleneck).
    Nodes may be left without layers. Raises PlanError when no placement fits the memory caps.
    """
    problem = choice_problem("compute", objective)
    if problem:
        raise PlanError(problem)
    n, layers = len(nodes), model.n_layers
    if n == 0:
        raise PlanError("no worker is available to hold the model")
    per_layer = np.array([size + model.layer_kv_bytes(layer, context) for layer, size in enumerate(model.layer_bytes)],
                         dtype=np.int64)
    compute = model.compute_bytes(context, last=False)
    compute_last = model.compute_bytes(context, last=True, slots=slots) + model.output_bytes
    prefix = np.concatenate(([0], np.cumsum(per_layer)))
    work = _layer_work(model)
    combine: Callable[[float, float], float] = operator.add if objective == "latency" else max
    # best[i][l]: the least cost placing the first l layers on the first i nodes; the output layer is
    # charged to the node that takes the model's last layer.
    best = np.full((n + 1, layers + 1), np.inf)
    best[0][0] = 0.0
    choice = np.zeros((n + 1, layers + 1), dtype=np.int64)
    for i, (node, speed) in enumerate(zip(nodes, speeds, strict=True)):
        for placed in range(layers + 1):
            if not np.isfinite(best[i][placed]):
                continue
            for take in range(layers - placed + 1):
                need = int(prefix[placed + take] - prefix[placed])
                if take:
                    need += compute_last if placed + take == layers else compute
                if need > node.usable:
                    break
                cost = 0.0
                if take:
                    cost = speed.fixed_s + speed.per_layer_s * float(work[placed + take] - work[placed])
                    if placed + take == layers:
                        cost += speed.output_s
                total = combine(best[i][placed], cost)
                if total < best[i + 1][placed + take]:
                    best[i + 1][placed + take] = total
                    choice[i + 1][placed + take] = take
    if not np.isfinite(best[n][layers]):
        total_need = int(prefix[-1]) + compute_last
        usable = sum(node.usable for node in nodes)
        raise PlanError(f"the model ({mib(total_need)} with a {context}-token KV cache) does not fit on "
                        f"{n} node(s) with {mib(usable)} usable in all",
                        "fix: add nodes, lower 'context', or use a smaller quantisation")
    counts, placed = [0] * n, layers
    for i in range(n, 0, -1):
        counts[i - 1] = int(choice[i][placed])
        placed -= counts[i - 1]
    split = split_for_counts(counts)
    ranges = layer_ranges(assign_layers(split, layers), n, layers)
    last = max(index for index, count in enumerate(counts) if count > 0)
    needed = [device_bytes(model, r, context, output=index == last, slots=slots) for index, r in enumerate(ranges)]
    return Plan(nodes=tuple(node.name for node in nodes), tensor_split=split, layers=tuple(ranges),
                bytes_needed=tuple(needed), strategy=f"compute ({objective})")


def _layer_work(model: ModelFacts) -> np.ndarray:
    """Prefix sums of each layer's weight bytes in units of the mean layer."""
    sizes = np.asarray(model.layer_bytes, dtype=np.float64)
    mean = sizes.mean() if sizes.size and sizes.mean() > 0 else 1.0
    return np.concatenate(([0.0], np.cumsum(sizes / mean)))


def predict_seconds(plan: Plan, speeds: Sequence[NodeSpeed], model: ModelFacts) -> tuple[float, ...]:
    """Predicted time per token each node adds under ``plan`` (0 for a node without layers)."""
    return tuple(node_share(speed, layers, model) for layers, speed in zip(plan.layers, speeds, strict=True))


def node_share(speed: NodeSpeed, layers: tuple[int, int] | None, model: ModelFacts) -> float:
    """Predicted time per token a node of ``speed`` adds holding ``layers`` (inclusive; None: none, 0 s), with
    the output layer when they end at the model's last."""
    if layers is None:
        return 0.0
    work = _layer_work(model)
    share = speed.fixed_s + speed.per_layer_s * float(work[layers[1] + 1] - work[layers[0]])
    return share + (speed.output_s if layers[1] == model.n_layers - 1 else 0.0)


def with_prediction(plan: Plan, speeds: Sequence[NodeSpeed], model: ModelFacts, overhead_s: float) -> Plan:
    """``plan`` with each node's predicted share of a token and the coordinator's own share."""
    return replace(plan, predicted_s=predict_seconds(plan, speeds, model), overhead_s=overhead_s)


STRATEGIES: tuple[str, ...] = get_args(Strategy)
OBJECTIVES: tuple[str, ...] = get_args(Objective)


def choice_problem(strategy: str, objective: str | None) -> str | None:
    """What is wrong with a strategy and objective (from a command line or a request), or None."""
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}"
    if objective is not None and objective not in OBJECTIVES:
        return f"unknown objective {objective!r}: use {' or '.join(OBJECTIVES)}"
    return None


def choose(strategy: str, model: ModelFacts, nodes: Sequence[NodeCapacity], context: int, *,
           speeds: Sequence[NodeSpeed] | None = None, objective: str = "latency", slots: int = 1) -> Plan:
    """The plan of ``strategy``: ``compute`` by the nodes' measured ``speeds``, ``memory`` as llama.cpp splits
    by free memory, ``equal`` the same share each; ``context``: the KV cells of all ``slots``. Raises PlanError
    for a bad choice or a plan that does not fit."""
    problem = choice_problem(strategy, objective)
    if problem:
        raise PlanError(problem)
    if strategy == "compute":
        if speeds is None:
            raise PlanError("the compute strategy needs the nodes' measured speeds")
        return plan_compute(model, nodes, speeds, context, objective, slots=slots)
    return (plan_memory if strategy == "memory" else plan_equal)(model, nodes, context, slots)


# What `api.parallel: auto` tries, the most first: llama-server's own default (`-np` auto) is 4 slots.
AUTO_SLOTS = (4, 2, 1)


def choose_slots(strategy: str, model: ModelFacts, nodes: Sequence[NodeCapacity], context: int,
                 parallel: int | Literal["auto"], *, speeds: Sequence[NodeSpeed] | None = None,
                 objective: str = "latency") -> Plan:
    """The plan of ``strategy`` (see choose) with a KV cache of ``context`` tokens for each of ``parallel`` slots;
    ``auto``: the most of AUTO_SLOTS whose plan fits. Raises PlanError as choose does, for one slot under auto."""
    tries = AUTO_SLOTS if parallel == "auto" else (parallel,)
    for slots in tries[:-1]:
        with contextlib.suppress(PlanError):  # fewer slots may fit
            return replace(choose(strategy, model, nodes, context * slots, speeds=speeds, objective=objective,
                                  slots=slots), slots=slots)
    plan = choose(strategy, model, nodes, context * tries[-1], speeds=speeds, objective=objective,
                  slots=tries[-1])
    return replace(plan, slots=tries[-1])


def slots_note(slots: int, parallel: int | str) -> str:
    """``4 slots (auto)``: the slots a plan holds, and whether api.parallel chose them."""
    return f"{slots} slot{'' if slots == 1 else 's'}{' (auto)' if parallel == 'auto' else ''}"


# --- what the profiler measures ------------------------------------------------------------------------

DEPTHS = (1, 3)        # layers on the node in the two layouts the profiler times side by side (at least)
# The layers the second layout adds weigh at least this share of the first one's bytes (its layers and the output
# layer), so that their time stands out of a token's noise: a 262k vocabulary's output layer outweighs each layer
# of a 270M model 47 to 1, and two layers more would be 4 % of a token.
SLOPE_SHARE = 0.25
PROFILE_CONTEXT = 256  # enough for the timed steps; attention over a few cells costs the same
PROFILE_BATCH = 8      # the profiler decodes one token at a time: no room for a prompt's logits


def depths_for(model: ModelFacts, usable: int) -> tuple[int, int] | None:
    """The two depths to time on a node with ``usable`` bytes; None when it cannot hold one layer.

    The second holds enough layers more to weigh ``SLOPE_SHARE`` of the first, where the node can hold both. A
    one-layer model, or a node that holds only one layer, can only be timed at one depth.
    """
    def need(depth: int) -> int:
        return device_bytes(model, (0, depth - 1), PROFILE_CONTEXT, output=True, batch=PROFILE_BATCH)

    low = min(DEPTHS[0], model.n_layers)
    if need(low) > usable:
        return None
    weight = SLOPE_SHARE * (sum(model.layer_bytes[:low]) + model.output_bytes)
    high = DEPTHS[1]
    while high < model.n_layers and sum(model.layer_bytes[low:high]) < weight:
        high += 1
    high = min(high, model.n_layers)
    while high > low and need(low) + need(high) > usable:  # both are loaded at once
        high -= 1
    return low, high
