"""Compute-aware sharding end to end: `up` measures the real workers, plans by speed, and `profile` refreshes.

The nodes are real ggml-rpc-server workers on loopback; memory caps (the inventory's `memory:`) make them
differ, which decides the plan whatever this machine's noise does to the measured speeds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.model import demo_model, read_model
from core.nodes.build import cache_dir
from core.planner import device_bytes
from tests.harness import Cluster
from tests.test_cluster import PROMPT, single_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RESERVE = 64 << 20  # the planner keeps this much free on a small node


def cap_for(layers: int, *, last: bool) -> int:
    """A `memory:` cap that holds exactly ``layers`` demo layers (with ``last``, also the output layer) at context
    512, with their KV cache and compute buffer."""
    model = read_model(demo_model(cache_dir()))
    per_layer = model.layer_bytes[0] + model.kv_bytes(512)
    return RESERVE + device_bytes(model, (0, layers - 1), 512, output=last) + per_layer // 2


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """n0 holds three layers, n1 none, n2 five: the default strategy must find the only fast plan."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gcs-", dir="/tmp"))
    cluster = Cluster(root, nodes=3, strategy=None, extra={0: [f"memory: {cap_for(3, last=False)}"],
                                                          1: [f"memory: {RESERVE + 1000}"],
                                                          2: [f"memory: {cap_for(5, last=True)}"]})
    cluster.up_output = cluster.cli("up").stderr
    yield cluster
    cluster.cli("down", check=False)
    shutil.rmtree(root, ignore_errors=True)


def events(cluster: Cluster, kind: str) -> list[dict]:
    lines = (cluster.state / "events.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["kind"] == kind]


def test_up_plans_by_measured_speed_by_default(skewed: Cluster) -> None:
    status = skewed.status()
    assert status["strategy"] == "compute (latency)"
    assert "plan: compute (latency), layers on 2 of 3 worker(s), predicted" in skewed.up_output
    assert [node["layers"] for node in status["nodes"]] == [[0, 2], None, [3, 7]]
    n0, n1, n2 = status["nodes"]
    for node in (n0, n2):
        # A demo layer costs less than this machine's noise, so its measured time may round to zero.
        assert node["fixed_ms"] is not None and node["layer_ms"] >= 0 and node["predicted_ms"] > 0
    assert n1["fixed_ms"] is None and n1["predicted_ms"] is None  # it cannot hold a layer: not timed
    assert status["predicted_ms"] == pytest.approx(status["overhead_ms"] + n0["predicted_ms"] + n2["predicted_ms"])
    # The node without layers is not one of the coordinator's devices.
    assert "model loaded across 2 worker(s)" in events(skewed, "coordinator-ready")[-1]["message"]
    assert not events(skewed, "plan-mismatch")


def test_output_equals_single_process_with_a_node_left_out(skewed: Cluster) -> None:
    result = json.loads(skewed.cli("run", PROMPT, "-n", "32", "--json").stdout)
    model = json.loads((skewed.state / "launch.json").read_text())["model"]
    assert result["text"] == single_process(model, PROMPT, 32)["text"]


def test_plan_compares_strategies_with_predictions(skewed: Cluster) -> None:
    compute = json.loads(skewed.cli("plan", "--json").stdout)
    assert compute["strategy"] == "compute (latency)"
    why = {row["name"]: row["why"] for row in compute["rows"]}
    assert why["n0"].startswith("3 of 8 layers: as many as its memory holds")
    assert why["n1"].startswith("no layers: cannot hold one layer")
    assert compute["predicted_ms"] > 0
    equal = skewed.cli("plan", "--strategy", "equal", check=False)
    assert equal.returncode == 1 and "does not fit" in equal.stderr  # n1 cannot take a third
    throughput = json.loads(skewed.cli("plan", "--objective", "throughput", "--json").stdout)
    assert throughput["strategy"] == "compute (throughput)"
    assert skewed.cli("plan", "--objective", "fastest", check=False).returncode == 2
    table = skewed.cli("plan").stdout
    assert "MS/TOK" in table and "cannot hold one layer" in table


def test_profile_measures_again_and_up_reuses_the_cache(skewed: Cluster) -> None:
    before = len(events(skewed, "profile"))
    shown = skewed.cli("profile")
    assert "MS/TOK" in shown.stdout and "predicted" in shown.stderr
    measured = events(skewed, "profile")
    assert len(measured) == before + 1 and measured[-1]["message"].startswith("measured n0, n2")
    assert skewed.status()["coordinator"]["state"] == "ready"
    assert [node["layers"] for node in skewed.status()["nodes"]] == [[0, 2], None, [3, 7]]
    # A new controller on the same nodes and model reads the profiles instead of timing again.
    skewed.cli("down")
    skewed.cli("up")
    assert len(events(skewed, "profile")) == len(measured)
    assert skewed.status()["nodes"][0]["fixed_ms"] is not None
