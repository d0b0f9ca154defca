"""Several users at once: requests decoded together in the coordinator's slots (api.parallel), through the official
`openai` client, also while a worker is killed under them."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Cluster, api_client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPTS = [f"The cluster number {index} says" for index in range(4)]
TOKENS = 32


@pytest.fixture(scope="module")
def cluster4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import tempfile

    # api.parallel left to its default, auto: the demo model's plan fits the KV cache of four slots here.
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="gcp-", dir="/tmp")), nodes=2)
    cluster.up_output = cluster.cli("up").stderr
    yield cluster
    cluster.cli("down", check=False)


@pytest.fixture(scope="module")
def alone(cluster4: Cluster) -> list[str]:
    """Each prompt's greedy text, run alone."""
    api = api_client(cluster4)
    return [api.completions.create(model="any", prompt=prompt, max_tokens=TOKENS, temperature=0).choices[0].text
            for prompt in PROMPTS]


class Streams:
    """The four prompts streamed at once: each one's pieces and why it ended."""

    def __init__(self, cluster: Cluster) -> None:
        self.api = api_client(cluster)
        self.pieces: list[list[str]] = [[] for _ in PROMPTS]
        self.reasons: list[str | None] = [None] * len(PROMPTS)
        self.started = threading.Barrier(len(PROMPTS))

    def one(self, index: int) -> None:
        self.started.wait()
        stream = self.api.completions.create(model="any", prompt=PROMPTS[index], max_tokens=TOKENS, temperature=0,
                                             stream=True)
        for chunk in stream:
            if chunk.choices[0].text:
                self.pieces[index].append(chunk.choices[0].text)
            self.reasons[index] = chunk.choices[0].finish_reason or self.reasons[index]

    def run(self, during: object = None) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(self.one, index) for index in range(len(PROMPTS))]
            if callable(during):
                during()
            for future in futures:
                future.result(timeout=300)

    def texts(self) -> list[str]:
        return ["".join(pieces) for pieces in self.pieces]


def test_a_default_inventory_comes_up_with_four_slots_chosen_automatically(cluster4: Cluster) -> None:
    status = cluster4.status()
    assert status["slots"] == 4
    assert any(event["kind"] == "plan" and "; 4 slots (auto)" in event["message"] for event in status["events"])
    assert ", 4 slots (auto); `ggml-cluster plan` says why" in cluster4.up_output
    assert json.loads((cluster4.state / "plan.json").read_text())["slots"] == 4


def test_four_streams_at_once_are_decoded_together_and_each_gets_its_own_text(cluster4: Cluster,
                                                                                 alone: list[str]) -> None:
    before = cluster4.status()
    streams = Streams(cluster4)
    streams.run()
    assert streams.texts() == alone  # greedy, as run alone (measured equal on this backend; see README)
    assert streams.reasons == ["length"] * len(PROMPTS)
    # Together, not one after another, by the coordinator's own record (a client's clock under load is not one):
    # most tokens came out of a decode step that carried another stream's too; one after another, none would.
    after = cluster4.status()
    generated = after["completion_tokens"] - before["completion_tokens"]
    batched = after["completion_tokens_batched"] - before["completion_tokens_batched"]
    assert generated == len(PROMPTS) * TOKENS and batched > generated // 2


def test_a_worker_killed_while_four_streams_run_loses_and_repeats_no_token_in_any(cluster4: Cluster,
                                                                                   alone: list[str]) -> None:
    streams = Streams(cluster4)
    victim = cluster4.worker_pid("n1")

    def kill_once_tokens_flow() -> None:
        deadline = time.monotonic() + 120
        while sum(len(pieces) for pieces in streams.pieces) < 2 * len(PROMPTS):
            assert time.monotonic() < deadline, "no tokens"
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)

    streams.run(kill_once_tokens_flow)
    assert streams.texts() == alone
    status = cluster4.status()
    assert status["recoveries"] >= len(PROMPTS) and cluster4.worker_pid("n1") != victim


