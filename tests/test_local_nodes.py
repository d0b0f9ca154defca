"""Local nodes are probed, chosen for and built like SSH nodes, so a GPU in this machine can be used."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.harness import Cluster
from tests.test_hardening import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# The test asks for a backend this machine cannot build; one with the Vulkan SDK would build it (for minutes).
VULKAN_HERE = shutil.which("glslc") is not None and Path("/usr/include/vulkan/vulkan.h").exists()


@pytest.mark.skipif(VULKAN_HERE, reason="this machine can build the Vulkan backend")
def test_a_local_node_gets_the_backend_its_probe_finds_or_the_one_asked_for(short_tmp: Path) -> None:
    cluster = Cluster(short_tmp, nodes=2, extra={0: ["backend: auto"], 1: ["backend: vulkan"]})
    check = cluster.cli("check", "--json", check=False)
    rows = {row["name"]: row for row in json.loads(check.stdout)}
    assert rows["n0"]["backend"] == "cpu" and "no GPU backend available; using the CPU" in rows["n0"]["reason"]
    assert rows["n0"]["system"].startswith("linux/") and rows["n0"]["worker"] == "cached"
    assert rows["n1"]["backend"] == "vulkan" and rows["n1"]["reason"] == "backend: vulkan in the inventory"
    try:
        up = cluster.cli("up")
        n0, n1 = cluster.status()["nodes"]
        assert n0["state"] == "ready" and n0["backend"] == "cpu" and "no GPU backend available" in n0["detail"]
        # Not a silent CPU worker: the Vulkan build was attempted, and one line names the node and what is missing.
        assert n1["state"] == "failed" and "building ggml-rpc-server (vulkan) failed" in n1["last_error"]
        assert [line for line in up.stderr.splitlines() if "n1: node n1: building ggml-rpc-server (vulkan) failed: "
                "Could NOT find Vulkan" in line]
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)
