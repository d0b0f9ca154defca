"""The web dashboard in a real browser (headless Chromium) against a real 3-worker cluster: every node on the page and
no console errors, a worker killed mid-generation going restarting → ready with a `recovered` event (and how long the
page takes to show a state change after the controller's event), the decode chart growing under a request, the
README's screenshot; and beyond loopback, the API key (tests/web_login.py, in a network namespace)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver

from core.status import age
from tests.browser import NODE_ROWS, WINDOW, chrome, console, needs_browser, wait_for
from tests.harness import Cluster, learned, run_with_fault
from tests.netbed import NetBed, _run, needs_bed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "The cluster"
LONG = "3000"  # tokens: about ten seconds of the demo model on this machine's two 1-thread workers
# The state changes the latency test watches: the page stamps each one (epoch ms) as it lands in the DOM.
WATCH_STATE = """
const [node, into] = arguments;
const cell = document.querySelector(`[data-node="${node}"] [data-field="state"]`);
window[into] = [];
new MutationObserver(() => window[into].push([cell.textContent, performance.timeOrigin + performance.now()]))
    .observe(cell, {childList: true, characterData: true, subtree: true});
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """3 workers on the demo model, with a context long enough for a request of about ten seconds."""
    needs_browser()
    root = Path(tempfile.mkdtemp(prefix="gcw-", dir="/tmp"))
    cluster = Cluster(root, nodes=3, context=4096)
    cluster.cli("up")
    yield cluster
    cluster.cli("down", check=False)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def page(cluster: Cluster) -> Iterator[webdriver.Chrome]:
    """The dashboard, open and live."""
    driver = chrome()
    try:
        driver.get(cluster.status()["dashboard_url"])
        wait_for(driver, "return document.getElementById('connection').textContent", lambda text: text == "live",
                 20, "the stream connected")
        yield driver
    finally:
        driver.quit()


def rows(driver: webdriver.Chrome) -> dict[str, dict[str, str]]:
    return {row["name"]: row for row in driver.execute_script(NODE_ROWS)}


def test_the_page_shows_every_node_and_logs_no_errors(cluster: Cluster, page: webdriver.Chrome) -> None:
    status = cluster.status()
    shown = wait_for(page, NODE_ROWS, lambda found: len(found) == 3 and all(row["state"] == "ready" for row in found),
                     20, "three ready nodes")
    for node, row in zip(status["nodes"], shown, strict=True):
        first, last = node["layers"]
        assert row["name"] == node["name"] and row["platform"] == f"{node['arch']} / {node['backend']}"
        assert row["layer-text"] == f"{first}-{last} of {status['n_layers']}" and row["restarts"] == "0"
        assert row["failures"] == "0"  # patched workers: they report failed computes, none so far
        assert " / " in row["memory-text"] and row["measured"] != ""
    assert page.execute_script("return document.getElementById('cluster').textContent") == status["cluster"]
    # The plan and why, from the controller.
    why = wait_for(page, "return [...document.querySelectorAll('#plan tbody tr')].map(row => row.textContent)",
                   lambda found: len(found) == 3, 10, "the plan's reasons")
    assert all("its share of usable memory" in line for line in why)
    events = page.execute_script("return [...document.querySelectorAll('#events li')].map(item => item.dataset.kind)")
    assert "coordinator-ready" in events and "plan" in events
    # Everything the page loaded came from the controller: no CDN, nothing from the internet.
    origin = status["dashboard_url"].removesuffix("/dashboard/")
    loaded = page.execute_script("return performance.getEntriesByType('resource').map(entry => entry.name)")
    assert loaded and all(url.startswith(origin) for url in loaded), loaded
    assert console(page) == []


def test_each_node_shows_its_live_time_against_the_plan_and_its_profile() -> None:
    """Under the compute strategy (every node profiled, a predicted share for each that holds layers): the live time
    with its drift, and the profile's source and age, as `status --json` has them and `plan` words them."""
    needs_browser()
    root = Path(tempfile.mkdtemp(prefix="gcw-", dir="/tmp"))
    cluster = Cluster(root, nodes=2, strategy=None)
    driver = None
    try:
        cluster.cli("up")
        status = learned(cluster)
        driver = chrome()
        driver.get(status["dashboard_url"])
        shown = wait_for(driver, NODE_ROWS, lambda found: len(found) == 2 and all(row["profile"] for row in found),
                         20, "both nodes with their profiles")
        seen_at = time.time()
        for node, row in zip(status["nodes"], shown, strict=True):
            if node["layers"]:
                assert row["planned"] == f"{node['predicted_ms']:.2f}"
                assert row["live-text"] == ("-" if node["live_ms"] is None else f"{node['live_ms']:.2f}")
                assert row["drift"] == ("" if node["drift"] is None else f"{node['drift']:+.0%} vs planned")
            else:  # no share in this plan: nothing planned, nothing live
                assert (row["planned"], row["live-text"], row["drift"]) == ("-", "-", "")
            how = "corrected from live times" if node["profile_source"] == "live" else "profiled"
            ages = {age(seen_at - node["profiled_at"] - lag) for lag in (0, 1, 2)}  # a second may tick meanwhile
            assert row["profile"] in {f"{how} {each} ago" for each in ages}, row["profile"]
        assert any(row["drift"] for row in shown)  # learned(): a node with layers has a live time
        assert console(driver) == []
    finally:
        if driver is not None:
            driver.quit()
        cluster.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)


