"""In-protocol compute status (patches/0002), end to end on real workers and the real coordinator.

A failed compute injected into a patched worker (GGML_RPC_FAULT_COMPUTE, the patch's own hook) is reported on the
next reply, the coordinator retries the step in place, and nothing restarts; the data path is the stock wire
format; and each pairing of patched and stock client and worker works.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.engine.slots import RETRY_DELAYS_S
from core.model import write_demo_model
from core.nodes.build import worker_binary
from tests.harness import Cluster, alive, free_port, listening, run_with_fault
from tests.stock import installed_libdir, stock_client_libdir, stock_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = "The cluster"
TOKENS = "24"
# The coordinator's computes on a worker: one for the prompt, then one per token. The 5th fails mid-answer.
FIFTH = "5"


def fault_env(spec: str) -> list[str]:
    """Inventory lines that make a node's worker fail a compute (the patch's fault hook)."""
    return ["env:", f"  GGML_RPC_FAULT_COMPUTE: '{spec}'"]


@pytest.fixture(scope="module")
def expected() -> str:
    """The fault-free greedy text of the 3-worker cluster the fault tests use."""
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="gct-", dir="/tmp")), nodes=3)  # short: socket paths
    try:
        cluster.cli("up")
        return str(json.loads(cluster.cli("run", PROMPT, "-n", TOKENS, "--json").stdout)["text"])
    finally:
        cluster.cli("down", check=False)


@pytest.fixture
def faulty(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A 3-worker cluster whose node ``request.param[0]`` fails compute ``request.param[1]``."""
    index, spec = request.param
    cluster = Cluster(short_tmp, nodes=3, extra={index: fault_env(spec)})
    cluster.cli("up")
    yield cluster
    cluster.cli("down", check=False)
    assert cluster.processes() == []


def node(status: dict, name: str) -> dict:
    return next(item for item in status["nodes"] if item["name"] == name)


@pytest.mark.parametrize("faulty", [(1, FIFTH), (2, FIFTH + ":throw"), (1, FIFTH + ":abort")], indirect=True,
                         ids=["middle-fails", "last-throws-bad-alloc", "middle-aborts-half-way"])
def test_a_failed_compute_is_retried_in_place_and_nothing_restarts(faulty: Cluster, expected: str) -> None:
    name = next(f"n{index}" for index in range(3) if "GGML_RPC_FAULT_COMPUTE" in
                (faulty.worker_dir(f"n{index}") / "command").read_text())
    before = faulty.status()
    workers = {f"n{index}": faulty.worker_pid(f"n{index}") for index in range(3)}
    result = faulty.cli("run", PROMPT, "-n", TOKENS, "--json")
    assert json.loads(result.stdout)["text"] == expected
    after = faulty.status()
    assert {f"n{index}": faulty.worker_pid(f"n{index}") for index in range(3)} == workers
    assert after["coordinator"]["pid"] == before["coordinator"]["pid"]
    assert after["coordinator"]["restarts"] == 0 and after["recoveries"] == before["recoveries"]
    for item in after["nodes"]:
        assert item["restarts"] == 0, item
        assert item["connections"] == node(before, item["name"])["connections"], "a relay reconnected"
    failed = node(after, name)
    assert failed["compute_failures"] == 1 and failed["compute_status"] is True
    assert all(node(after, f"n{index}")["compute_failures"] == 0 for index in range(3) if f"n{index}" != name)
    assert failed["compute_retries"] == 1 and failed["last_compute_failure"].startswith("device 0: GGML_STATUS_")
    kinds = [(event["kind"], event["node"]) for event in after["events"]]
    assert ("compute-failed", name) in kinds and ("compute-retried", name) in kinds
    log = (faulty.worker_dir(name) / "worker.log").read_text()
    assert "graph compute failed on device 0 (CPU)" in log
    endpoint = after["metrics_endpoint"]
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    found = re.search(rf'^ggml_cluster_node_compute_failures_total{{[^}}]*node="{name}"[^}}]*}} (\S+)$', metrics, re.M)
    assert found and float(found.group(1)) == 1.0, metrics


