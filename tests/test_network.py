"""The cluster over a real network: nodes in network namespaces of their own, each with its own sshd and a shaped
veth link to the head, where the controller and the coordinator run (tests.netbed)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from core.model import demo_model, read_model
from core.nodes.build import cache_dir
from tests.harness import Cluster, run_with_fault
from tests.netbed import NetBed, namespaces, needs_bed, netbed, sweep

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = "The cluster said"


def bed_cluster(root: Path, bed: NetBed, nodes: int) -> Cluster:
    return Cluster(root, nodes=nodes, ssh=[bed.node_lines(index) for index in range(nodes)], base_env=bed.env(),
                   prefix=bed.prefix, strategy="equal", defaults=[f"workdir: {root / 'nodes'}"])


def test_across_wifi_links_the_text_is_loopbacks_and_only_tokens_leave_the_output_node() -> None:
    needs_bed()
    root = Path(tempfile.mkdtemp(prefix="gcn-", dir="/tmp"))
    (root / "local").mkdir()
    local = Cluster(root / "local", nodes=2, strategy="equal")
    try:
        local.cli("up")
        expected = local.cli("run", PROMPT, "-n", "40").stdout
    finally:
        local.cli("down", check=False)
    with netbed(root / "bed", 2, "wifi") as bed:
        cluster = bed_cluster(root, bed, 2)
        try:
            cluster.cli("up")
            before = cluster.status()["nodes"][1]["bytes_from"]
            assert cluster.cli("run", PROMPT, "-n", "40").stdout == expected
            status = cluster.status()
            assert [node["state"] for node in status["nodes"]] == ["ready", "ready"]
            assert [node["host"] for node in status["nodes"]] == [NetBed.head_address(0), NetBed.head_address(1)]
            # The output node sent its tokens, not 40 tokens' logits.
            assert status["nodes"][1]["bytes_from"] - before < 40 * read_model(demo_model(cache_dir())).n_vocab
        finally:
            cluster.cli("down", check=False)
    assert bed.leftovers() == []


def test_eight_nodes_on_lan_links_come_up_and_a_killed_fifth_resumes_exactly() -> None:
    needs_bed()
    root = Path(tempfile.mkdtemp(prefix="gcn-", dir="/tmp"))
    with netbed(root / "bed", 8, "lan") as bed:
        cluster = bed_cluster(root, bed, 8)
        try:
            cluster.cli("up")
            status = cluster.status()
            assert [node["state"] for node in status["nodes"]] == ["ready"] * 8
            held = sorted(layer for node in status["nodes"] if node["layers"]
                          for layer in range(node["layers"][0], node["layers"][1] + 1))
            assert held == list(range(8)) and status["nodes"][4]["layers"]  # the 5th is in the pipeline
            clean = cluster.cli("run", PROMPT, "-n", "120").stdout
            victim = cluster.worker_pid("n4")
            result, text, _ = run_with_fault(cluster, PROMPT, "120", lambda: os.kill(victim, signal.SIGKILL))
            assert result.returncode == 0, result.stderr
            assert text == clean
            assert cluster.worker_pid("n4") != victim
        finally:
            cluster.cli("down", check=False)
        # Every worker lived in its node's namespace, and `down` stopped them all.
        for space in bed.spaces:
            pids = subprocess.run(["ip", "netns", "pids", space], capture_output=True, text=True, check=False)
            assert pids.stdout.split() == [pid for pid in pids.stdout.split() if _is_sshd(int(pid))]
    assert bed.leftovers() == []


def _is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"
    except OSError:
        return False


def test_a_bed_that_fails_half_way_and_one_a_killed_test_left_are_removed(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    needs_bed()

    def no_sshd(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("sshd did not start")

    with monkeypatch.context() as patched:
        patched.setattr("tests.netbed.Sshd", no_sshd)
        before = set(namespaces())
        with pytest.raises(RuntimeError, match="sshd did not start"):
            NetBed(tmp_path / "half", 2, "wifi")
        assert set(namespaces()) == before  # the head, the first node and its shaped link were made, then removed
    # A bed whose test process died: its namespaces name a pid that no longer exists.
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"gcb{gone.pid}-0h"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep() and stale not in namespaces()
