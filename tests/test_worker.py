"""Worker exits classified from real logs; the node supervisor restarts, backs off, and gives up."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from core.inventory import parse_inventory
from core.nodes import worker
from core.nodes.remote import LocalRemote
from tests.harness import FIXTURES, alive, pid_in


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(errors="replace")


def test_graph_compute_failure_on_the_worker() -> None:
    log = ("load_tensors: ...\n/src/ggml/src/ggml-rpc/ggml-rpc.cpp:1780: GGML_ASSERT(status == GGML_STATUS_SUCCESS "
           "&& \"Unsuccessful graph computations are not supported with RPC\") failed\n")
    assert worker.classify_exit(134, log) == (
        "killed by SIGABRT: graph compute failed (GGML_ASSERT status == GGML_STATUS_SUCCESS)")


def test_cuda_out_of_memory_logs() -> None:
    for name in ("ggml-cuda_oom_compute-buffer_timestamped-log_llama.cpp-pr26297-comment.txt",
                 "ggml-cuda_oom_model-load_alloc-buffer-failed_llama.cpp-issue20431.txt",
                 "ggml-cuda_oom_CUDA-error-out-of-memory_old-GGML_ASSERT-format_windows_ollama-issue3237.txt"):
        assert ": out of memory" in worker.classify_exit(134, fixture(name)), name


def test_client_side_assert_lines() -> None:
    text = fixture("rpc-client_crash_GGML_ASSERT-status-failed_before-pr14076_macos.txt")
    assert worker.classify_exit(134, text) == "killed by SIGABRT: GGML_ASSERT(status) failed"
    text = fixture("rpc-client_crash_remote-rpc-server-crashed_after-pr14076_macos.txt")
    assert worker.classify_exit(134, text) == (
        "killed by SIGABRT: Remote RPC server crashed or returned malformed response")


def test_signals_and_plain_exits() -> None:
    assert worker.classify_exit(137, "accepted client\n") == "killed by SIGKILL"
    assert worker.classify_exit(-9, "") == "killed by SIGKILL"
    assert worker.classify_exit(1, "Failed to create server socket\n") == (
        "exit code 1: port already in use or not bindable")
    assert worker.classify_exit(1, "error: unknown argument: --bogus\n") == (
        "exit code 1: error: unknown argument: --bogus")
    assert worker.classify_exit(0, "") == "exit code 0"


def test_event_lines() -> None:
    event = worker.parse_event('{"time":1700000000,"kind":"exit","code":137,"ran_s":4,"log_offset":10}')
    assert event == worker.WorkerEvent(time=1700000000.0, kind="exit", code=137, ran_s=4, log_offset=10)
    assert worker.parse_event('{"time":1,"kind":') is None
    assert worker.parse_event("[1, 2]") is None


def test_spec_quotes_everything_for_the_shell(tmp_path: Path) -> None:
    spec = worker.WorkerSpec(node="n", workdir=str(tmp_path / "a b;$(touch x)"), binary="/bin/x y", port=5)
    command = spec.supervisor_command()
    assert "'/bin/x y'" in command and "'" + str(tmp_path / "a b;$(touch x)") + "'" in command


def test_the_nodes_env_prefixes_the_command_sorted_and_quoted() -> None:
    node = parse_inventory("cluster: c\nnodes:\n  - name: n\n    kind: local\n    env:\n"
                           "      GGML_RPC_FAULT_COMPUTE: 'x y;$(id)'\n      CUDA_VISIBLE_DEVICES: '1'\n",
                           "inv.yaml").nodes[0]
    spec = worker.WorkerSpec(node="n", workdir="/w", binary="/b", port=5, env=worker.environment(node))
    assert spec.env == (("CUDA_VISIBLE_DEVICES", "1"), ("GGML_RPC_FAULT_COMPUTE", "x y;$(id)"))
    assert spec.command() == "env CUDA_VISIBLE_DEVICES=1 'GGML_RPC_FAULT_COMPUTE=x y;$(id)' /b -H 127.0.0.1 -p 5 -c"
    cached = replace(spec, cache="/c")
    assert cached.command().startswith("env LLAMA_CACHE=/c CUDA_VISIBLE_DEVICES=1 'GGML_RPC_FAULT_COMPUTE=")
    # Without an env, the command is what it was: workers started before `env:` existed are still adopted.
    assert replace(spec, env=()).command() == "/b -H 127.0.0.1 -p 5 -c"
    assert replace(cached, env=()).command() == "env LLAMA_CACHE=/c /b -H 127.0.0.1 -p 5 -c"


@pytest.mark.timeout(60)
def test_the_worker_runs_with_the_nodes_env_and_a_changed_env_restarts_it(tmp_path: Path) -> None:
    spec = replace(_spec(tmp_path, 'echo "$GGML_RPC_DEBUG" > seen; exec sleep 300\n'), env=(("GGML_RPC_DEBUG", "1"),))
    remote = LocalRemote("n")
    seen = Path(spec.workdir) / "seen"
    assert asyncio.run(worker.start(remote, spec)) is False
    _wait_for(lambda: seen.exists() and seen.read_text() == "1\n")
    assert asyncio.run(worker.start(remote, spec)) is True  # the same env: adopted
    changed = replace(spec, env=(("GGML_RPC_DEBUG", "2"),))
    assert asyncio.run(worker.start(remote, changed)) is False  # another env: another worker
    _wait_for(lambda: seen.read_text() == "2\n")
    asyncio.run(worker.stop(remote, changed))


def _spec(tmp_path: Path, script: str, max_exits: int = 3) -> worker.WorkerSpec:
    """A worker whose binary is a shell script standing in for a misbehaving ggml-rpc-server."""
    program = tmp_path / "fake-worker"
    program.write_text("#!/bin/sh\n" + script)
    program.chmod(0o755)
    return worker.WorkerSpec(node="n", workdir=str(tmp_path / "work"), binary=str(program), port=1,
                             max_exits=max_exits, window_s=60, max_backoff_s=1)


def _events(spec: worker.WorkerSpec) -> list[dict]:
    path = Path(worker.event_path(spec))
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_crash_loop_is_recorded_and_stops(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "echo 'GGML_ASSERT(x) failed' >&2; exit 3\n")
    remote = LocalRemote("n")
    assert asyncio.run(worker.start(remote, spec)) is False
    _wait_for(lambda: any(event["kind"] == "failed" for event in _events(spec)))
    events = _events(spec)
    kinds = [event["kind"] for event in events]
    assert kinds.count("started") == 3 and kinds.count("exit") == 3 and kinds[-1] == "failed"
    assert all(event["code"] == 3 for event in events if event["kind"] == "exit")
    assert [event["seconds"] for event in events if event["kind"] == "backoff"] == [1, 1]
    assert asyncio.run(worker.running_supervisor(remote, spec)) is None
    last_exit = worker.parse_event(json.dumps([e for e in events if e["kind"] == "exit"][-1]))
    assert last_exit is not None
    log = asyncio.run(worker.read_log(remote, spec, last_exit.log_offset or 0))
    assert worker.classify_exit(3, log) == "exit code 3: GGML_ASSERT(x) failed"


@pytest.mark.timeout(60)
def test_restart_after_a_kill_then_adopt_then_stop(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "exec sleep 300\n")
    remote = LocalRemote("n")
    assert asyncio.run(worker.start(remote, spec)) is False
    workdir = Path(spec.workdir)
    _wait_for((workdir / "worker.pid").exists)
    first = pid_in(workdir / "worker.pid")
    supervisor = pid_in(workdir / "supervisor.pid")
    os.kill(first, signal.SIGKILL)
    _wait_for(lambda: (workdir / "worker.pid").exists() and pid_in(workdir / "worker.pid") != first)
    exits = [event for event in _events(spec) if event["kind"] == "exit"]
    assert exits and exits[0]["code"] == 137
    # Same command: adopted, nothing restarted.
    assert asyncio.run(worker.start(remote, spec)) is True
    assert pid_in(workdir / "supervisor.pid") == supervisor
    second = pid_in(workdir / "worker.pid")
    asyncio.run(worker.stop(remote, spec))
    _wait_for(lambda: not alive(second) and not alive(supervisor), timeout=10)
    assert _events(spec)[-1]["kind"] == "stopped"
    assert not (workdir / "supervisor.pid").exists()


@pytest.mark.timeout(60)
def test_the_running_worker_is_found_by_its_pid_file_while_it_runs(tmp_path: Path) -> None:
    # No exec: the shell keeps the worker's command line (`-p 1 -c …`), by which its pid file is checked.
    spec = _spec(tmp_path, "trap 'exit 0' TERM\nwhile :; do sleep 0.2; done\n")
    remote = LocalRemote("n")
    assert asyncio.run(worker.start(remote, spec)) is False
    _wait_for(lambda: asyncio.run(worker.running_worker(remote, spec)) is not None)
    assert asyncio.run(worker.running_worker(remote, spec)) == pid_in(Path(spec.workdir) / "worker.pid")
    asyncio.run(worker.stop(remote, spec))
    assert asyncio.run(worker.running_worker(remote, spec)) is None


def test_a_local_command_that_starts_a_daemon_returns_on_the_controllers_loop() -> None:
    """The controller runs on uvloop, whose children keep copies of their pipes: a daemon started by a
    command (the supervisor is one) must not hold the command's output open until it exits."""
    import uvloop

    async def start_and_follow() -> tuple[str, list[str]]:
        remote = LocalRemote("n0")
        started = await remote.run("(sleep 29.75 </dev/null >/dev/null 2>&1 &); echo started", timeout=10)
        lines = [line async for line in remote.follow("(sleep 29.75 </dev/null >/dev/null 2>&1 &); echo one")]
        return started.stdout, lines

    try:
        assert uvloop.run(start_and_follow()) == ("started\n", ["one"])
    finally:
        subprocess.run(["pkill", "-f", "^sleep 29.75$"], check=False)  # the daemons this test started


def test_the_node_commands_answers_are_parsed() -> None:
    from core.nodes.worker import parse_count, parse_stopped

    assert parse_count("   1234\n") == 1234 and parse_count("") == 0 and parse_count("wc: no such file") == 0
    assert parse_stopped("T\n") and parse_stopped("Tl ") and not parse_stopped("Sl\n") and not parse_stopped("")
