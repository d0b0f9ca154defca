"""Pid files that outlived their processes (a reboot, a crash): a pid that now names somebody else's process
is never signalled, the stale file is cleaned up, and the cluster starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.inventory import load_inventory
from core.nodes.build import cached_worker
from core.nodes.worker import WorkerSpec
from core.state import Launch
from core.version import Version
from tests.harness import Cluster, alive
from tests.test_hardening import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Another user's process needs root to start; CI runs as root, so there the test must run.
AS_ROOT = os.geteuid() == 0 or bool(os.environ.get("CI"))
OWNERS = ["this user", pytest.param("another user", marks=pytest.mark.skipif(
    not AS_ROOT, reason="needs root to start a process as another user"))]


@pytest.fixture
def sleepers() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A `sleep` of this user and, as root, one of uid 65534: unrelated processes a stale pid may name."""
    started = {"this user": subprocess.Popen(["sleep", "300"])}
    if os.geteuid() == 0:
        started["another user"] = subprocess.Popen(["sleep", "300"], user=65534, group=65534)
    yield started
    for process in started.values():
        process.kill()
        process.wait()


@pytest.mark.parametrize("owner", OWNERS)
def test_a_stale_controller_pid_is_never_signalled_and_up_proceeds(
        short_tmp: Path, sleepers: dict[str, subprocess.Popen[bytes]], owner: str) -> None:
    sleeper = sleepers[owner]
    cluster = Cluster(short_tmp, nodes=1)
    pid_file = cluster.state / "controller.pid"
    cluster.state.mkdir(parents=True)
    try:
        pid_file.write_text(f"{sleeper.pid}\n")  # as the previous version wrote it: the pid alone
        down = cluster.cli("down", check=False)
        assert sleeper.poll() is None, "down signalled the process a stale pid file named"
        assert down.returncode == 0 and "Traceback" not in down.stderr, down.stderr
        assert "was not running" in down.stderr and not pid_file.exists()

        pid_file.write_text(f"{sleeper.pid}\n")
        up = cluster.cli("up", check=False)
        assert sleeper.poll() is None, "up signalled the process a stale pid file named"
        assert up.returncode == 0 and "Traceback" not in up.stderr, up.stderr
        assert cluster.status()["controller_pid"] != sleeper.pid
    finally:
        cluster.cli("down", check=False)
    assert sleeper.poll() is None
    assert gone(cluster)


@pytest.mark.parametrize("command", ["the same", "another"])
def test_stale_worker_pid_files_on_a_node_are_never_signalled(
        short_tmp: Path, sleepers: dict[str, subprocess.Popen[bytes]], command: str) -> None:
    """A node's folder as a reboot leaves it: pid files of a supervisor and worker that are gone, and the
    command they ran (this inventory's, or one it has since changed)."""
    mine = sleepers["this user"]
    theirs = sleepers.get("another user", mine)
    cluster = Cluster(short_tmp, nodes=1)
    folder = cluster.state / "nodes" / "n0"
    folder.mkdir(parents=True)
    binary = cached_worker()
    assert binary is not None
    spec = WorkerSpec(node="n0", workdir=str(folder), binary=str(binary.path), port=cluster.ports[0], threads=1,
                      cache=str(cluster.state / "tensor-cache"))
    (folder / "command").write_text(spec.command() if command == "the same" else f"{spec.command()} -v")
    (folder / "supervisor.pid").write_text(f"{mine.pid}\n")
    (folder / "worker.pid").write_text(f"{theirs.pid}\n")
    try:
        cluster.cli("up")
        assert mine.poll() is None and theirs.poll() is None, "up signalled processes stale pid files named"
        assert cluster.supervisor_pid("n0") not in (mine.pid, theirs.pid)
        cluster.cli("down")
        assert mine.poll() is None and theirs.poll() is None, "down signalled processes stale pid files named"
        assert not (folder / "supervisor.pid").exists() and not (folder / "worker.pid").exists()
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)


def test_down_stops_a_controller_that_has_not_opened_its_socket_yet_at_once(short_tmp: Path) -> None:
    """Ctrl-C of `up` can come between the controller's pid file and its socket. A controller whose model is a
    FIFO that nobody writes stays in that gap (reading the model blocks), so the gap can be tested."""
    cluster = Cluster(short_tmp, nodes=1)
    fifo = short_tmp / "model.gguf"
    os.mkfifo(fifo)
    inventory = load_inventory(cluster.inventory)
    cluster.state.mkdir(parents=True)
    (cluster.state / "inventory.json").write_text(
        json.dumps(inventory.model_dump(mode="json", exclude={"source"}), sort_keys=True))
    launch = Launch(binary="/nonexistent/ggml-rpc-server", protocol=Version(3, 0, 0), model=str(fifo))
    (cluster.state / "launch.json").write_text(json.dumps({**launch.to_dict(), "source": inventory.source}))
    root = str(Path(__file__).resolve().parent.parent)
    controller = subprocess.Popen([sys.executable, "-m", "core.controller", str(cluster.state)], cwd=root,
                                  env={**cluster.env(), "PYTHONPATH": root}, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (cluster.state / "controller.pid").exists():
            assert controller.poll() is None and time.monotonic() < deadline, "the controller did not start"
            time.sleep(0.05)
        started = time.monotonic()
        down = cluster.cli("down")
        assert time.monotonic() - started < 10, "down waited for a controller it could have stopped at once"
        assert "is down" in down.stderr
        controller.wait(timeout=5)
        assert not alive(controller.pid) and not (cluster.state / "controller.pid").exists()
    finally:
        controller.kill()
        controller.wait()