# A plain llama-cpp-python greedy decode over RPC workers, run in its own process so that its RPC client library
# can be the installed (patched) one or a stock build (LLAMA_CPP_LIB_PATH).
PLAIN_CLIENT = """
import ctypes, json, os, sys
from pathlib import Path
import llama_cpp
lib = Path(os.environ["LLAMA_CPP_LIB_PATH"])
ggml = ctypes.CDLL(str(lib / "libggml.so.0"), mode=ctypes.RTLD_GLOBAL)
rpc = ctypes.CDLL(str(lib / "libggml-rpc.so.0"), mode=ctypes.RTLD_GLOBAL)
rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
endpoints = sys.argv[2:]
for endpoint in endpoints:
    ggml.ggml_backend_register(rpc.ggml_backend_rpc_add_server(endpoint.encode()))
llm = llama_cpp.Llama(model_path=sys.argv[1], n_gpu_layers=-1, tensor_split=[1] * len(endpoints), n_ctx=256,
                      n_threads=1, verbose=False)
out = llm.create_completion("The cluster", max_tokens=16, temperature=0.0)
print(json.dumps({"text": out["choices"][0]["text"],
                  "patched": hasattr(rpc, "ggml_backend_rpc_take_compute_failure")}))
"""


def plain_client(libdir: Path, model: Path, ports: list[int]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PLAIN_CLIENT, str(model), *(f"127.0.0.1:{port}" for port in ports)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "LLAMA_CPP_LIB_PATH": str(libdir)})


