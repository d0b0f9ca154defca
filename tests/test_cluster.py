"""End to end on one machine: real ggml-rpc-server workers, the real coordinator, the real CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import CLI, FIXTURES, Cluster, alive, listening, pid_in, run_with_fault

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = "The cluster"
DOCUMENTED_NODE_FIELDS = {"name", "host", "arch", "backend", "state", "layers", "mem_total", "mem_free",
                          "restarts", "last_status", "last_error"}

REFERENCE = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_gpu_layers=0, n_ctx=512, n_threads=1, verbose=False)
out = llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0)
print(json.dumps({"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"]}))
"""


def single_process(model: str, prompt: str, tokens: int) -> dict:
    """The same model in one process, no RPC, through llama-cpp-python's own completion API."""
    result = subprocess.run([sys.executable, "-c", REFERENCE, model, prompt, str(tokens)],
                            capture_output=True, text=True, check=True, timeout=300)
    return json.loads(result.stdout)


def test_up_shows_every_worker_ready_with_its_layers(cluster3: Cluster) -> None:
    status = cluster3.status()
    assert status["coordinator"]["state"] == "ready"
    assert status["coordinator"]["endpoint"]
    assert [node["name"] for node in status["nodes"]] == ["n0", "n1", "n2"]
    for node in status["nodes"]:
        assert set(node) >= DOCUMENTED_NODE_FIELDS
        assert node["state"] == "ready"
        assert node["mem_total"] > 0 and node["mem_free"] > 0
    # 8 layers + output over three equal workers, exactly as llama.cpp assigns them.
    assert [node["layers"] for node in status["nodes"]] == [[0, 2], [3, 5], [6, 7]]
    assert {"time", "node", "kind", "message"} <= set(status["events"][-1])
    assert status["cluster"] and status["model"]
    text = cluster3.cli("status", "--once").stdout
    assert "n0" in text and "0-2" in text and "6-7" in text


def test_plan_shows_the_running_layout_and_why(cluster3: Cluster) -> None:
    shown = json.loads(cluster3.cli("plan", "--json").stdout)
    assert [row["layers"] for row in shown["rows"]] == [[0, 2], [3, 5], [6, 7]]
    assert shown["tensor_split"] == cluster3.status()["tensor_split"]
    assert all("its share of usable memory" in row["why"] for row in shown["rows"])
    assert (shown["slots"], shown["slots_auto"]) == (4, True)  # api.parallel: auto, the default
    equal = cluster3.cli("plan", "--strategy", "equal")
    assert "3 of 8 layers" in equal.stdout
    assert "; 4 slots (auto) of 512 tokens: a 2048-token KV cache" in equal.stderr
    assert cluster3.cli("plan", "--strategy", "fastest", check=False).returncode == 2


def test_greedy_text_equals_single_process(cluster3: Cluster) -> None:
    result = json.loads(cluster3.cli("run", PROMPT, "-n", "64", "--json").stdout)
    model = json.loads((cluster3.state / "launch.json").read_text())["model"]
    reference = single_process(model, PROMPT, 64)
    assert result["completion_tokens"] == 64 == reference["tokens"]
    assert result["text"] == reference["text"]
    assert result["recoveries"] == []


def test_status_shows_each_nodes_computes_from_the_relay(cluster3: Cluster) -> None:
    before = {node["name"]: node["computes"] + node["recomputes"] for node in cluster3.status()["nodes"]}
    watch = cluster3.popen("status", "--watch", "--json", "--interval", "0.1")
    running = cluster3.popen("run", PROMPT, "-n", "450")
    try:
        assert watch.stdout is not None
        seen = None
        for line in watch.stdout:  # a snapshot on every change, and every 0.1 s
            status = json.loads(line)
            if status["requests_in_flight"] == 1 and all(
                    node["computes"] + node["recomputes"] > before[node["name"]] for node in status["nodes"]):
                seen = status
                break
            if running.poll() is not None:
                break
        assert seen is not None, "no snapshot showed the run with computes on every node"
        for node in seen["nodes"]:
            assert node["layers"] and node["compute_ms"] > 0 and node["link"] == "connected"
            assert node["computes_timed"] > 0 and node["compute_ms_total"] > 0
            assert node["bytes_to"] > 0 and node["bytes_from"] > 0
    finally:
        watch.kill()
        watch.communicate()
        running.communicate(timeout=120)
    after = cluster3.status()
    assert after["requests_in_flight"] == 0
    assert after["decode_tokens_per_s"] > 0 and after["prompt_tokens_per_s"] > 0