def test_the_decode_chart_grows_while_a_request_runs(cluster: Cluster, page: webdriver.Chrome) -> None:
    chart = "return window.dashboard.charts['chart-decode'].data[1].filter(value => value > 0).length"
    before = page.execute_script(chart)
    run = cluster.popen("run", PROMPT, "-n", LONG)
    try:
        seen = [before]
        deadline = time.monotonic() + 60
        while run.poll() is None and time.monotonic() < deadline and len(grown(seen)) < 4:
            seen.append(page.execute_script(chart))
            time.sleep(0.5)
        drawn = page.execute_script("return window.dashboard.charts['chart-decode'].data[0].length")
    finally:
        stderr = interrupt(cluster, run)
    assert run.returncode in (0, 130), stderr  # done, or stopped by Ctrl-C once the chart had grown
    assert len(grown(seen)) >= 3, f"the decode chart's points with tokens/s: {seen}"
    assert drawn >= seen[-1] and console(page) == []


def grown(seen: list[int]) -> list[int]:
    """The readings of a growing count that were larger than the one before."""
    return [later for earlier, later in itertools.pairwise(seen) if later > earlier]


def interrupt(cluster: Cluster, run: subprocess.Popen[str]) -> str:
    """Ctrl-C a `run` that has shown what it was for (its request is cancelled, not run to its end); its stderr."""
    if run.poll() is None:
        run.send_signal(signal.SIGINT)
    return cluster.finish(run, timeout=30)[1]