class Workers:
    """ggml-rpc-server processes started directly (no controller), with their logs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []

    def start(self, binary: Path, env: dict[str, str] | None = None) -> int:
        port = free_port()
        log = (self.root / f"worker-{port}.log").open("wb")
        self.processes.append(subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}))
        deadline = time.monotonic() + 20
        while not listening(port):
            assert time.monotonic() < deadline, f"worker on {port} did not start"
            time.sleep(0.05)
        self.ports.append(port)
        return port

    def log(self, port: int) -> str:
        return (self.root / f"worker-{port}.log").read_text(errors="replace")

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    started = Workers(tmp_path)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("model")) / "demo.gguf"
    write_demo_model(path)
    return path


def test_stock_client_and_patched_workers_speak_the_stock_protocol(workers: Workers, model: Path) -> None:
    patched = worker_binary().path
    ports = [workers.start(patched), workers.start(patched)]
    reference = plain_client(installed_libdir(), model, ports)
    assert reference.returncode == 0, reference.stderr[-2000:]
    stock = plain_client(stock_client_libdir(), model, ports)
    assert stock.returncode == 0, stock.stderr[-2000:]
    assert json.loads(reference.stdout)["patched"] and not json.loads(stock.stdout)["patched"]
    assert json.loads(stock.stdout)["text"] == json.loads(reference.stdout)["text"]


def test_a_stock_client_loses_only_its_connection_when_a_patched_worker_fails_a_compute(
        workers: Workers, model: Path) -> None:
    patched = worker_binary().path
    healthy, failing = workers.start(patched), workers.start(patched, {"GGML_RPC_FAULT_COMPUTE": "3"})
    stock = plain_client(stock_client_libdir(), model, [healthy, failing])
    assert stock.returncode != 0  # stock ggml-rpc aborts on a closed connection: that is the client it is
    assert "Remote RPC server crashed or returned malformed response" in stock.stderr
    log = workers.log(failing)
    assert "graph compute failed on device 0 (CPU): GGML_STATUS_FAILED (-1)" in log
    assert "the client did not opt in to compute status: closing its connection" in log
    assert all(alive(process.pid) for process in workers.processes)  # it did not die, and it serves again:
    again = plain_client(installed_libdir(), model, [healthy, failing])
    assert again.returncode == 0, again.stderr[-2000:]


def test_patched_client_and_stock_worker(workers: Workers, model: Path) -> None:
    patched, stock = worker_binary().path, stock_worker().path
    mixed = plain_client(installed_libdir(), model, [workers.start(patched), workers.start(stock)])
    assert mixed.returncode == 0, mixed.stderr[-2000:]
    both = plain_client(installed_libdir(), model, [workers.start(patched), workers.start(patched)])
    assert json.loads(mixed.stdout)["text"] == json.loads(both.stdout)["text"]


def greedy_run(cluster: Cluster) -> tuple[str, dict]:
    """Up, one greedy run, the status, down: the text and the status after the run."""
    cluster.cli("up")
    try:
        text = str(json.loads(cluster.cli("run", PROMPT, "-n", TOKENS, "--json").stdout)["text"])
        return text, cluster.status()
    finally:
        cluster.cli("down", check=False)


def test_zero_extra_round_trips_the_data_path_is_the_same_with_the_feature_on_and_off(short_tmp: Path) -> None:
    for arm in ("on", "off"):
        (short_tmp / arm).mkdir()
    on = Cluster(short_tmp / "on", nodes=2)
    off = Cluster(short_tmp / "off", nodes=2, ports=on.ports,
                  base_env={**os.environ, "GGML_RPC_COMPUTE_STATUS": "0"})  # the client keeps the stock protocol
    text_on, status_on = greedy_run(on)
    text_off, status_off = greedy_run(off)
    assert text_on == text_off
    for name in ("n0", "n1"):
        seen_on, seen_off = node(status_on, name)["session"], node(status_off, name)["session"]
        assert seen_on["counts"].get("COMPUTE_STATUS") == 1 and "COMPUTE_STATUS" not in seen_off["counts"]
        # the same requests in the same order (the opt-in aside), so not one more answer to wait for ...
        assert (seen_on["commands"], seen_on["digest"]) == (seen_off["commands"], seen_off["digest"]), name
        assert seen_on["counts"]["GRAPH_COMPUTE"] + seen_on["counts"].get("GRAPH_RECOMPUTE", 0) >= int(TOKENS)
        # ... and the same bytes back: on success the answers are the stock format
        assert seen_on["bytes_from"] == seen_off["bytes_from"], name
        assert seen_on["bytes_to"] - seen_off["bytes_to"] == 1 + 8 + 4  # the one-way opt-in: cmd, size, flags
        assert node(status_on, name)["compute_status"] is True


def test_a_cluster_with_a_stock_worker_works_and_says_which_nodes_report_failed_computes(
        short_tmp: Path, expected_two: str) -> None:
    mixed = Cluster(short_tmp, nodes=2, extra={1: [f"build: {{path: {stock_worker().path}}}"]})
    text, status = greedy_run(mixed)
    assert text == expected_two
    assert node(status, "n0")["compute_status"] is True and node(status, "n1")["compute_status"] is False
    assert "COMPUTE_STATUS" not in node(status, "n1")["session"]["counts"]


@pytest.fixture(scope="module")
def expected_two() -> str:
    """The greedy text of a 2-worker cluster of patched workers."""
    return greedy_run(Cluster(Path(tempfile.mkdtemp(prefix="gct-", dir="/tmp")), nodes=2))[0]


@pytest.mark.parametrize("faulty", [(2, FIFTH + "+")], indirect=True, ids=["last-always-fails"])
def test_a_failure_that_persists_takes_the_restart_path_and_the_text_is_unchanged(
        faulty: Cluster, expected: str) -> None:
    coordinator = faulty.status()["coordinator"]["pid"]
    result = faulty.cli("run", PROMPT, "-n", TOKENS, "--json")
    assert json.loads(result.stdout)["text"] == expected
    status = faulty.status()
    assert status["coordinator"]["pid"] != coordinator and status["recoveries"] >= 1
    failing = node(status, "n2")
    assert failing["restarts"] >= 1 and failing["compute_failures"] >= len(RETRY_DELAYS_S) + 1
    assert failing["last_status"] == "killed by the controller: a persistent compute failure"
    assert "persistent compute failure on n2" in result.stderr


@pytest.mark.parametrize("faulty", [(1, "1000")], indirect=True, ids=["no-fault"])
def test_a_lost_worker_still_takes_the_restart_path_and_the_abort_names_endpoint_and_command(
        faulty: Cluster, expected: str) -> None:
    victim = faulty.worker_pid("n1")
    result, text, _ = run_with_fault(faulty, PROMPT, TOKENS, lambda: os.kill(victim, signal.SIGKILL))
    assert result.returncode == 0, result.stderr
    assert text == expected + "\n"
    log = (faulty.state / "coordinator.log").read_text(errors="replace")
    assert re.search(r"Remote RPC server crashed or returned malformed response: 127\.0\.0\.1:\d+, during [A-Z_]+ "
                     r"\(command \d+\)", log), log[-3000:]
