"""The seed's cluster in miniature: one x86 CPU worker (here), one aarch64 worker (an arm64 root under qemu-user,
reached over SSH, its worker cross-built for its CPU) and one Vulkan worker (Mesa's lavapipe), on the demo model.

Correct output here is what llama.cpp's own client gives over the same workers with the same split, not a
one-process x86 run: the aarch64 and Vulkan kernels round differently from x86's, and on a toy model with random
weights that can change a near-tied greedy choice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.emulated import require_emulation
from tests.harness import Cluster, run_with_fault
from tests.sshd import NEEDS_SSHD, SshWorld, running_world
from tests.test_hardening import gone
from tests.test_vulkan import MESA_CACHE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900), NEEDS_SSHD]

PROMPT = "Once upon a time, the cluster"
TOKENS = 24
ARM_CPU = "cortex-a76"  # a Raspberry Pi 5: its worker is cross-built with -march=armv8.2-a+dotprod+fp16
X86, ARM, VULKAN = "n0", "n1", "n2"

# llama.cpp's own client (llama-cpp-python, stock RPC registration) over the given workers with the given layer
# counts: the coordinator's load settings (flash attention on, one sequence of `context` cells), greedy.
REFERENCE = """
import ctypes, json, sys
from pathlib import Path
import llama_cpp
lib = Path(llama_cpp.__file__).parent / "lib"
ggml = ctypes.CDLL(str(lib / "libggml.so.0"), mode=ctypes.RTLD_GLOBAL)
rpc = ctypes.CDLL(str(lib / "libggml-rpc.so.0"), mode=ctypes.RTLD_GLOBAL)
rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
model, context, prompt, tokens, split = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
endpoints = sys.argv[6:]
for endpoint in endpoints:
    ggml.ggml_backend_register(rpc.ggml_backend_rpc_add_server(endpoint.encode()))
llm = llama_cpp.Llama(model_path=model, n_gpu_layers=-1, tensor_split=json.loads(split), n_ctx=context, n_threads=1,
                      flash_attn=True, verbose=False)
print(json.dumps(llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)["choices"][0]["text"]))
"""


@pytest.fixture(scope="module")
def world() -> Iterator[SshWorld]:
    require_emulation()
    yield from running_world("gcm-", 0)


@pytest.fixture(scope="module")
def cluster(world: SshWorld) -> Iterator[Cluster]:
    """The three nodes under `strategy: equal`, so that each holds layers; one slot, as the reference has."""
    server = world.emulated_server(Path(tempfile.mkdtemp(prefix="pi5-", dir=world.root)), ARM_CPU)
    root = Path(tempfile.mkdtemp(prefix="gcm-", dir="/tmp"))
    arm = ["host: 127.0.0.1", f"port: {server.port}", "user: root", f"identity: {world.identity}"]
    vulkan = ["kind: local", "backend: vulkan", f"env: {{MESA_SHADER_CACHE_DIR: {MESA_CACHE}}}"]
    cluster = Cluster(root, nodes=3, ssh=[["kind: local", "backend: cpu"], arm, vulkan], base_env=world.env(),
                      strategy="equal", api="{port: 0, parallel: 1}")
    try:
        cluster.cli("up")
        yield cluster
    finally:
        cluster.cli("down", check=False)
        assert gone(cluster)
        shutil.rmtree(root, ignore_errors=True)


def nodes(status: dict) -> dict[str, dict]:
    return {node["name"]: node for node in status["nodes"]}


def generate(cluster: Cluster) -> dict:
    return json.loads(cluster.cli("run", PROMPT, "-n", str(TOKENS), "--json").stdout)


def test_up_brings_an_x86_an_aarch64_and_a_vulkan_node_up_and_each_holds_layers(cluster: Cluster) -> None:
    status = cluster.status()
    found = nodes(status)
    assert all(node["state"] == "ready" and node["layers"] for node in found.values()), found
    assert (found[X86]["arch"], found[X86]["backend"]) == ("x86_64", "cpu")
    assert (found[ARM]["arch"], found[ARM]["backend"]) == ("aarch64", "cpu")
    assert (found[VULKAN]["arch"], found[VULKAN]["backend"]) == ("x86_64", "vulkan")
    assert status["strategy"] == "equal"
    once = cluster.cli("status", "--once").stdout
    assert "aarch64/cpu" in once and "x86_64/vulkan" in once and "x86_64/cpu" in once


def test_compute_planning_measured_the_slow_nodes_and_gives_them_few_or_no_layers(cluster: Cluster) -> None:
    cluster.cli("profile")  # `strategy: equal` needs no measurement: measure each node's speed for the model now
    measured = nodes(cluster.status())
    assert all(measured[name]["layer_ms"] is not None for name in (X86, ARM, VULKAN)), measured
    # Emulated arm64 and software Vulkan are measured slower per layer than this machine's own CPU.
    assert measured[ARM]["layer_ms"] > measured[X86]["layer_ms"]
    assert measured[VULKAN]["layer_ms"] > measured[X86]["layer_ms"]
    plan = json.loads(cluster.cli("plan", "--strategy", "compute", "--json").stdout)
    rows = {row["name"]: row for row in plan["rows"]}
    counts = {name: (row["layers"][1] - row["layers"][0] + 1) if row["layers"] else 0 for name, row in rows.items()}
    assert counts[X86] > counts[ARM] and counts[X86] > counts[VULKAN], rows
    print(f"\ncompute plan: {counts}; measured ms/layer: "
          f"{ {name: round(node['layer_ms'], 3) for name, node in measured.items()} }")


def test_greedy_text_survives_a_kill_of_the_aarch64_worker_mid_generation(cluster: Cluster) -> None:
    clean = generate(cluster)
    assert clean["completion_tokens"] == TOKENS and clean["text"]
    print(f"\nmixed cluster decode: {clean['timings'].get('decode_tokens_per_s', 0):.1f} tok/s")
    pid = nodes(cluster.status())[ARM]["pid"]
    assert pid, "the aarch64 worker's pid"
    result, text, seconds = run_with_fault(cluster, PROMPT, str(TOKENS), lambda: os.kill(pid, signal.SIGKILL))
    assert result.returncode == 0, result.stderr
    assert text == clean["text"] + "\n"
    status = cluster.status()
    assert status["recoveries"] >= 1 and nodes(status)[ARM]["restarts"] >= 1
    print(f"recovery from the aarch64 kill: {seconds:.1f}s from the kill to the end of the request")


def test_the_text_equals_llama_cpps_own_client_over_the_same_workers_and_split(cluster: Cluster) -> None:
    clean = generate(cluster)["text"]
    status = cluster.status()
    held = [node for node in status["nodes"] if node["layers"]]
    counts = [node["layers"][1] - node["layers"][0] + 1 for node in held]
    model = json.loads((cluster.state / "launch.json").read_text())["model"]
    cluster.cli("down", "--keep-workers")  # a worker serves one client at a time: ours goes, the workers stay
    try:
        reference = subprocess.run(
            [sys.executable, "-c", REFERENCE, model, "512", PROMPT, str(TOKENS), json.dumps(counts),
             *(f"127.0.0.1:{node['rpc_port']}" for node in held)],
            capture_output=True, text=True, timeout=300, check=False)
        assert reference.returncode == 0, reference.stderr[-3000:]
        assert json.loads(reference.stdout.strip().splitlines()[-1]) == clean
    finally:
        cluster.cli("up")
