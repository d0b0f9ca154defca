"""The plan explained: what a strategy gives on the running cluster's measured memory and speed (`plan`), and a
plain reason for what each node got."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from core.errors import PlanError
from core.inventory import Inventory
from core.model import ModelFacts
from core.planner import NodeCapacity, NodeSpeed, Plan, choose_slots, depths_for, mib, with_prediction
from core.status import ClusterStatus, NodeStatus, age, percent


@dataclass(frozen=True)
class PlanRow:
    """One node in `plan`: what it would hold, what that costs per token, and why."""

    name: str
    layers: tuple[int, int] | None
    share: float
    needs: int
    usable: int
    why: str
    predicted_ms: float | None = None  # this node's share of a token, when the nodes were measured
    profile_age_s: float | None = None  # how old the node's profile is
    live_ms: float | None = None       # what its graph computes take now (median under the running plan)
    drift: float | None = None         # live_ms against the running plan's prediction, as a fraction

    def to_dict(self) -> dict[str, object]:
        """Plain dict for JSON."""
        data = dict(vars(self))
        data["layers"] = list(self.layers) if self.layers else None
        return data


def snapshot_speeds(snapshot: ClusterStatus, nodes: list[NodeStatus], model: ModelFacts,
                    usable: list[NodeCapacity]) -> tuple[list[NodeSpeed], float] | None:
    """The measured cost model of ``nodes`` from a snapshot; None when they were not measured."""
    speeds = []
    for node, capacity in zip(nodes, usable, strict=True):
        if node.fixed_ms is not None and node.layer_ms is not None:
            speeds.append(NodeSpeed(node.fixed_ms / 1000, node.layer_ms / 1000, (node.output_ms or 0.0) / 1000))
        elif depths_for(model, capacity.usable) is None:
            speeds.append(NodeSpeed(math.inf, 0.0))  # cannot hold a layer, so it was not timed
        else:
            return None
    return speeds, (snapshot.overhead_ms or 0.0) / 1000


def plan_rows(snapshot: ClusterStatus, inventory: Inventory, model: ModelFacts, strategy: str,
              objective: str | None = None, *, now: float | None = None) -> tuple[Plan, list[PlanRow]]:
    """The plan a strategy gives on the cluster's measured memory and speed, and why each node got its part;
    with each node's profile age, and what its computes take now against what the running plan predicted."""
    now = time.time() if now is None else now
    caps = {node.name: node.memory for node in inventory.nodes}
    usable = [node for node in snapshot.nodes if not node.left_out and node.mem_total]
    capacities = [NodeCapacity(node.name, node.mem_free, caps.get(node.name)) for node in usable]
    measured = snapshot_speeds(snapshot, usable, model, capacities)
    if strategy == "compute" and measured is None:
        raise PlanError("the nodes' speeds have not been measured (the cluster runs the "
                        f"'{snapshot.strategy or inventory.strategy}' strategy)",
                        "fix: run `ggml-cluster profile` to measure them")
    # The running cluster keeps the slots its first plan chose (a re-plan reserves KV cells for as many); one
    # that has no plan yet would choose them as `up` does.
    parallel = snapshot.slots if snapshot.strategy else inventory.api.parallel
    plan = choose_slots(strategy, model, capacities, inventory.context, parallel,
                        speeds=measured[0] if measured else None, objective=objective or inventory.objective)
    kv_tokens = inventory.context * plan.slots
    if measured is not None:
        plan = with_prediction(plan, measured[0], model, measured[1])
    rows = []
    for node in snapshot.nodes:
        if node not in usable:
            rows.append(PlanRow(node.name, None, 0.0, 0, 0, f"left out: {node.last_error or node.state}"))
            continue
        index = plan.nodes.index(node.name)
        speed = measured[0][index] if measured else None
        why = _why(plan, index, capacity=capacities[index], speed=speed, model=model, strategy=strategy,
                   context=kv_tokens)
        if strategy == "compute":
            why += link_note(node, usable)
        layers = plan.layers[index]
        if layers is not None and layers[1] == model.n_layers - 1:
            why += "; " + output_note(model, kv_tokens, speed, slots=plan.slots, sampling=inventory.sampling)
        predicted = plan.predicted_s[index] * 1000 if plan.predicted_s and plan.layers[index] else None
        age = now - node.profiled_at if node.profiled_at is not None else None
        if age is not None:
            why += "; " + live_note(age, node.live_ms, node.predicted_ms, corrected=node.profile_source == "live")
        rows.append(PlanRow(node.name, plan.layers[index], plan.tensor_split[index], plan.bytes_needed[index],
                            capacities[index].usable, why, predicted, age, node.live_ms, node.drift))
    return plan, rows