def test_run_streams_text_to_stdout(cluster3: Cluster) -> None:
    streamed = cluster3.cli("run", PROMPT, "-n", "16")
    as_json = json.loads(cluster3.cli("run", PROMPT, "-n", "16", "--json").stdout)
    assert streamed.stdout == as_json["text"] + "\n"
    assert "16 tokens" in streamed.stderr


def test_second_up_changes_nothing(cluster3: Cluster) -> None:
    before = {node: cluster3.worker_pid(node) for node in ("n0", "n1", "n2")}
    controller = cluster3.controller_pid()
    started = time.monotonic()
    result = cluster3.cli("up")
    elapsed = time.monotonic() - started
    assert "already up" in result.stderr
    assert {node: cluster3.worker_pid(node) for node in before} == before
    assert cluster3.controller_pid() == controller
    print(f"second up: {elapsed:.2f}s")


def test_killed_worker_mid_generation_resumes_with_identical_text(cluster3: Cluster) -> None:
    expected = json.loads(cluster3.cli("run", PROMPT, "-n", "480", "--json").stdout)["text"]
    victim = cluster3.worker_pid("n1")
    result, text, _ = run_with_fault(cluster3, PROMPT, "480",
                                     lambda: subprocess.run(["kill", "-9", str(victim)], check=True))
    assert result.returncode == 0, result.stderr
    assert text == expected + "\n"
    assert result.stderr.count("recovering:") == 1 and "1 recovery" in result.stderr
    node = next(node for node in cluster3.status()["nodes"] if node["name"] == "n1")
    assert node["restarts"] == 1 and "SIGKILL" in node["last_status"]
    assert node["state"] == "ready" and cluster3.worker_pid("n1") != victim


def test_interrupted_run_is_cancelled_and_frees_the_cluster(cluster3: Cluster) -> None:
    served = cluster3.status()["requests_served"]
    run = cluster3.popen("run", PROMPT, "-n", "480")
    assert run.stdout is not None
    run.stdout.read(20)
    run.send_signal(signal.SIGINT)  # Ctrl-C
    run.communicate(timeout=30)
    assert run.returncode == 130
    assert cluster3.cli("run", PROMPT, "-n", "4").returncode == 0
    status = cluster3.status()
    assert status["requests_served"] == served + 1  # the interrupted request did not run to its end
    # The whole log, not status's last 50 events: a busy module-wide cluster may have pushed it out.
    events = [json.loads(line) for line in (cluster3.state / "events.jsonl").read_text().splitlines()]
    assert any(event["kind"] == "cancelled" for event in events), events[-20:]


def test_a_cancelled_run_leaves_the_next_run_its_whole_text(cluster3: Cluster) -> None:
    """Ctrl-C cancels only its own request: the next one streams its whole greedy text."""
    model = json.loads((cluster3.state / "launch.json").read_text())["model"]
    expected = single_process(model, "The capital of France is", 20)
    for _ in range(2):  # the second time, after the earlier request's cancel as well
        run = cluster3.popen("run", PROMPT, "-n", "300")
        assert run.stdout is not None
        run.stdout.read(20)
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=30)
        assert run.returncode == 130
        result = json.loads(cluster3.cli("run", "The capital of France is", "-n", "20", "--json").stdout)
        assert (result["text"], result["completion_tokens"]) == (expected["text"], 20)


def test_killed_controller_is_replaced_and_workers_adopted(cluster3: Cluster) -> None:
    workers = {node: cluster3.worker_pid(node) for node in ("n0", "n1", "n2")}
    controller = cluster3.controller_pid()
    subprocess.run(["kill", "-9", str(controller)], check=True)
    deadline = time.monotonic() + 10
    while alive(controller) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "adopted the workers" in cluster3.cli("up").stderr
    assert {node: cluster3.worker_pid(node) for node in workers} == workers
    assert cluster3.controller_pid() != controller
    events = [event["message"] for event in cluster3.status()["events"]]
    assert sum("adopted" in message for message in events) == 3


