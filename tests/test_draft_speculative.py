"""Speculative decoding with a draft model on the head (`speculative: {draft_model: PATH}`), on a real cluster: the
demo model as its own draft model (its drafts kept), a model with the demo's vocabulary and other weights (drafts
rejected), the same text as one token per step either way (greedy, seeded, logprobs, stop strings, two slots), the
counts on `status` and /metrics, a kill -9 mid-request resumed exactly, and a draft model with another vocabulary
refused by `up` before anything starts."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.model import demo_model, write_demo_model
from core.nodes.build import cache_dir
from tests.harness import Cluster, api_client, metrics_text, output_node, run_with_fault, running_cluster
from tests.test_draft_model import write_vocabulary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = "the river and the stone in the north"
TOKENS = 40
OFF = {"speculative.n_max": 0}
SEEDED = {"temperature": 0.9, "seed": 7}  # sampled on the node, with logprobs too


def drafting_with(path: Path) -> list[str]:
    # p_min 0: the random demo weights are never sure of a token, and the tests want every draft verified.
    return [f"speculative: {{draft_model: {path}, p_min: 0}}"]


@pytest.fixture(scope="module")
def itself() -> Iterator[Cluster]:
    """A cluster whose draft model is its model."""
    yield from running_cluster("gcdraft-", 2, api="{port: 0, parallel: 2}",
                               top=drafting_with(demo_model(cache_dir())))


@pytest.fixture(scope="module")
def other() -> Iterator[Cluster]:
    """A cluster whose draft model has the model's vocabulary and other weights (two layers, another seed)."""
    folder = Path(tempfile.mkdtemp(prefix="gcdraftm-", dir="/tmp"))
    draft = write_demo_model(folder / "other.gguf", n_layers=2, seed=99)
    yield from running_cluster("gcdrafto-", 2, top=drafting_with(draft))
    shutil.rmtree(folder, ignore_errors=True)


def complete(cluster: Cluster, extra: dict[str, object] | None = None, **fields: object) -> str:
    choice = api_client(cluster).completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS, extra_body=extra,  # type: ignore[call-overload]
                                                    **fields)
    return str(choice.choices[0].text)


def counts(cluster: Cluster) -> tuple[int, int]:
    status = cluster.status()
    return status["tokens_drafted"], status["tokens_accepted"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED, {**SEEDED, "logprobs": 1},
                                      {"temperature": 0, "logprobs": 2}, {"temperature": 0, "stop": ["stone"]}],
                         ids=["greedy", "seeded", "seeded-logprobs", "logprobs", "stop"])
def test_the_model_as_its_own_draft_model_gives_the_text_of_one_token_per_step(itself: Cluster,
                                                                               sampling: dict) -> None:
    drafted, accepted = counts(itself)
    fast = complete(itself, **sampling)
    drafted_now, accepted_now = counts(itself)
    assert fast == complete(itself, OFF, **sampling)
    assert drafted_now > drafted
    if not sampling["temperature"]:  # greedy: the draft model chooses as the model does
        assert accepted_now - accepted == drafted_now - drafted
    assert counts(itself)[0] == drafted_now  # speculative.n_max 0: none drafted


def test_two_requests_at_once_draft_on_their_own_sequences(itself: Cluster) -> None:
    prompts = [PROMPT, "the cloud over the mountain and the"]
    alone = [complete_prompt(itself, prompt, OFF) for prompt in prompts]
    drafted, _ = counts(itself)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda prompt: complete_prompt(itself, prompt, {}), prompts))
    assert together == alone
    assert counts(itself)[0] > drafted


def complete_prompt(cluster: Cluster, prompt: str, extra: dict[str, object]) -> str:
    choice = api_client(cluster).completions.create(model="any", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                                    extra_body=extra)
    return str(choice.choices[0].text)


def test_the_counts_are_on_metrics(itself: Cluster) -> None:
    complete(itself, temperature=0)
    status = itself.status()
    assert status["tokens_accepted"] > 0
    text = metrics_text(status)
    for name in ("tokens_drafted", "tokens_accepted"):
        assert re.search(rf"^ggml_cluster_{name}_total{{[^}}]*}} {status[name]}\.0$", text, re.MULTILINE), name


def test_a_kill_mid_request_resumes_exactly_and_drafting_goes_on(itself: Cluster) -> None:
    clean = itself.cli("run", PROMPT, "-n", "120").stdout
    output = output_node(itself.status())
    victim = itself.worker_pid(output["name"])
    drafted, _ = counts(itself)
    result, text, _ = run_with_fault(itself, PROMPT, "120", lambda: os.kill(victim, signal.SIGKILL))
    assert result.returncode == 0, result.stderr
    assert text == clean
    assert itself.worker_pid(output["name"]) != victim
    assert counts(itself)[0] > drafted


def test_a_draft_model_with_other_weights_has_drafts_rejected_and_the_text_is_the_models(other: Cluster) -> None:
    drafted, accepted = counts(other)
    for sampling in ({"temperature": 0}, SEEDED):
        assert complete(other, **sampling) == complete(other, OFF, **sampling)
    drafted_now, accepted_now = counts(other)
    assert drafted_now - drafted > accepted_now - accepted


@pytest.mark.parametrize("command", ["up", "check"])
def test_up_and_check_refuse_a_draft_model_with_another_vocabulary_before_starting_anything(command: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="gcdraftv-", dir="/tmp"))
    try:
        foreign = write_vocabulary(root / "foreign.gguf", ["<unk>", "<s>", "</s>", "a", "b"])
        cluster = Cluster(root, nodes=1, top=[f"speculative: {{draft_model: {foreign.name}}}"])
        result = cluster.cli(command, check=False)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr
        assert lines[0].startswith(f"error: {cluster.inventory}: speculative.draft_model: foreign.gguf has a "
                                   "vocabulary of 5 tokens, the model "), lines[0]
        assert "fix: " in lines[0]
        assert not cluster.processes() and not (cluster.state / "controller.pid").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
