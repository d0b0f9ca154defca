"""A live local cluster under hostile and interrupted use: private state, other users and garbage turned
away, Ctrl-C and kill -9 of `up` and `down` left in a state the next command finishes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Cluster, alive, listening, running_cluster
from tests.test_cluster import PROMPT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Runs as another user: only the standard library, from the system's Python (the venv may be private).
AS_ANOTHER_USER = """
import json, socket, sys
with socket.socket(socket.AF_UNIX) as connection:
    connection.connect(sys.argv[1])
    try:
        connection.sendall(b'{"op": "status"}\\n')
    except OSError:  # refused at connect: the answer and the hang-up may come before this is sent
        pass
    print(connection.makefile().readline())
"""


@pytest.fixture(scope="module")
def cluster2() -> Iterator[Cluster]:
    yield from running_cluster("gch-", 2)


def control(cluster: Cluster, data: bytes) -> bytes:
    """Send raw bytes on the control socket; what the controller answers before it closes."""
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(10)
        connection.connect(str(cluster.state / "control.sock"))
        with contextlib.suppress(BrokenPipeError):  # it may answer and hang up before reading it all
            connection.sendall(data)
            connection.shutdown(socket.SHUT_WR)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := connection.recv(65536):
                answer += chunk
        return answer


def test_state_is_private_to_its_user(cluster2: Cluster) -> None:
    assert stat.S_IMODE(cluster2.state.stat().st_mode) == 0o700
    assert stat.S_IMODE((cluster2.state / "control.sock").stat().st_mode) == 0o600


# Skipped only on a developer's machine: CI runs as root with a system Python, and there the test must run.
@pytest.mark.skipif((os.geteuid() != 0 or not Path("/usr/bin/python3").exists()) and not os.environ.get("CI"),
                    reason="needs root (to act as another user) and /usr/bin/python3 (a Python that user can run)")
def test_another_user_is_refused_even_when_the_permissions_let_it_in(cluster2: Cluster) -> None:
    opened = [cluster2.root, cluster2.state, cluster2.state / "control.sock"]
    modes = [path.stat().st_mode for path in opened]
    try:
        for path in opened:  # as if the user had loosened them by hand
            path.chmod(0o777)
        result = subprocess.run(["/usr/bin/python3", "-c", AS_ANOTHER_USER, str(cluster2.state / "control.sock")],
                                user=65534, group=65534, capture_output=True, text=True, timeout=30, check=True)
    finally:
        for path, mode in zip(opened, modes, strict=True):
            path.chmod(stat.S_IMODE(mode))
    assert json.loads(result.stdout) == {"event": "error", "message": "this cluster belongs to another user",
                                         "exit_code": 1}
    events = cluster2.status()["events"]
    assert any(event["kind"] == "refused" and "uid 65534" in event["message"] for event in events)


@pytest.mark.parametrize(("data", "expected"), [
    (b"x" * 300_000, b"bad request"),                                    # one line over the reader's limit
    (b"\xff\xfe\x00garbage\n", b"bad request"),                          # not UTF-8
    (b"{not json\n", b"bad request"),
    (b"[1, 2]\n", b"unknown op None"),
    (b'{"op": "watch", "interval": "soon"}\n', b"bad request"),
    (b'{"op": "run", "prompt": {"a": 1}}\n', b"'prompt' must be text"),
    (b'{"op": "run", "prompt": "hi", "max_tokens": 1e300}\n', b"max_tokens 1e+300 is more than the context holds"),
    (b'{"op": "run", "messages": "hi"}\n', b"'messages' must be a list of objects"),
    (os.urandom(4096), None),
])
def test_garbage_on_the_control_socket_is_answered_and_the_controller_serves_on(
        cluster2: Cluster, data: bytes, expected: bytes | None) -> None:
    controller = cluster2.controller_pid()
    answer = control(cluster2, data)
    if expected is not None:
        assert expected in answer if expected else answer == b""
    assert alive(controller)
    result = json.loads(cluster2.cli("run", PROMPT, "-n", "4", "--json").stdout)
    assert result["completion_tokens"] == 4


@pytest.mark.parametrize("data", [
    b'{"op": "fly"}\n', b"[1, 2]\n", b'{"op": "watch", "interval": "soon"}\n', b"x" * 300_000,
    b'{"op": "run", "prompt": {"a": 1}}\n', b'{"op": "run", "prompt": "hi", "max_tokens": 1e300}\n',
    b'{"op": "run", "prompt": "hi", "max_tokens": 20000000}\n',
])
def test_every_error_on_the_control_socket_has_one_shape(cluster2: Cluster, data: bytes) -> None:
    answer = json.loads(control(cluster2, data))
    assert answer["event"] == "error" and set(answer) == {"event", "message", "exit_code"}
    assert answer["exit_code"] == 2 and "\n" not in answer["message"]


def test_a_run_longer_than_the_context_is_refused_in_one_line(cluster2: Cluster) -> None:
    result = cluster2.cli("run", PROMPT, "-n", "20000000", check=False)
    assert result.returncode == 2
    message = result.stderr.strip()
    assert "\n" not in message and "max_tokens" in message and "512" in message, message


def test_watch_with_no_interval_does_not_spin_the_controller(cluster2: Cluster) -> None:
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(str(cluster2.state / "control.sock"))
        connection.sendall(b'{"op": "watch", "interval": 0}\n')
        connection.settimeout(0.2)
        snapshots, deadline = b"", time.monotonic() + 2
        with contextlib.suppress(TimeoutError):
            while time.monotonic() < deadline:
                snapshots += connection.recv(1 << 20)
    assert 1 <= snapshots.count(b"\n") <= 30  # at most ~10 a second, not as fast as the loop goes


def wait_for(condition, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(cluster: Cluster, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while cluster.processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not cluster.processes() and not any(listening(port) for port in cluster.ports)


def test_ctrl_c_during_up_stops_what_it_started_and_the_next_up_works(short_tmp: Path) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    try:
        up = cluster.popen("up")
        wait_for((cluster.state / "controller.pid").exists, what="the controller")
        up.send_signal(signal.SIGINT)
        _, stderr = Cluster.finish(up, timeout=120)
        assert up.returncode == 130
        assert "interrupted; what this `up` had started was stopped" in stderr and "Traceback" not in stderr
        assert gone(cluster)
        cluster.cli("up")
        assert json.loads(cluster.cli("run", PROMPT, "-n", "4", "--json").stdout)["completion_tokens"] == 4
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)


def kill_up_once_the_controller_starts(cluster: Cluster) -> None:
    """`up` killed (as by Ctrl-C twice) as soon as the controller it started has written its pid."""
    up = cluster.popen("up")
    wait_for((cluster.state / "controller.pid").exists, what="the controller")
    up.kill()
    up.communicate(timeout=30)


def test_down_as_the_controller_starts_its_nodes_leaves_no_worker_behind(short_tmp: Path) -> None:
    """`down` (or Ctrl-C of `up`) can reach the controller while it is starting its workers: a start still
    under way must not outlive the stop. Sent on the raw socket the moment it opens (the CLI takes longer
    to load), with the `up` that started the controller gone, whose clean-up would mask it."""
    cluster = Cluster(short_tmp, nodes=2)
    try:
        kill_up_once_the_controller_starts(cluster)
        answer = None
        while answer is None:  # the socket's file appears a moment before it listens
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                answer = control(cluster, b'{"op": "down"}\n')
            time.sleep(0.001)
        assert json.loads(answer) == {"ok": True, "left_running": []}
        assert gone(cluster, timeout=10)
    finally:
        cluster.cli("down", check=False)


def test_killed_up_is_finished_by_the_next_up(short_tmp: Path) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    try:
        kill_up_once_the_controller_starts(cluster)
        again = cluster.cli("up")  # waits for the controller the killed `up` left starting
        assert "ready: 2 worker(s)" in again.stderr
        assert json.loads(cluster.cli("run", PROMPT, "-n", "4", "--json").stdout)["completion_tokens"] == 4
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)


@pytest.mark.parametrize(("how", "after"), [(signal.SIGINT, 0.2), (signal.SIGINT, 1.0), (signal.SIGKILL, 1.0)])
def test_interrupted_down_is_finished_by_the_next_down(short_tmp: Path, how: signal.Signals, after: float) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    try:
        cluster.cli("up")
        down = cluster.popen("down")
        time.sleep(after)  # 0.2 s: while the command still loads
        down.send_signal(how)
        _, stderr = Cluster.finish(down, timeout=120)
        assert "Traceback" not in stderr
        result = cluster.cli("down")
        assert "is down" in result.stderr or "was not running" in result.stderr
        assert gone(cluster)
        assert not (cluster.state / "control.sock").exists() and not (cluster.state / "controller.pid").exists()
        cluster.cli("up")  # and the cluster starts again from what was left
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)
