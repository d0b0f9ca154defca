"""`plan`: the plan and a reason for every node, from a status snapshot (pure)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from core.errors import PlanError
from core.inventory import parse_inventory
from core.model import ModelFacts
from core.plan_explained import plan_rows
from core.planner import device_bytes
from core.status import ClusterStatus, CoordinatorStatus, NodeState, NodeStatus

GIB = 1 << 30
INVENTORY = parse_inventory("cluster: lab\nnodes:\n  - {name: big, kind: local, rpc_port: 1}\n"
                            "  - {name: tiny, kind: local, rpc_port: 2}\n  - {name: dead, kind: local, rpc_port: 3}\n",
                            "inv.yaml")
MODEL = ModelFacts(path=Path("m.gguf"), name="m.gguf", architecture="llama", n_layers=8, n_embd=64,
                   layer_bytes=(10 << 20,) * 8, output_bytes=5 << 20, input_bytes=5 << 20,
                   kv_bytes_per_token_layer=256)


def snapshot() -> ClusterStatus:
    def node(name: str, free: int, state: NodeState = NodeState.READY, error: str = "") -> NodeStatus:
        return NodeStatus(name=name, host="localhost", kind="local", rpc_port=1, state=state, mem_total=free,
                          mem_free=free, last_error=error)

    return ClusterStatus(cluster="lab", model="m.gguf", coordinator=CoordinatorStatus(),
                         nodes=[node("big", 40 * GIB), node("tiny", (64 << 20) + (1 << 20)),
                                node("dead", 0, NodeState.FAILED, "crash loop: exit code 1")])


def test_memory_plan_explains_every_node() -> None:
    plan, rows = plan_rows(snapshot(), INVENTORY, MODEL, "memory")
    assert plan.nodes == ("big", "tiny")
    big, tiny, dead = rows
    assert big.layers == (0, 7) and big.why.startswith("8 of 8 layers: its share of usable memory")
    assert tiny.layers is None and tiny.why.startswith("no layers: its share of usable memory (0.0%)")
    assert dead.why == "left out: crash loop: exit code 1"
    # api.parallel: auto, and big holds the KV cache of 4 slots of the 2048-token context.
    assert plan.slots == 4
    assert big.needs == 8 * ((10 << 20) + 4 * 2048 * 256) + (5 << 20) + MODEL.compute_bytes(4 * 2048, last=True)


def test_the_plan_keeps_the_running_clusters_slots_and_auto_chooses_fewer_where_memory_is_short() -> None:
    running = snapshot()
    running.strategy, running.slots = "memory", 2  # the slots its first plan chose, kept on every re-plan
    plan, rows = plan_rows(running, INVENTORY, MODEL, "memory")
    assert plan.slots == 2 and rows[0].needs == device_bytes(MODEL, (0, 7), 2 * 2048, output=True)
    short = snapshot()  # no plan yet: auto chooses as `up` would
    short.nodes[0].mem_free = short.nodes[0].mem_total = (
            (64 << 20) + 8 * (10 << 20) + (5 << 20) + 8 * 2 * 2048 * 256 + MODEL.compute_bytes(2 * 2048, last=True))
    short.nodes[1].mem_free = short.nodes[1].mem_total = 0
    plan, rows = plan_rows(short, INVENTORY, MODEL, "memory")
    assert plan.slots == 2 and rows[0].needs <= rows[0].usable


def test_equal_plan_splits_evenly_and_checks_memory() -> None:
    fits = snapshot()
    fits.nodes[1].mem_free = fits.nodes[1].mem_total = 4 * GIB
    plan, rows = plan_rows(fits, INVENTORY, MODEL, "equal")
    assert plan.tensor_split == (0.5, 0.5)
    assert [row.layers for row in rows] == [(0, 4), (5, 7), None]
    assert rows[0].why == "5 of 8 layers: an equal share (50.0%)"


def measured(snapshot: ClusterStatus, speeds: dict[str, tuple[float, float]], output_ms: float = 0.0) -> ClusterStatus:
    for node in snapshot.nodes:
        if node.name in speeds:
            node.fixed_ms, node.layer_ms = speeds[node.name]
            node.output_ms = output_ms
    snapshot.overhead_ms = 0.5
    return snapshot


def test_compute_plan_explains_every_node() -> None:
    # big: fast, holds everything; tiny: cannot hold a layer; a third node would only add its fixed cost.
    three = snapshot()
    three.nodes.append(NodeStatus(name="far", host="far", kind="ssh", rpc_port=1, state=NodeState.READY,
                                  mem_total=40 * GIB, mem_free=40 * GIB))
    inventory = parse_inventory("cluster: lab\nnodes:\n  - {name: big, kind: local, rpc_port: 1}\n"
                                "  - {name: tiny, kind: local, rpc_port: 2}\n"
                                "  - {name: dead, kind: local, rpc_port: 3}\n"
                                "  - {name: far, host: far.lan}\n", "inv.yaml")
    plan, rows = plan_rows(measured(three, {"big": (1.0, 2.0), "far": (20.0, 2.0)}), inventory, MODEL, "compute")
    big, tiny, _, far = rows
    assert (big.layers, tiny.layers, far.layers) == ((0, 7), None, None)
    assert big.why == ("8 of 8 layers: fastest placement (1.00 ms fixed + 2.00 ms/layer); holds the output layer "
                       "(output.weight): 5.0 MiB and a 0.0 MiB logits buffer, 0.00 ms/token, and samples each token "
                       "there (the logits stay on it)")
    assert tiny.why.startswith("no layers: cannot hold one layer")
    assert far.why == "no layers: it would add more time than it saves (20.00 ms fixed + 2.00 ms/layer)"
    assert big.predicted_ms == pytest.approx(17.0)
    assert plan.predicted_total_s == pytest.approx(0.0175)  # with the coordinator's 0.5 ms
    # Its link is why, where the probes timed the links: its round trip stands out from the nearest node's.
    three.nodes[0].rtt_ms, three.nodes[3].rtt_ms = 0.2, 20.4
    _, rows = plan_rows(three, inventory, MODEL, "compute")
    assert rows[3].why == ("no layers: it would add more time than it saves (20.00 ms fixed + 2.00 ms/layer); its "
                           "link's round trip is 20.40 ms (the nearest node's: 0.20 ms), paid on every token it serves")
    assert "link" not in rows[0].why
    three.nodes[3].rtt_ms = 0.5  # within a few times and a ms of each other: dispatch and scheduling, not a link
    assert "link" not in plan_rows(three, inventory, MODEL, "compute")[1][3].why
    three.nodes[0].rtt_ms, three.nodes[3].rtt_ms = 0.0, 1.2  # the nearest at nothing: a ms more is far
    assert "round trip is 1.20 ms" in plan_rows(three, inventory, MODEL, "compute")[1][3].why


def test_compute_plan_says_when_memory_decides() -> None:
    small = snapshot()
    small.nodes[0].mem_free = small.nodes[0].mem_total = (
            (64 << 20) + 3 * ((10 << 20) + 4 * 2048 * 256) + MODEL.compute_bytes(4 * 2048, last=False) + (1 << 20))
    small.nodes[1].mem_free = small.nodes[1].mem_total = 4 * GIB
    _, rows = plan_rows(measured(small, {"big": (1.0, 1.0), "tiny": (1.0, 5.0)}), INVENTORY, MODEL, "compute")
    assert [row.layers for row in rows[:2]] == [(0, 2), (3, 7)]
    assert rows[0].why.startswith("3 of 8 layers: as many as its memory holds")


def test_compute_plan_needs_measured_nodes() -> None:
    with pytest.raises(PlanError, match=r"have not been measured.*ggml-cluster profile"):
        plan_rows(snapshot(), INVENTORY, MODEL, "compute")


def test_memory_plan_shows_predictions_once_measured() -> None:
    _, rows = plan_rows(measured(snapshot(), {"big": (1.0, 2.0)}), INVENTORY, MODEL, "memory")
    assert rows[0].predicted_ms == pytest.approx(17.0) and rows[1].predicted_ms is None


def test_the_node_with_the_last_layer_is_shown_the_output_layers_cost() -> None:
    """A tied, large-vocabulary model: the output matrix is the token embeddings, duplicated on the last node."""
    tied = replace(MODEL, n_vocab=262144, output_bytes=170 << 20, tied_output=True, n_embd=640, n_ff=2048)
    _, rows = plan_rows(measured(snapshot(), {"big": (1.0, 1.0), "tiny": (1.0, 5.0)}, output_ms=7.5), INVENTORY,
                        tied, "compute")
    big = rows[0]
    assert big.layers == (0, 7)
    # 4 slots (auto): room for two outputs each (llama.cpp's default, the 512 tokens of a micro-batch: 512 MiB)
    assert big.why.endswith("; holds the output layer (the tied token embeddings): 170.0 MiB and a 8.0 MiB logits "
                            "buffer, 7.50 ms/token, and samples each token there (the logits stay on it)")
    assert big.needs == device_bytes(tied, (0, 7), 4 * INVENTORY.context, output=True, slots=4)
    assert big.needs > 8 * (10 << 20) + (170 << 20) + (8 << 20)
    here = INVENTORY.model_copy(update={"sampling": "coordinator"})
    _, rows = plan_rows(measured(snapshot(), {"big": (1.0, 1.0), "tiny": (1.0, 5.0)}, output_ms=7.5), here, tied,
                        "compute")
    assert rows[0].why.endswith(", and sends 1024 KiB of logits per token")


def test_plan_shows_each_profiles_age_and_how_far_the_live_numbers_are_from_it() -> None:
    """A profile taken while the machine was busy misleads every later plan: `plan` says how old each one is and
    what the node's computes take now against the share the running plan gave it."""
    status = measured(snapshot(), {"big": (1.0, 2.0)})
    big = status.nodes[0]
    # The controller's live time (median of the latest computes under the plan) and its drift from the prediction.
    big.profiled_at, big.live_ms, big.drift, big.predicted_ms = 1_000_000.0, 16.5, 16.5 / 21.3 - 1, 21.3
    big.compute_ms = 30.0  # the relay's moving average, over computes of earlier plans too: not the plan's live time
    _, rows = plan_rows(status, INVENTORY, MODEL, "memory", now=1_000_000.0 + 3 * 3600)
    assert rows[0].why.endswith("; profiled 3 h ago; live 16.50 ms per compute against 21.30 planned (-23%)")
    assert (rows[0].to_dict()["profile_age_s"], rows[0].to_dict()["live_ms"]) == (3 * 3600, 16.5)
    assert rows[0].to_dict()["drift"] == pytest.approx(16.5 / 21.3 - 1)
    big.profile_source = "live"  # corrected from the relay's times, not timed by the profiler
    _, rows = plan_rows(status, INVENTORY, MODEL, "memory", now=1_000_000.0 + 90)
    assert rows[0].why.endswith("; corrected from live times 90 s ago; live 16.50 ms per compute against 21.30 "
                                "planned (-23%)")
    big.profile_source, big.live_ms, big.drift = "timed", None, None  # too few computes under the plan: the age
    _, rows = plan_rows(status, INVENTORY, MODEL, "memory", now=1_000_000.0 + 90)
    assert rows[0].why.endswith("; profiled 90 s ago")
    assert rows[1].profile_age_s is None and "profiled" not in rows[1].why  # never measured
