"""A Vulkan node for real: the pinned llama.cpp's Vulkan worker on Mesa's software Vulkan (lavapipe), beside a CPU
node, on the demo model; and a Vulkan worker whose loader finds no device, named in one line and never started.

Needs glslc, spirv-headers, libvulkan-dev and mesa-vulkan-drivers (bookworm-backports' Mesa: bookworm's 22.3.6
lavapipe crashes mid-compute in 20-50 % of runs). The first compute compiles lavapipe's pipelines: 4 minutes on 2
busy cores with Mesa's shader cache empty, seconds with it warm; the test keeps that cache (2 MB) in ggml-cluster's
own cache folder, which CI keeps per machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from core.model import demo_model
from core.nodes.build import cache_dir
from tests.harness import Cluster, api_client, needs
from tests.test_cluster import single_process
from tests.test_hardening import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = "Hello"
MESA_CACHE = cache_dir() / "mesa-shader-cache"
TOKENS = 16


def lavapipe() -> str | None:
    """Why this machine cannot build or run a Vulkan worker on lavapipe, or None when it can."""
    if shutil.which("glslc") is None or not Path("/usr/include/vulkan/vulkan.h").exists():
        return "no Vulkan build tools (glslc, libvulkan-dev, spirv-headers)"
    try:
        summary = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True, timeout=60,
                                 check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"vulkaninfo did not run: {exc}"
    return None if "PHYSICAL_DEVICE_TYPE_CPU" in summary else "vulkaninfo lists no software Vulkan device (lavapipe)"


@pytest.fixture(scope="module", autouse=True)
def needs_lavapipe() -> None:
    needs(lavapipe())


def test_a_vulkan_node_on_lavapipe_serves_and_one_without_a_device_is_named_once(short_tmp: Path) -> None:
    cluster = Cluster(short_tmp, nodes=3, strategy="equal", extra={
        # DESIGN §8: with f16 paths off, lavapipe's text equals the CPU's on the demo model.
        1: ["backend: vulkan", f"env: {{GGML_VK_DISABLE_F16: '1', MESA_SHADER_CACHE_DIR: {MESA_CACHE}}}"],
        2: ["backend: vulkan", "env: {VK_ICD_FILENAMES: /nonexistent.json}"],
    })
    device = "llvmpipe (LLVM"
    missing = ("node n2: the vulkan worker has no Vulkan device (it lists CPU): ERROR: loader_get_json: Failed to "
               "open JSON file /nonexistent.json")
    check = cluster.cli("check", "--json", check=False)
    assert check.returncode == 1
    rows = {row["name"]: row for row in json.loads(check.stdout)}
    assert rows["n1"]["backend"] == "vulkan" and rows["n1"]["problem"] == ""
    assert rows["n1"]["device"].startswith(device) and rows["n1"]["device"].endswith("(software Vulkan)")
    assert rows["n2"]["problem"].startswith(missing)
    try:
        up = cluster.cli("up")
        assert f"left out: n2: {missing}" in up.stderr
        n0, n1, n2 = cluster.status()["nodes"]
        assert (n0["backend"], n0["device"]) == ("cpu", "")
        assert (n1["state"], n1["backend"]) == ("ready", "vulkan") and n1["layers"] is not None
        assert n1["device"].startswith(device) and n1["device"].endswith("(software Vulkan)")
        assert "GGML_VK_VISIBLE_DEVICES=0" in (cluster.worker_dir("n1") / "command").read_text()
        assert "software Vulkan" in cluster.cli("status", "--once").stdout

        run = json.loads(cluster.cli("run", PROMPT, "-n", str(TOKENS), "--json").stdout)
        reference = single_process(str(demo_model(cache_dir())), PROMPT, TOKENS)
        assert (run["text"], run["completion_tokens"]) == (reference["text"], TOKENS)
        # The output layer is on the Vulkan node: its sampler, with the logprobs report (patches/0006) and the
        # penalties of a step's drafts (patches/0007), runs there; none falls back to the coordinator.
        counted = cluster.status()["requests_sampled_on_coordinator"]
        api = api_client(cluster)
        chances = api.completions.create(model="any", prompt=PROMPT, max_tokens=4, temperature=0,
                                         logprobs=2).choices[0]
        assert chances.text == run["text"][:len(chances.text)] and chances.logprobs is not None
        for token, logprob, top in zip(chances.logprobs.tokens, chances.logprobs.token_logprobs,
                                       chances.logprobs.top_logprobs, strict=True):
            assert len(top) == 2 and next(iter(top)) == token  # greedy: the likeliest, first
            assert top[token] == pytest.approx(logprob) and logprob <= 0.0
        penalised = api.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0,
                                           presence_penalty=1.0, frequency_penalty=1.0)
        assert penalised.usage is not None and penalised.usage.completion_tokens == 8
        assert cluster.status()["requests_sampled_on_coordinator"] == counted

        # Failed once, held for the next `up`: never retried on a timer, and no worker was ever started there.
        n2 = cluster.status()["nodes"][2]
        assert (n2["state"], n2["failures"], n2["retry_at"]) == ("failed", 1, None)
        assert n2["last_error"].startswith(missing)
        assert not (cluster.state / "nodes" / "n2" / "worker.log").exists()
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)