def test_n_choices_are_generated_together_in_slots_of_their_own(cluster4: Cluster, alone: list[str]) -> None:
    api = api_client(cluster4)
    shared_before = cluster4.status()["prompt_tokens_shared"]
    greedy = api.completions.create(model="any", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, n=4)
    # The prompt is evaluated once: the other three choices start from a copy of its KV cells (all but its last
    # token, which each evaluates for its logits), and still say what the prompt alone says.
    assert [choice.text for choice in greedy.choices] == [alone[0]] * 4
    assert greedy.usage is not None and greedy.usage.completion_tokens == 4 * TOKENS
    assert cluster4.status()["prompt_tokens_shared"] - shared_before == 3 * (greedy.usage.prompt_tokens - 1)
    sampled = api.completions.create(model="any", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=1.0, seed=7, n=3)
    again = api.completions.create(model="any", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=1.0, seed=7, n=3)
    texts = [choice.text for choice in sampled.choices]
    assert texts == [choice.text for choice in again.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # each choice its own draws (seed + index)


def test_a_client_that_disconnects_frees_its_slot_and_the_others_finish_whole(cluster4: Cluster,
                                                                               alone: list[str]) -> None:
    endpoint = cluster4.status()["api_endpoint"]
    streams = Streams(cluster4)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        others = [pool.submit(streams.one, index) for index in range(1, len(PROMPTS))]
        streams.started.wait()  # the fourth party of the barrier: the client that leaves
        body = {"model": "any", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
        request = urllib.request.Request(f"http://{endpoint}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            for _ in range(3):
                response.readline()  # a few chunks, then gone mid-stream
        for future in others:
            future.result(timeout=300)
    assert streams.texts()[1:] == alone[1:]
    deadline = time.monotonic() + 30
    while cluster4.status()["slots_busy"]:  # the slot came free: the coordinator dropped the request
        assert time.monotonic() < deadline, "the slot stayed busy"
        time.sleep(0.1)
    again = api_client(cluster4).completions.create(model="any", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert again.choices[0].text == alone[0]


def test_a_request_that_begins_as_one_in_flight_copies_that_part_and_says_what_it_says_alone(
        cluster4: Cluster) -> None:
    api = api_client(cluster4)
    system = "You are the cluster's helpful assistant, and you answer in one short line. " * 3
    first, second = system + "Who are you?", system + "What is a node?"
    lengths = (400, TOKENS)  # the first runs long enough to be in flight when the second comes
    alone = [api.completions.create(model="any", prompt=prompt, max_tokens=length, temperature=0).choices[0].text
             for prompt, length in zip((first, second), lengths, strict=True)]
    shared_before = cluster4.status()["prompt_tokens_shared"]
    stream = api.completions.create(model="any", prompt=first, max_tokens=lengths[0], temperature=0, stream=True)
    pieces = [next(iter(stream)).choices[0].text]  # its prompt is in its KV cells now
    answer = api.completions.create(model="any", prompt=second, max_tokens=TOKENS, temperature=0)
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert ["".join(pieces), answer.choices[0].text] == alone
    assert answer.model_extra is not None and answer.model_extra["timings"]["cache_n"] >= 32
    shared = cluster4.status()["prompt_tokens_shared"] - shared_before
    assert shared == answer.model_extra["timings"]["cache_n"]
    assert answer.usage is not None and answer.model_extra["timings"]["prompt_n"] == (
        answer.usage.prompt_tokens - shared)


def test_a_worker_killed_while_n_choices_stream_from_one_copied_prompt_loses_no_token(
        cluster4: Cluster, alone: list[str]) -> None:
    victim, recoveries = cluster4.worker_pid("n0"), cluster4.status()["recoveries"]
    stream = api_client(cluster4).completions.create(model="any", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                                 n=4, stream=True)
    pieces: list[list[str]] = [[] for _ in range(4)]
    for chunk in stream:
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
        # At every choice's first token: the prompt's cells were copied, and with 32 tokens to go each choice is
        # still running when the kill lands (at 8 tokens in all a fast step could finish them all first).
        if victim is not None and all(pieces):
            os.kill(victim, signal.SIGKILL)  # every choice resumes from its own cells
            victim = None
    assert victim is None and ["".join(each) for each in pieces] == [alone[0]] * 4
    assert cluster4.status()["recoveries"] - recoveries >= 4  # each choice is a request of its own, resumed
