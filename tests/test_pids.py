"""Pid files as identities: a process is signalled only while its pid file still names it (start time and
command line), in Python (the controller's pid file) and in pids.sh (every pid file on a node)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.nodes.shell import PIDS
from core.state import PidRecord, StateDir, process_command, process_start


def started(argv: list[str]) -> subprocess.Popen[bytes]:
    """``argv`` running, once its command line is its own (until it execs, a child has its parent's)."""
    process = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    while process_command(process.pid) != " ".join(argv):
        assert time.monotonic() < deadline, f"{argv} did not start"
        time.sleep(0.01)
    return process


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = started(["sleep", "300"])
    yield process
    process.kill()
    process.wait()


def sh(script: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``script`` after pids.sh, in /bin/sh (dash on Debian), in ``folder``."""
    return subprocess.run(["/bin/sh", "-c", f"{PIDS}\n{script}"], cwd=folder, capture_output=True, text=True,
                          check=False, timeout=30)


def test_python_and_the_nodes_shell_record_the_same_start(sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    start = process_start(sleeper.pid)
    assert start and " " not in start
    recorded = sh(f"record {sleeper.pid}", tmp_path).stdout
    assert recorded == f"{sleeper.pid} {start}\n" == PidRecord.of(sleeper.pid).text()


@pytest.mark.parametrize(("line", "marker", "ours"), [
    ("{pid} {start}", " sleep 300 ", True),
    ("{pid}", " sleep 300 ", True),                          # the previous version's file: command line only
    ("{pid} {start}", " -m core.controller /x ", False),    # same process, not the command recorded
    ("{pid} x{start}", " sleep 300 ", False),               # the pid was reused: another start
    ("{dead}", " sleep 300 ", False),
    ("garbage", " sleep 300 ", False),
    ("", " sleep 300 ", False),
])
def test_a_pid_file_names_its_process_only_while_it_runs(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, line: str, marker: str, ours: bool) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    text = line.format(pid=sleeper.pid, start=process_start(sleeper.pid), dead=dead.pid)
    path = tmp_path / "thing.pid"
    path.write_text(text + "\n")
    record = PidRecord.read(path)
    assert (record is not None and record.running(marker)) is ours
    shell = sh(f"ours thing.pid '{marker}'", tmp_path)
    assert (shell.returncode == 0) is ours
    if ours:
        assert shell.stdout == f"{sleeper.pid} {process_start(sleeper.pid)}\n"
    # Neither side signals a process its file does not name.
    assert (record is not None and record.signal(signal.SIGTERM, marker)) is ours
    if not ours:
        sh(f"send TERM \"$(ours thing.pid '{marker}')\"; send KILL '{sleeper.pid} x'", tmp_path)
        assert sleeper.poll() is None
    else:
        assert sleeper.wait(timeout=10) == -signal.SIGTERM


def test_the_controllers_pid_file_names_it_only_with_its_state_dir(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    state.root.mkdir()
    state.write_pid()  # this test process: its command line is pytest's, not a controller's
    assert state.pid.read_text() == PidRecord.of(os.getpid()).text()
    assert state.controller_pid() is None and state.signal_controller(0) is False
    # A process whose command line is a controller's: of this state dir, and of one whose name starts alike.
    for root, ours in ((state.root, True), (tmp_path / "state2", False)):
        stand_in = started([sys.executable, "-c", "import time; time.sleep(60)", "-m", "core.controller", str(root)])
        try:
            state.pid.write_text(PidRecord.of(stand_in.pid).text())
            assert (state.controller_pid() == stand_in.pid) is ours
            assert state.signal_controller(signal.SIGTERM) is ours
            assert (stand_in.wait(timeout=10) == -signal.SIGTERM) if ours else stand_in.poll() is None
        finally:
            stand_in.kill()
            stand_in.wait()
