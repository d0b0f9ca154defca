"""Logits stay where they are computed: tokens are sampled on the node that holds the output layer (llama.cpp's
backend sampling through RPC), only the sampled token crosses the network, and the text is the one the coordinator
would have sampled from the logits, greedy and seeded, also after a kill -9 of that node's worker mid-request."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.model import demo_model, read_model
from core.nodes.build import cache_dir
from tests.harness import Cluster, api_client, output_node, run_with_fault

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "The cluster said"
TOKENS = 48
SEEDED = {"temperature": 0.9, "seed": 42, "top_p": 0.95, "extra_body": {"top_k": 40, "min_p": 0.02}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Two slots: node-sampled and coordinator-sampled sequences also share decode steps.
    demo = Cluster(Path(tempfile.mkdtemp(prefix="gcs-", dir="/tmp")), nodes=2, api="{port: 0, parallel: 2}")
    demo.cli("up")
    yield demo
    demo.cli("down", check=False)


def output_node_bytes(cluster: Cluster) -> int:
    """Bytes the worker with the last layers (the output layer) has sent the coordinator so far."""
    return int(output_node(cluster.status())["bytes_from"])


def complete(cluster: Cluster, **fields: object) -> tuple[str, int, int]:
    """A completion's text, its tokens, and the bytes the output node sent for it."""
    before = output_node_bytes(cluster)
    choice = api_client(cluster).completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS, **fields)  # type: ignore[call-overload]
    assert choice.usage is not None
    return choice.choices[0].text, choice.usage.completion_tokens, output_node_bytes(cluster) - before


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_sampled_on_the_node_the_text_is_the_coordinators_and_the_logits_stay_there(cluster: Cluster,
                                                                                   sampling: dict) -> None:
    n_vocab = read_model(demo_model(cache_dir())).n_vocab
    counted = cluster.status()["requests_sampled_on_coordinator"]
    on_node, tokens, sent = complete(cluster, **sampling)
    # logprobs need the whole vocabulary's logits: that request is sampled on the coordinator, from the same draws
    here, here_tokens, here_sent = complete(cluster, logprobs=1, **sampling)
    assert on_node == here and tokens == here_tokens == TOKENS
    assert cluster.status()["requests_sampled_on_coordinator"] == counted + 1
    assert here_sent / tokens >= n_vocab * 4  # every logit of every token
    assert sent / tokens < n_vocab  # a token, its candidates and the replies' headers: not a quarter of the logits


def test_a_json_schema_or_penalties_are_sampled_on_the_coordinator_and_counted(cluster: Cluster) -> None:
    counted = cluster.status()["requests_sampled_on_coordinator"]
    api = api_client(cluster)
    api.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0,
                           extra_body={"response_format": {"type": "json_object"}})
    penalised = api.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=0.5)
    assert penalised.choices[0].text
    assert cluster.status()["requests_sampled_on_coordinator"] == counted + 2


def test_a_seeded_request_resumes_exactly_after_the_output_nodes_worker_is_killed(cluster: Cluster) -> None:
    args = ["--temperature", str(SEEDED["temperature"]), "--seed", str(SEEDED["seed"])]
    clean = cluster.cli("run", PROMPT, "-n", "160", *args).stdout
    output = output_node(cluster.status())
    victim = cluster.worker_pid(output["name"])
    result, text, _ = run_with_fault(cluster, PROMPT, "160", lambda: os.kill(victim, signal.SIGKILL), *args)
    assert result.returncode == 0, result.stderr
    assert text == clean
    assert cluster.worker_pid(output["name"]) != victim