def test_down_keep_workers_leaves_them_for_the_next_up(cluster3: Cluster) -> None:
    workers = {node: cluster3.worker_pid(node) for node in ("n0", "n1", "n2")}
    expected = json.loads(cluster3.cli("run", PROMPT, "-n", "8", "--json").stdout)["text"]
    result = cluster3.cli("down", "--keep-workers")
    assert "workers are still running" in result.stderr
    assert not (cluster3.state / "controller.pid").exists()
    assert all(alive(pid) for pid in workers.values()) and all(listening(port) for port in cluster3.ports)
    assert "adopted the workers" in cluster3.cli("up").stderr
    assert {node: cluster3.worker_pid(node) for node in workers} == workers
    assert {node["name"]: node["pid"] for node in cluster3.status()["nodes"]} == workers  # adopted, still shown
    assert json.loads(cluster3.cli("run", PROMPT, "-n", "8", "--json").stdout)["text"] == expected


def test_reload_takes_every_weight_over_1_mib_from_the_workers_cache(short_tmp) -> None:
    """The coordinator's RPC client is built to offer the workers' cache every weight over 1 MiB (stock
    llama.cpp: over 10 MiB, which leaves most models' attention matrices out, here all of them): the first
    load saves each one on its worker, and a reload after a coordinator crash sends none of them again."""
    from gguf import GGUFReader

    from core.model import write_demo_model

    model = write_demo_model(short_tmp / "wide.gguf", n_layers=2, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4)
    # Every weight over 1 MiB but the token embeddings, which llama.cpp keeps on the coordinator.
    weights = sorted(int(tensor.n_bytes) for tensor in GGUFReader(str(model)).tensors
                     if tensor.name != "token_embd.weight" and tensor.n_bytes > 1024 * 1024)
    assert 2 * 1024 * 1024 in weights and max(weights) < 10 * 1024 * 1024  # none that stock llama.cpp caches
    (short_tmp / "c").mkdir()
    cluster = Cluster(short_tmp / "c", nodes=2, top=[f"model: {model}"])
    cache = cluster.state / "tensor-cache" / "rpc"
    try:
        cluster.cli("up")
        assert sorted(path.stat().st_size for path in cache.iterdir()) == weights
        saved = {path.name: path.stat().st_mtime_ns for path in cache.iterdir()}
        logs = [cluster.worker_dir(node) / "worker.log" for node in ("n0", "n1")]
        writes = sum(log.read_text().count("saved to") for log in logs)
        assert writes == len(weights)
        status = cluster.status()
        os.kill(status["coordinator"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while sum(event["kind"] == "coordinator-ready" for event in cluster.status()["events"]) < 2:
            assert time.monotonic() < deadline, "the coordinator did not come back"
            time.sleep(0.2)
        assert sum(log.read_text().count("saved to") for log in logs) == writes
        assert {path.name: path.stat().st_mtime_ns for path in cache.iterdir()} == saved
    finally:
        cluster.cli("down", check=False)


def test_down_leaves_no_process_behind(short_tmp) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    try:
        # every node's processes are counted: a node left out (its port taken by another run, once) must say why
        cluster.cli("up", "--require-all")
        status = cluster.status()
        expected = {status["controller_pid"], status["coordinator"]["pid"]}
        expected |= {pid for node in ("n0", "n1") for pid in (cluster.worker_pid(node), cluster.supervisor_pid(node))}
        assert expected <= set(cluster.processes())
        assert all(listening(port) for port in cluster.ports)
        # The controller stops its own workers, so `down` needs none of the code that reaches nodes itself.
        assert cluster.heavy_loaded("down") == []
        deadline = time.monotonic() + 5
        while cluster.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.processes() == []
        assert not any(listening(port) for port in cluster.ports)
        assert not (cluster.state / "control.sock").exists()
        assert "not running" in cluster.cli("down").stderr
    finally:
        cluster.cli("down", check=False)


def test_down_after_controller_was_killed_still_stops_workers(short_tmp) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    try:
        cluster.cli("up")
        subprocess.run(["kill", "-9", str(cluster.controller_pid())], check=True)
        result = cluster.cli("down")
        assert "leftover workers" in result.stderr
        deadline = time.monotonic() + 5
        while cluster.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.processes() == []
    finally:
        cluster.cli("down", check=False)


def test_commands_on_a_cluster_that_is_not_up_fail_clearly(short_tmp) -> None:
    cluster = Cluster(short_tmp, nodes=1)
    for command in (["status", "--once"], ["run", "hi"], ["plan"]):
        result = cluster.cli(*command, check=False)
        assert result.returncode == 1
        assert result.stderr.strip().count("\n") == 0
        assert "not running" in result.stderr and "ggml-cluster up" in result.stderr


def test_port_taken_by_another_process_leaves_that_node_out_and_says_so(short_tmp) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    squatter = socket.create_server(("127.0.0.1", cluster.ports[1]))
    message = f"n1: node n1: port {cluster.ports[1]} on localhost is already in use by another process"
    try:
        result = cluster.cli("up")
        assert "running on 1 of 2 nodes" in result.stderr and message in result.stderr
        nodes = cluster.status()["nodes"]
        assert (nodes[0]["state"], nodes[0]["layers"]) == ("ready", [0, 7])
        assert nodes[1]["failures"] >= 1 and nodes[1]["layers"] is None  # left out, and tried again now and then
        assert nodes[1]["state"] in ("failed", "starting") and "already in use" in nodes[1]["last_error"]
        assert cluster.cli("run", "Hi", "-n", "8").returncode == 0
        cluster.cli("down")
        strict = cluster.cli("up", "--require-all", check=False)
        assert strict.returncode == 1
        assert "1 of 2 nodes failed" in strict.stderr and message in strict.stderr
        assert "the cluster was stopped" in strict.stderr
        assert cluster.processes() == []
    finally:
        squatter.close()
        cluster.cli("down", check=False)


def test_worker_with_another_protocol_version_is_refused_by_name(short_tmp) -> None:
    old = FIXTURES / "rpc_server_v6.py"
    cluster = Cluster(short_tmp, nodes=2, extra={1: [f"build: {{path: {old}}}"]})
    try:
        result = cluster.cli("up", "--require-all", check=False)
        assert result.returncode == 1
        assert "n1: worker speaks RPC protocol 6.1.0, the coordinator speaks 7.0.0" in result.stderr
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []


def test_embedded_default_runs_without_an_inventory(short_tmp) -> None:
    env = {**os.environ, "GGML_CLUSTER_STATE_DIR": str(short_tmp / "state")}
    env.pop("GGML_CLUSTER_INVENTORY", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([CLI, *args], capture_output=True, text=True, env=env, cwd=short_tmp, timeout=600,
                                check=False)
        assert result.returncode == 0, result.stderr
        return result

    try:
        up = cli("up")
        assert "ready: 2 worker(s)" in up.stderr, up.stderr
        status = json.loads(cli("status", "--json").stdout)
        assert status["cluster"] == "demo"
        assert [node["state"] for node in status["nodes"]] == ["ready", "ready"]
        # Placed by measured speed: which worker gets what depends on this machine, not the layer count;
        # but neither demo worker's memory holds the whole model, so both hold layers.
        assert status["strategy"] == "compute (latency)"
        assert all(node["layers"] for node in status["nodes"]), status["nodes"]
        held = sorted(layer for node in status["nodes"] if node["layers"]
                      for layer in range(node["layers"][0], node["layers"][1] + 1))
        assert held == list(range(8))
        assert "layers on 2 of 2 worker(s)" in up.stderr
        assert len(cli("run", "Hello", "-n", "12").stdout.split()) >= 6
    finally:
        subprocess.run([CLI, "down"], env=env, cwd=short_tmp, capture_output=True, timeout=120, check=False)


def test_a_relative_and_an_absolute_inventory_path_are_one_cluster(short_tmp) -> None:
    """`-i inventory.yaml` from its folder and `-i /abs/inventory.yaml` name one file: the second `up` changes
    nothing; and the controller resolves the inventory's relative paths against its folder, not its own cwd."""
    cluster = Cluster(short_tmp, nodes=2, extra={0: ["workdir: n0 work"]})
    try:
        relative = subprocess.run([CLI, "up", "-i", cluster.inventory.name], cwd=short_tmp, env=cluster.env(),
                                  capture_output=True, text=True, timeout=600, check=False)
        assert relative.returncode == 0, relative.stderr
        pids = [pid_in(short_tmp / "n0 work" / "worker.pid"), cluster.worker_pid("n1")]
        again = cluster.cli("up")  # the harness passes the absolute path
        assert "already up" in again.stderr
        assert [pid_in(short_tmp / "n0 work" / "worker.pid"), cluster.worker_pid("n1")] == pids
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []


def test_two_ups_at_once_start_one_cluster(short_tmp) -> None:
    cluster = Cluster(short_tmp, nodes=2)
    try:
        first, second = cluster.popen("up"), cluster.popen("up")
        results = [(process.wait(timeout=300), process.communicate()[1]) for process in (first, second)]
        assert [code for code, _ in results] == [0, 0]
        assert sum("already up" in stderr for _, stderr in results) == 1
        controllers = [pid for pid in cluster.processes()
                       if "core.controller" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(controllers) == 1
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []
