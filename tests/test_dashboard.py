"""The live dashboard and the machine-readable views, against a running 3-worker cluster."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import CLI, Cluster, alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "The cluster"


class Screen:
    """A tmux session on its own server socket, 80x30, running one command."""

    def __init__(self, command: str, env: dict[str, str], status: Path) -> None:
        """``status`` receives the command's exit status once it exits.

        tmux 3.3 sometimes never reaps a pane's process (it stays a zombie and the pane's dead status stays
        empty), so the shell around the command writes the status down instead. That shell gets Ctrl-C too,
        and goes on to write it: the command exits normally (130) rather than by the signal.
        """
        self.socket = f"gct-{os.getpid()}-{time.monotonic_ns()}"  # a server of its own: no leftovers
        self.env = env
        self.status = status
        status.unlink(missing_ok=True)  # from an earlier screen on the same cluster
        wrapped = f"{command}; echo $? > {shlex.quote(str(status))}"
        self.tmux("new-session", "-d", "-s", "dash", "-x", "80", "-y", "30", wrapped)
        self.tmux("set-option", "-t", "dash", "remain-on-exit", "on")

    def tmux(self, *args: str) -> str:
        result = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=False,
                                env=self.env, timeout=30)
        assert result.returncode == 0, f"tmux {' '.join(args)}: {result.stderr}"
        return result.stdout

    def text(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "dash")

    def wait_for(self, check: Callable[[str], bool], timeout: float) -> str:
        """The screen, as soon as ``check`` holds for it (polling every 50 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.text()
            if check(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen did not show it within {timeout:g}s:\n{screen}")
            time.sleep(0.05)

    def exited(self) -> int | None:
        """The command's exit status, or None while it runs."""
        code = self.status.read_text().strip() if self.status.exists() else ""
        return int(code) if code.isdigit() else None  # None too while the shell is writing it

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, check=False, env=self.env)


def row(screen: str, node: str) -> list[str]:
    """The cells of a node's row on the dashboard."""
    line = next((line for line in screen.splitlines() if line.startswith(f"{node} ")), "")
    return line.split()


@pytest.fixture
def dashboard(cluster3: Cluster) -> Iterator[Screen]:
    command = " ".join(shlex.quote(part) for part in [CLI, "-i", str(cluster3.inventory), "status"])
    screen = Screen(command, {**cluster3.env(), "TERM": "xterm-256color"}, cluster3.root / "dashboard.status")
    yield screen
    screen.close()


def test_dashboard_shows_nodes_then_a_kill_within_two_seconds(cluster3: Cluster, dashboard: Screen) -> None:
    screen = dashboard.wait_for(lambda text: all(row(text, node) for node in ("n0", "n1", "n2")), 30)
    assert [row(screen, node)[3] for node in ("n0", "n1", "n2")] == ["0-2", "3-5", "6-7"]
    assert all(row(screen, node)[2] == "ready" for node in ("n0", "n1", "n2"))
    assert f"test{os.getpid()}" in screen.splitlines()[0] and "coordinator ready" in screen
    assert all(len(line) <= 80 for line in screen.splitlines())
    restarts = int(row(screen, "n2")[-1])

    subprocess.run(["kill", "-9", str(cluster3.worker_pid("n2"))], check=True)
    killed = time.monotonic()
    dashboard.wait_for(lambda text: row(text, "n2")[-1:] == [str(restarts + 1)], 2.0)
    print(f"restart shown {time.monotonic() - killed:.2f}s after the kill")
    screen = dashboard.wait_for(lambda text: "killed by SIGKILL" in text and "worker-exit" in text, 5)
    assert re.search(r"^  └ killed by SIGKILL", screen, re.MULTILINE)  # the node's last status, under its row
    dashboard.wait_for(lambda text: row(text, "n2")[2:3] == ["ready"] and "coordinator ready" in text, 60)


def test_dashboard_waits_for_a_restarted_controller_and_exits_on_ctrl_c(cluster3: Cluster,
                                                                          dashboard: Screen) -> None:
    dashboard.wait_for(lambda text: bool(row(text, "n0")), 30)
    controller = cluster3.controller_pid()
    subprocess.run(["kill", "-9", str(controller)], check=True)
    dashboard.wait_for(lambda text: "reconnecting" in text, 10)
    while alive(controller):
        time.sleep(0.05)
    cluster3.cli("up")
    dashboard.wait_for(lambda text: "reconnecting" not in text and bool(row(text, "n0")), 15)

    dashboard.tmux("send-keys", "-t", "dash", "C-c")
    deadline = time.monotonic() + 10
    while dashboard.exited() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dashboard.exited() == 130  # interrupted, as the shell counts it: no traceback, no hang
    left = dashboard.text()
    assert "Traceback" not in left and "NODE" not in left  # the alternate screen is gone: the terminal is back


def test_run_shows_computes_load_and_memory_per_node(cluster3: Cluster) -> None:
    watch = cluster3.popen("status", "--watch", "--json", "--interval", "0.2")
    seen = None
    try:
        assert watch.stdout is not None
        deadline = time.monotonic() + 60
        while seen is None and time.monotonic() < deadline:
            running = cluster3.popen("run", PROMPT, "-n", "400")
            for line in watch.stdout:
                status = json.loads(line)
                nodes = status["nodes"]
                if status["requests_in_flight"] and all(
                        node["computes"] > 0 and node["compute_ms"] and node["cpu_percent"] and node["rss"]
                        for node in nodes):
                    seen = status
                    break
                if running.poll() is not None:
                    break
            running.communicate(timeout=120)
    finally:
        watch.kill()
        watch.communicate()
    assert seen is not None, "no snapshot during a run showed computes, ms/token, CPU and memory on every node"
    for node in seen["nodes"]:
        assert 0 < node["cpu_percent"] < 400 and 1 << 20 < node["rss"] < node["mem_total"]
        assert node["gpu_percent"] is None  # CPU workers: no GPU tool is asked
    assert seen["decode_tokens_per_s"] > 0


def test_prometheus_endpoint_has_per_node_series(cluster3: Cluster) -> None:
    cluster3.cli("run", PROMPT, "-n", "72")  # at least 64 computes on each node under the plan: its live time
    status = cluster3.status()
    deadline = time.monotonic() + 30
    while any(node["rss"] is None for node in status["nodes"]):  # workers are sampled every 2 s, a fresh one not yet
        assert time.monotonic() < deadline, "the workers' memory was never sampled"
        time.sleep(0.2)
        status = cluster3.status()
    endpoint = status["metrics_endpoint"]
    host, _, port = endpoint.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    cluster = f"test{os.getpid()}"
    for node in ("n0", "n1", "n2"):
        labels = (("cluster", cluster), ("node", node))
        assert samples[("ggml_cluster_node_computes_total", labels)] > 0
        assert samples[("ggml_cluster_node_layers", labels)] > 0
        assert samples[("ggml_cluster_node_resident_bytes", labels)] > 0
        assert samples[("ggml_cluster_node_state", (*labels, ("state", "ready")))] == 1
    for node in status["nodes"]:  # the run is over: the live times stand still between the snapshot and the scrape
        labels = (("cluster", cluster), ("node", node["name"]))
        assert samples[("ggml_cluster_node_live_compute_seconds", labels)] == pytest.approx(node["live_ms"] / 1000)
        assert samples[("ggml_cluster_node_rtt_seconds", labels)] == pytest.approx(node["rtt_ms"] / 1000)
        # The memory strategy measures no profile: nothing is predicted, so there is no drift and no profile age.
        for absent in ("predicted_compute_seconds", "drift_ratio", "profile_age_seconds"):
            assert (f"ggml_cluster_node_{absent}", labels) not in samples
    assert samples[("ggml_cluster_requests_total", (("cluster", cluster),))] >= 1
    assert samples[("ggml_cluster_coordinator_state", (("cluster", cluster), ("state", "ready")))] == 1
