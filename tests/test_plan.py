"""`plan`: the plan and a reason for every node, from a status snapshot (pure)."""

from __future__ import annotations

from pathlib import Path

from core.client import plan_rows
from core.inventory import parse_inventory
from core.model import ModelFacts
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
    assert big.needs == 8 * ((10 << 20) + 2048 * 256) + (5 << 20)


def test_equal_plan_splits_evenly_and_checks_memory() -> None:
    fits = snapshot()
    fits.nodes[1].mem_free = fits.nodes[1].mem_total = 4 * GIB
    plan, rows = plan_rows(fits, INVENTORY, MODEL, "equal")
    assert plan.tensor_split == (0.5, 0.5)
    assert [row.layers for row in rows] == [(0, 4), (5, 7), None]
    assert rows[0].why == "5 of 8 layers: an equal share (50.0%)"