def live_note(age_s: float, live_ms: float | None, planned_ms: float | None, *, corrected: bool = False) -> str:
    """A profile's age (``corrected``: from the relay's live times rather than timed by the profiler), and how far
    the node's live compute time is from its share in the running plan."""
    note = f"{'corrected from live times' if corrected else 'profiled'} {age(age_s)} ago"
    if live_ms is not None and planned_ms:
        drift = percent(live_ms / planned_ms - 1)
        note += f"; live {live_ms:.2f} ms per compute against {planned_ms:.2f} planned ({drift})"
    return note


# A node whose round trip is this many times the nearest node's, and at least a ms more, is far: on one machine's
# loopback round trips are tenths of a ms; a link with 10 ms each way adds 20 ms to every token the node serves.
FAR_RATIO = 3.0
FAR_MIN_MS = 1.0


def link_note(node: NodeStatus, nodes: list[NodeStatus]) -> str:
    """``; its link's round trip is 20.40 ms (the nearest node's: 0.20 ms) ...`` when a node's link stands out from
    the others' (its probed round trip), else ``""``."""
    rtts = [other.rtt_ms for other in nodes if other.rtt_ms is not None]
    if node.rtt_ms is None or len(rtts) < 2:
        return ""
    nearest = min(rtts)
    if node.rtt_ms < max(FAR_RATIO * nearest, nearest + FAR_MIN_MS):
        return ""
    return (f"; its link's round trip is {node.rtt_ms:.2f} ms (the nearest node's: {nearest:.2f} ms), paid on every "
            "token it serves")


def output_note(model: ModelFacts, context: int, speed: NodeSpeed | None, *, slots: int = 1,
                sampling: str = "node") -> str:
    """What the output layer costs the node that holds it: its weights, its logits buffer, its time per token,
    and what it sends per token (the sampled token, or every logit with ``sampling: coordinator``)."""
    matrix = "the tied token embeddings" if model.tied_output else "output.weight"
    logits = model.logits_buffer_bytes(context, slots=slots)
    timed = f", {speed.output_s * 1000:.2f} ms/token" if speed is not None and math.isfinite(speed.output_s) else ""
    sends = ("samples each token there (the logits stay on it)" if sampling == "node"
             else f"sends {model.logits_bytes / 1024:.0f} KiB of logits per token")
    return (f"holds the output layer ({matrix}): {mib(model.output_bytes)} and a {mib(logits)} logits buffer"
            f"{timed}, and {sends}")


def _why(plan: Plan, index: int, *, capacity: NodeCapacity, speed: NodeSpeed | None, model: ModelFacts,
         strategy: str, context: int) -> str:
    """A plain reason for what one node got."""
    layers, share = plan.layers[index], plan.tensor_split[index]
    count = 0 if layers is None else layers[1] - layers[0] + 1
    if strategy != "compute":
        rule = "its share of usable memory" if strategy == "memory" else "an equal share"
        if layers is None:
            return f"no layers: {rule} ({share:.1%}) is less than one of {model.n_layers + 1} slots"
        return f"{count} of {model.n_layers} layers: {rule} ({share:.1%})"
    assert speed is not None
    cost = f"{speed.fixed_s * 1000:.2f} ms fixed + {speed.per_layer_s * 1000:.2f} ms/layer"
    if layers is None:
        if not math.isfinite(speed.fixed_s) or capacity.usable < min(model.layer_bytes) + model.kv_bytes(context):
            return f"no layers: cannot hold one layer ({mib(capacity.usable)} usable)"
        return f"no layers: it would add more time than it saves ({cost})"
    room = capacity.usable - plan.bytes_needed[index]
    if count < model.n_layers and room < max(model.layer_bytes) + model.kv_bytes(context):
        return f"{count} of {model.n_layers} layers: as many as its memory holds ({cost})"
    return f"{count} of {model.n_layers} layers: fastest placement ({cost})"
