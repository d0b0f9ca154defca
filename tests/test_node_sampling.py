"""Logits stay where they are computed: tokens are sampled on the node that holds the output layer (llama.cpp's
backend sampling through RPC), only the sampled token crosses the network (with its logprobs, when asked), and the
text and logprobs are the ones the coordinator would have taken from the logits, greedy and seeded, also after a
kill -9 of that node's worker mid-request."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.model import demo_model, read_model
from core.nodes.build import cache_dir
from tests.harness import Cluster, api_client, output_node, run_with_fault

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "The cluster said"
TOKENS = 48
SEEDED = {"temperature": 0.9, "seed": 42, "top_p": 0.95, "extra_body": {"top_k": 40, "min_p": 0.02}}
# penalties over a window of 8 that the ngram drafts' outputs of a step must count one by one (patches/0007)
PENALISED = {"temperature": 0, "presence_penalty": 0.8, "frequency_penalty": 0.4,
             "extra_body": {"repeat_penalty": 1.3, "repeat_last_n": 8}}
SEEDED_PENALISED = {**SEEDED, "frequency_penalty": 0.6, "extra_body": {**SEEDED["extra_body"], "repeat_penalty": 1.2}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Two slots: node-sampled and coordinator-sampled sequences also share decode steps.
    demo = Cluster(Path(tempfile.mkdtemp(prefix="gcs-", dir="/tmp")), nodes=2, api="{port: 0, parallel: 2}")
    demo.cli("up")
    yield demo
    demo.cli("down", check=False)


@pytest.fixture(scope="module")
def here() -> Iterator[Cluster]:
    """The same model on the same split, every request sampled on the coordinator from the whole vocabulary."""
    demo = Cluster(Path(tempfile.mkdtemp(prefix="gcc-", dir="/tmp")), nodes=2, top=["sampling: coordinator"])
    demo.cli("up")
    yield demo
    demo.cli("down", check=False)


def output_node_bytes(cluster: Cluster) -> int:
    """Bytes the worker with the last layers (the output layer) has sent the coordinator so far."""
    return int(output_node(cluster.status())["bytes_from"])


def complete(cluster: Cluster, **fields: object) -> tuple[Any, int, int]:
    """A completion's choice, its tokens, and the bytes the output node sent for it."""
    before = output_node_bytes(cluster)
    choice = api_client(cluster).completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS, **fields)  # type: ignore[call-overload]
    assert choice.usage is not None
    return choice.choices[0], choice.usage.completion_tokens, output_node_bytes(cluster) - before


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED, PENALISED, SEEDED_PENALISED],
                         ids=["greedy", "seeded", "greedy-penalised", "seeded-penalised"])
def test_sampled_on_the_node_the_text_is_the_coordinators_and_the_logits_stay_there(cluster: Cluster, here: Cluster,
                                                                                   sampling: dict) -> None:
    n_vocab = read_model(demo_model(cache_dir())).n_vocab
    counted = cluster.status()["requests_sampled_on_coordinator"]
    on_node, tokens, sent = complete(cluster, **sampling)
    coordinator, here_tokens, here_sent = complete(here, **sampling)  # from the same draws
    assert on_node.text == coordinator.text and tokens == here_tokens == TOKENS
    assert cluster.status()["requests_sampled_on_coordinator"] == counted
    assert here_sent / tokens >= n_vocab * 4  # every logit of every token
    assert sent / tokens < n_vocab  # a token, its candidates and the replies' headers: not a quarter of the logits


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_come_back_with_the_token_as_the_coordinator_takes_them_from_the_logits(
        cluster: Cluster, here: Cluster, sampling: dict) -> None:
    # patches/0006: the node reports the sampled token's probability and the likeliest 3 with the token, in the
    # step's one read; the coordinator's come from all n_vocab logits of the same split (float64 there, float32 here)
    n_vocab = read_model(demo_model(cache_dir())).n_vocab
    counted = cluster.status()["requests_sampled_on_coordinator"]
    on_node, tokens, sent = complete(cluster, logprobs=3, **sampling)
    coordinator, _, here_sent = complete(here, logprobs=3, **sampling)
    assert on_node.text == coordinator.text and tokens == TOKENS
    assert cluster.status()["requests_sampled_on_coordinator"] == counted
    ours, theirs = on_node.logprobs, coordinator.logprobs
    assert ours.tokens == theirs.tokens and ours.text_offset == theirs.text_offset
    assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-4)
    for mine, expected in zip(ours.top_logprobs, theirs.top_logprobs, strict=True):
        assert list(mine) == list(expected) and list(mine.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert here_sent / tokens >= n_vocab * 4
    assert sent / tokens < n_vocab  # the token and 7 floats of logprobs, not the vocabulary's logits


def test_a_json_schema_is_sampled_on_the_coordinator_and_counted(cluster: Cluster) -> None:
    counted = cluster.status()["requests_sampled_on_coordinator"]
    api = api_client(cluster)
    shaped = api.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert shaped.choices[0].text
    assert cluster.status()["requests_sampled_on_coordinator"] == counted + 1


def test_a_seeded_request_resumes_exactly_after_the_output_nodes_worker_is_killed(cluster: Cluster) -> None:
    args = ["--temperature", str(SEEDED["temperature"]), "--seed", str(SEEDED["seed"])]
    clean = cluster.cli("run", PROMPT, "-n", "160", *args).stdout
    output = output_node(cluster.status())
    victim = cluster.worker_pid(output["name"])
    result, text, _ = run_with_fault(cluster, PROMPT, "160", lambda: os.kill(victim, signal.SIGKILL), *args)
    assert result.returncode == 0, result.stderr
    assert text == clean
    assert cluster.worker_pid(output["name"]) != victim


@pytest.mark.parametrize("sampling", [PENALISED, SEEDED_PENALISED], ids=["greedy-penalised", "seeded-penalised"])
def test_a_penalised_request_resumes_exactly_after_the_output_nodes_worker_is_killed(cluster: Cluster,
                                                                                     sampling: dict) -> None:
    # The penalties' window is the accepted history the node's chain is given again after the restart, and the
    # drafts of the replayed steps count the tokens before them as they did (patches/0007): any slip changes the text.
    api = api_client(cluster)
    clean = api.completions.create(model="any", prompt=PROMPT, max_tokens=96, **sampling).choices[0].text
    output = output_node(cluster.status())
    victim = cluster.worker_pid(output["name"])
    status = cluster.status()
    recoveries, counted = status["recoveries"], status["requests_sampled_on_coordinator"]
    pieces: list[str] = []
    for chunk in api.completions.create(model="any", prompt=PROMPT, max_tokens=96, stream=True, **sampling):
        pieces.extend(choice.text for choice in chunk.choices)
        if victim is not None and len(pieces) >= 8:
            os.kill(victim, signal.SIGKILL)
            victim = None
    assert victim is None and "".join(pieces) == clean
    status = cluster.status()
    assert status["recoveries"] > recoveries
    assert status["requests_sampled_on_coordinator"] == counted
