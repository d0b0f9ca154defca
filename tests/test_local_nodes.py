"""Local nodes are probed, chosen for and built like SSH nodes, so a GPU in this machine can be used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import Cluster, ephemeral_ports, free_port
from tests.test_hardening import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# The test asks for a backend this machine cannot build: ROCm (Debian 12 has HIP 5.2 and no rocBLAS/hipBLAS).


def test_a_local_node_gets_the_backend_its_probe_finds_or_the_one_asked_for(short_tmp: Path) -> None:
    cluster = Cluster(short_tmp, nodes=2, extra={0: ["backend: auto"], 1: ["backend: rocm"]})
    check = cluster.cli("check", "--json", check=False)
    rows = {row["name"]: row for row in json.loads(check.stdout)}
    assert rows["n0"]["backend"] == "cpu" and "no GPU backend available; using the CPU" in rows["n0"]["reason"]
    assert rows["n0"]["system"].startswith("linux/") and rows["n0"]["worker"] == "cached"
    assert rows["n1"]["backend"] == "rocm" and "needs HIP >= 6.1" in rows["n1"]["problem"], rows["n1"]
    try:
        up = cluster.cli("up")
        n0, n1 = cluster.status()["nodes"]
        assert n0["state"] == "ready" and n0["backend"] == "cpu" and "no GPU backend available" in n0["detail"]
        # Not a silent CPU worker: one line names the node, the backend and what it lacks, before any cmake.
        assert n1["state"] == "failed" and n1["backend"] == "rocm" and "needs HIP >= 6.1" in n1["last_error"]
        assert [line for line in up.stderr.splitlines() if "n1: " in line and "rocm" in line and "HIP >= 6.1" in line]
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)


def test_check_advises_moving_a_worker_port_the_kernel_may_hand_out(short_tmp: Path) -> None:
    """A port in the ephemeral range is free until its worker listens, and any outgoing connection may be given it
    then: `check` says so (advice, not a problem), naming the range and both ways out."""
    ephemeral = ephemeral_ports()
    cluster = Cluster(short_tmp, nodes=2, ports=[ephemeral[len(ephemeral) // 2], free_port()])
    check = cluster.cli("check", "--json")
    rows = {row["name"]: row for row in json.loads(check.stdout)}
    assert rows["n0"]["problem"] == "" and rows["n1"]["note"] == "", rows
    assert (f"port {cluster.ports[0]} is in this node's ephemeral range {ephemeral[0]}-{ephemeral[-1]}"
            in rows["n0"]["note"]), rows["n0"]
    assert f"below {ephemeral[0]}" in rows["n0"]["note"]
    assert f"net.ipv4.ip_local_reserved_ports={cluster.ports[0]}" in rows["n0"]["note"]
    table = cluster.cli("check").stdout
    assert "ephemeral range" in table and cluster.processes() == []
