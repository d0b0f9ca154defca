"""The Grafana dashboard (grafana/ggml-cluster.json): a dashboard Grafana imports, whose every query names metrics
that a running cluster's /metrics serves."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Cluster, learned

BOARD = Path(__file__).resolve().parent.parent / "grafana" / "ggml-cluster.json"
METRIC = re.compile(r"\bggml_cluster_[a-z0-9_]+")


def board() -> dict[str, Any]:
    return json.loads(BOARD.read_text())


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL text the dashboard sends: the panels' targets and the template variables' queries."""
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return found + [variable["definition"] for variable in dashboard["templating"]["list"]]


def metric_names(dashboard: dict[str, Any]) -> set[str]:
    return {name for query in queries(dashboard) for name in METRIC.findall(query)}


def test_the_dashboard_imports_with_a_datasource_of_the_users_choice() -> None:
    dashboard = board()
    assert [item["name"] for item in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"])
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)) and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24  # Grafana's grid is 24 columns wide
    # Every query is scoped to the chosen clusters.
    assert all('cluster=~"$cluster"' in target["expr"] for panel in dashboard["panels"] for target in panel["targets"])


def test_it_shows_what_the_issue_asks_for() -> None:
    names = metric_names(board())
    for wanted in ("ggml_cluster_node_compute_seconds", "ggml_cluster_aggregate_decode_tokens_per_second",
                   "ggml_cluster_slots", "ggml_cluster_slots_busy", "ggml_cluster_queue_length",
                   "ggml_cluster_node_restarts_total", "ggml_cluster_node_compute_failures_total",
                   "ggml_cluster_node_live_compute_seconds", "ggml_cluster_node_predicted_compute_seconds",
                   "ggml_cluster_node_drift_ratio"):
        assert wanted in names
    live = next(panel for panel in board()["panels"] if panel["title"].startswith("Live vs planned"))
    assert [target["legendFormat"] for target in live["targets"]] == ["{{node}} live", "{{node}} planned"]


# --- a running cluster ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """2 workers under the default (compute) strategy, so that the plan predicts a time per token."""
    root = Path(tempfile.mkdtemp(prefix="gcg-", dir="/tmp"))
    cluster = Cluster(root, nodes=2, strategy=None)
    cluster.cli("up")
    yield cluster
    cluster.cli("down", check=False)
    shutil.rmtree(root, ignore_errors=True)


def scrape(cluster: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What /metrics serves now: each sample's value by its name (counters with their _total) and sorted labels."""
    with urllib.request.urlopen(f"http://{cluster.status()['metrics_endpoint']}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def served(cluster: Cluster) -> set[str]:
    """The names of the samples /metrics serves now."""
    return {name for name, _ in scrape(cluster)}


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_each_nodes_live_time_drift_link_and_profile_are_served_as_status_has_them(cluster: Cluster) -> None:
    status = learned(cluster)
    samples = scrape(cluster)
    scraped_at = time.time()
    gauges = {"live_compute_seconds": ("live_ms", 1e-3), "predicted_compute_seconds": ("predicted_ms", 1e-3),
              "drift_ratio": ("drift", 1.0), "rtt_seconds": ("rtt_ms", 1e-3)}
    seen = set()
    for node in status["nodes"]:
        labels = (("cluster", status["cluster"]), ("node", node["name"]))
        for gauge, (field, scale) in gauges.items():
            value = samples.get((f"ggml_cluster_node_{gauge}", labels))
            if node[field] is None:
                assert value is None, (gauge, node["name"])  # absent, not zero
            else:
                assert value == pytest.approx(node[field] * scale, rel=1e-9), (gauge, node["name"])
                seen.add(gauge)
        age = samples[("ggml_cluster_node_profile_age_seconds", labels)]
        assert scraped_at - node["profiled_at"] - 30 <= age <= scraped_at - node["profiled_at"]
        for source in ("timed", "live"):
            wanted = float(source == node["profile_source"])
            assert samples[("ggml_cluster_node_profile_source", (*labels, ("source", source)))] == wanted
    # The compute strategy profiles every node and probes its link; a node that holds layers has a live time and
    # a prediction, so a drift.
    assert seen == set(gauges), seen


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_every_metric_the_dashboard_queries_is_served_by_a_running_cluster(cluster: Cluster) -> None:
    learned(cluster)  # the rates, the nodes' compute and live times need requests
    wanted = metric_names(board())
    deadline = time.monotonic() + 20  # a worker's CPU use needs two samples, 2 s apart
    while (missing := wanted - served(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not missing, f"the Grafana dashboard queries metrics that /metrics does not serve: {sorted(missing)}"
