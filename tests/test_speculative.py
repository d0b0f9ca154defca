"""Speculative decoding on a real cluster: drafts from each request's own tokens are verified in the decode step,
the text is the one decoded a token per step (greedy and seeded, sampled on the node and on the coordinator, with
stop strings and logprobs), a request can turn it off (llama-server's speculative.n_max: 0), `status` and
/metrics count drafted and kept tokens, and a kill -9 mid-request resumes exactly."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import pytest

from tests.harness import Cluster, api_client, metrics_text, output_node, run_with_fault, running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "one two three four five six seven one two three four five six seven one two three"
TOKENS = 48
OFF = {"speculative.n_max": 0}
SEEDED = {"temperature": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster("gcspec-", 2, api="{port: 0, parallel: 2}")


def complete(cluster: Cluster, extra: dict[str, object] | None = None, **fields: object) -> str:
    choice = api_client(cluster).completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS, extra_body=extra,  # type: ignore[call-overload]
                                    **fields)
    return str(choice.choices[0].text)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED, {"temperature": 0, "logprobs": 2},
                                      {"temperature": 0, "stop": ["seven"]}],
                         ids=["greedy", "seeded", "logprobs", "stop"])
def test_drafts_verified_in_the_step_give_the_text_of_one_token_per_step(cluster: Cluster, sampling: dict) -> None:
    before = cluster.status()
    fast = complete(cluster, **sampling)
    after = cluster.status()
    assert fast == complete(cluster, OFF, **sampling)
    assert after["tokens_drafted"] > before["tokens_drafted"]
    if not sampling["temperature"]:  # at 0.9 the tiny random model seldom repeats itself: drafts, few kept
        assert after["tokens_accepted"] > before["tokens_accepted"]
    assert cluster.status()["tokens_drafted"] == after["tokens_drafted"]  # speculative.n_max 0: none drafted


def test_the_counts_are_on_metrics(cluster: Cluster) -> None:
    complete(cluster, temperature=0)
    status = cluster.status()
    text = metrics_text(status)
    for name in ("tokens_drafted", "tokens_accepted"):
        assert re.search(rf"^ggml_cluster_{name}_total{{[^}}]*}} {status[name]}\.0$", text, re.MULTILINE), name


def test_a_kill_mid_request_resumes_exactly_with_drafts_in_flight(cluster: Cluster) -> None:
    clean = cluster.cli("run", PROMPT, "-n", "160").stdout
    output = output_node(cluster.status())
    victim = cluster.worker_pid(output["name"])
    result, text, _ = run_with_fault(cluster, PROMPT, "160", lambda: os.kill(victim, signal.SIGKILL))
    assert result.returncode == 0, result.stderr
    assert text == clean
    assert cluster.worker_pid(output["name"]) != victim


@pytest.mark.parametrize("logprobs", [None, 2], ids=["tokens", "logprobs"])
def test_sampled_on_the_node_a_steps_tokens_come_back_in_one_read(cluster: Cluster, logprobs: int | None) -> None:
    # patches/0005: the tokens of every output (the next token and each draft) are gathered on the node and read
    # once per step; read one by one, drafts would add a round trip each and win little over a network. With
    # logprobs (patches/0006), each output's report rides the same read.
    def reads() -> tuple[int, int, int]:
        status = cluster.status()
        output = output_node(status)
        return output["session"]["counts"].get("GET_TENSOR", 0), status["tokens_accepted"], status["tokens_drafted"]

    api_client(cluster).completions.create(model="any", prompt=PROMPT, max_tokens=1)  # the connection warm
    before, kept_before, drafted_before = reads()
    choice = api_client(cluster).completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                                    logprobs=logprobs)
    after, kept_after, drafted_after = reads()
    assert choice.usage is not None and choice.usage.completion_tokens == TOKENS
    assert (choice.choices[0].logprobs is None) == (logprobs is None)
    kept, drafted = kept_after - kept_before, drafted_after - drafted_before
    assert kept >= 1 and drafted >= 4  # read one by one, the drafts alone would be that many more reads
    # a step emits its kept drafts and the model's own token; plus the prompt's step (and one at the end)
    assert after - before <= TOKENS - kept + 2, (after - before, kept, drafted)