def test_a_screenshot_for_the_readme(cluster: Cluster, page: webdriver.Chrome, tmp_path: Path) -> None:
    """Two requests at once, a few seconds in: the README's picture (GGML_CLUSTER_SCREENSHOT names where to keep it,
    e.g. docs/dashboard.png)."""
    runs = [cluster.popen("run", prompt, "-n", LONG) for prompt in (PROMPT, "Once upon a time")]
    try:
        wait_for(page, "return window.dashboard.history.decode.filter(value => value > 0).length",
                 lambda count: count >= 8, 60, "eight seconds of decoding")
        shot = tmp_path / "dashboard.png"
        assert page.save_screenshot(str(shot))
    finally:
        for run in runs:
            interrupt(cluster, run)
    png = shot.read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and (width, height) == WINDOW and len(png) > 50_000
    if os.environ.get("GGML_CLUSTER_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["GGML_CLUSTER_SCREENSHOT"])


def shown_after_event(page: webdriver.Chrome, cluster: Cluster, node: str, marks: str, after: float) -> float:
    """Seconds from the controller's worker-exit event for ``node`` (recorded after ``after``) to the page's DOM
    showing the node `restarting` (stamped by WATCH_STATE into ``marks``)."""
    stamps = wait_for(page, f"return window.{marks}", lambda found: any(text == "restarting" for text, _ in found),
                      10, f"{node} restarting")
    shown = next(stamp for text, stamp in stamps if text == "restarting") / 1000
    event = next(event for event in reversed(cluster.status()["events"])
                 if event["node"] == node and event["kind"] == "worker-exit" and event["time"] > after)
    return float(shown - event["time"])


def test_a_worker_killed_mid_generation_shows_restarting_then_ready_and_recovered(
        cluster: Cluster, page: webdriver.Chrome) -> None:
    expected = json.loads(cluster.cli("run", PROMPT, "-n", "600", "--json").stdout)["text"]
    page.execute_script(WATCH_STATE, "n1", "marks")
    victim = cluster.worker_pid("n1")
    killed_at = time.time()
    result, text, _ = run_with_fault(cluster, PROMPT, "600", lambda: os.kill(victim, signal.SIGKILL))
    assert result.returncode == 0, result.stderr
    assert text == expected + "\n"
    latency = shown_after_event(page, cluster, "n1", "marks", killed_at)
    states = wait_for(page, "return window.marks.map(([text]) => text)",
                      lambda found: "ready" in found[found.index("restarting"):], 60, "n1 ready again")
    assert states.index("restarting") < len(states) - 1 - states[::-1].index("ready")
    kinds = wait_for(page, "return [...document.querySelectorAll('#events li')].map(item => item.dataset.kind)",
                     lambda found: "recovered" in found, 10, "a recovered event")
    assert "worker-exit" in kinds
    assert rows(page)["n1"]["restarts"] == "1" and page.execute_script(
        "return document.getElementById('recoveries').textContent") == "1"
    print(f"\nevent → DOM mid-generation: {latency * 1000:.0f} ms")
    assert 0 <= latency < 1.0, f"the page showed n1 restarting {latency:.3f}s after the controller's event"
    assert console(page) == []


def test_a_state_change_reaches_the_page_within_a_second_of_the_controllers_event(
        cluster: Cluster, page: webdriver.Chrome) -> None:
    """Idle workers killed one after another: the page's DOM against each worker-exit event's time."""
    latencies = []
    for attempt in range(3):
        marks = f"marks{attempt}"
        page.execute_script(WATCH_STATE, "n2", marks)
        killed_at = time.time()
        os.kill(cluster.worker_pid("n2"), signal.SIGKILL)
        latencies.append(shown_after_event(page, cluster, "n2", marks, killed_at))
        wait_for(page, NODE_ROWS, lambda found: all(row["state"] == "ready" for row in found), 60, "every node ready")
        deadline = time.monotonic() + 60
        while cluster.status()["coordinator"]["state"] != "ready":  # reloaded without n2's old worker
            assert time.monotonic() < deadline
            time.sleep(0.2)
    print(f"\nevent → DOM: {', '.join(f'{value * 1000:.0f} ms' for value in latencies)} "
          f"(median {statistics.median(latencies) * 1000:.0f} ms)")
    assert all(0 <= value < 1.0 for value in latencies), latencies
    assert console(page) == []


# --- beyond loopback -----------------------------------------------------------------------------------------

WEB_ADDRESS = "10.98.0.1"  # on a veth pair inside the test's own network namespace: reachable from nowhere else
KEY = "web-dashboard-key-0123456789abcdef"


@pytest.mark.timeout(300)
def test_beyond_loopback_the_dashboard_needs_the_key(short_tmp: Path) -> None:
    needs_browser()
    needs_bed()
    bed = NetBed(short_tmp / "bed", nodes=0)  # a namespace of its own, removed with everything in it
    try:
        _run("ip", "-n", bed.head, "link", "add", "web0", "type", "veth", "peer", "name", "web1")
        _run("ip", "-n", bed.head, "addr", "add", f"{WEB_ADDRESS}/24", "dev", "web0")
        for device in ("web0", "web1"):
            _run("ip", "-n", bed.head, "link", "set", device, "up")
        (short_tmp / "open").mkdir()
        open_api = Cluster(short_tmp / "open", nodes=1, api=f"{{host: {WEB_ADDRESS}, port: 0}}", prefix=bed.prefix)
        refused = open_api.cli("up", check=False)
        assert refused.returncode == 2 and "beyond loopback" in refused.stderr  # no key: not even started

        root = short_tmp / "keyed"
        root.mkdir()
        (root / "api.key").write_text(KEY + "\n")
        (root / "api.key").chmod(0o600)
        cluster = Cluster(root, nodes=2, api=f"{{host: {WEB_ADDRESS}, port: 0, key_file: api.key}}",
                          prefix=bed.prefix)
        try:
            up = cluster.cli("up")
            url = cluster.status()["dashboard_url"]
            assert url.startswith(f"http://{WEB_ADDRESS}:") and f"dashboard: {url} (sign in with the API key)" in \
                up.stderr
            probe = subprocess.run([*bed.prefix, sys.executable, "-m", "tests.web_login", url, KEY],
                                   capture_output=True, text=True, timeout=180, check=False,
                                   cwd=Path(__file__).resolve().parent.parent)
            assert probe.returncode == 0, probe.stderr
            seen = json.loads(probe.stdout)
        finally:
            cluster.cli("down", check=False)
    finally:
        bed.close()
    assert seen["without_key"] == {"form": True, "nodes": [], "stream": 401, "plan": 401}
    assert seen["wrong_key"] == {"form": True, "problem": "That is not this cluster's API key.", "nodes": []}
    assert seen["with_key"]["nodes"] == ["n0", "n1"] and seen["with_key"]["states"] == ["ready", "ready"]
    assert seen["with_key"]["cookie_readable"] is False and seen["with_key"]["errors"] == []
    assert seen["with_key"]["api_with_cookie"] == 401  # the session opens the dashboard, not the API
