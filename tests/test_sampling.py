"""The coordinator's sampler: llama-server's chain (penalties, top-k, top-p, min-p, temperature, a seeded draw), a
grammar checked as llama-server checks it, logprobs, and a state that replayed tokens rebuild exactly."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.engine.protocol import Generate
from core.engine.sampling import Grammar, GrammarError, Sampler, SamplingParams, logprobs, sampler_for
from core.model import write_demo_model

# Nothing but the temperature and the draw: the distribution is softmax(logits / temperature).
PLAIN = SamplingParams(temperature=1.0, seed=1, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                       repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0)
# Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1.
LOGITS = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=np.float32)) + np.float32(3.0)


def counts(params: SamplingParams, logits: np.ndarray = LOGITS, draws: int = 4000) -> Counter[int]:
    sampler = Sampler(params)
    return Counter(sampler.choose(logits) for _ in range(draws))


def test_the_defaults_are_llama_servers_and_a_request_carries_them() -> None:
    params = SamplingParams.of(Generate(1, 8))
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.0, 40, 0.95, 0.05)
    assert (params.repeat_penalty, params.repeat_last_n, params.presence_penalty, params.frequency_penalty) == (
        1.0, 64, 0.0, 0.0)


def test_temperature_zero_is_the_argmax_whatever_the_seed_and_the_logits_stay_unchanged() -> None:
    rng = np.random.default_rng(0)
    for seed in (None, 1, 2):
        sampler = Sampler(replace(PLAIN, temperature=0.0, seed=seed))
        for _ in range(20):
            logits = rng.standard_normal(300).astype(np.float32)
            kept = logits.copy()
            assert sampler.choose(logits) == int(np.argmax(logits))
            assert np.array_equal(logits, kept)


def test_plain_sampling_follows_softmax_of_logits_over_temperature() -> None:
    for temperature in (1.0, 2.0):
        expected = np.exp(LOGITS / temperature)
        expected /= expected.sum()
        seen = counts(replace(PLAIN, temperature=temperature))
        shares = np.array([seen[token] for token in range(LOGITS.size)]) / 4000
        assert np.abs(shares - expected).max() < 0.03, (temperature, shares, expected)


def test_a_seed_gives_the_same_tokens_again_and_another_seed_others() -> None:
    rng = np.random.default_rng(5)
    steps = [rng.standard_normal(50).astype(np.float32) for _ in range(40)]

    def tokens(seed: int | None) -> list[int]:
        sampler = Sampler(replace(PLAIN, seed=seed))
        return [sampler.choose(logits) for logits in steps]

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)
    assert tokens(-3) == tokens(-3)  # any whole number is a seed


def test_top_k_keeps_the_k_likeliest() -> None:
    assert set(counts(replace(PLAIN, top_k=1, temperature=2.0), draws=300)) == {0}
    assert set(counts(replace(PLAIN, top_k=2, temperature=2.0), draws=600)) == {0, 1}


def test_top_p_keeps_the_fewest_likeliest_tokens_that_reach_p() -> None:
    assert set(counts(replace(PLAIN, top_p=0.5), draws=300)) == {0}         # 0.5 reaches 0.5
    assert set(counts(replace(PLAIN, top_p=0.6), draws=600)) == {0, 1}      # 0.5 + 0.25
    assert set(counts(replace(PLAIN, top_p=0.8), draws=1000)) == {0, 1, 2}  # 0.875


def test_min_p_keeps_tokens_at_least_that_share_of_the_likeliest() -> None:
    assert set(counts(replace(PLAIN, min_p=0.45), draws=600)) == {0, 1}      # 0.25 >= 0.45 * 0.5 > 0.125
    assert set(counts(replace(PLAIN, min_p=0.2), draws=1000)) == {0, 1, 2}   # 0.125 >= 0.1 > 0.0625


def test_the_filters_see_the_logits_before_the_temperature_as_in_llama_cpps_chain() -> None:
    # A high temperature flattens what is left, but what is left was chosen from the untempered distribution.
    seen = counts(replace(PLAIN, min_p=0.45, temperature=50.0), draws=2000)
    assert set(seen) == {0, 1}
    assert abs(seen[0] / 2000 - 0.5) < 0.05  # nearly even between the two


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_of_recent_tokens() -> None:
    sampler = Sampler(replace(PLAIN, repeat_penalty=2.0))
    logits = np.array([4.0, -1.0, 3.0, 0.5], dtype=np.float32)
    for token in (0, 1, 1):
        sampler.accept(token)
    assert np.allclose(sampler.penalised(logits), [2.0, -2.0, 3.0, 0.5])  # counted once, whatever the count
    greedy = Sampler(replace(PLAIN, temperature=0.0, repeat_penalty=2.0))
    assert greedy.choose(logits) == 0
    greedy.accept(0)
    assert greedy.choose(logits) == 2  # the repeated token lost its lead


def test_presence_and_frequency_penalties_subtract_per_token_and_per_repeat() -> None:
    sampler = Sampler(replace(PLAIN, presence_penalty=0.5, frequency_penalty=0.25))
    for token in (1, 1, 1, 2):
        sampler.accept(token)
    logits = np.zeros(4, dtype=np.float32)
    assert np.allclose(sampler.penalised(logits), [0.0, -1.25, -0.75, 0.0])


def test_the_penalties_look_back_repeat_last_n_tokens_and_the_prompt_counts() -> None:
    sampler = Sampler(replace(PLAIN, presence_penalty=1.0, repeat_last_n=2))
    sampler.accept(0, generated=False)  # a prompt token
    logits = np.zeros(3, dtype=np.float32)
    assert np.allclose(sampler.penalised(logits), [-1.0, 0.0, 0.0])
    sampler.accept(1)
    sampler.accept(2)  # the prompt's token is now 3 back
    assert np.allclose(sampler.penalised(logits), [0.0, -1.0, -1.0])
    off = Sampler(replace(PLAIN, presence_penalty=1.0, repeat_last_n=0))
    off.accept(0)
    assert np.array_equal(off.penalised(logits), logits)


def test_replayed_tokens_rebuild_the_state_a_restart_lost() -> None:
    """A coordinator restarted after k tokens replays them; its next choices are the ones the first would make."""
    rng = np.random.default_rng(9)
    steps = [rng.standard_normal(40).astype(np.float32) for _ in range(30)]
    params = replace(PLAIN, seed=11, repeat_penalty=1.3, presence_penalty=0.2, top_k=10, top_p=0.9, min_p=0.02)
    first = Sampler(params)
    chosen = []
    for logits in steps:
        token = first.choose(logits)
        first.accept(token)
        chosen.append(token)
    restarted = Sampler(params)
    for token in chosen[:12]:
        restarted.replayed(token)
    again = []
    for logits in steps[12:]:
        token = restarted.choose(logits)
        restarted.accept(token)
        again.append(token)
    assert again == chosen[12:]


class EvenTokens:
    """A grammar that allows even tokens only, and records what it is told."""

    def __init__(self) -> None:
        self.checked: list[int] = []
        self.masked = 0
        self.accepted: list[int] = []

    def allows(self, token: int) -> bool:
        self.checked.append(token)
        return token % 2 == 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.masked += 1
        masked = logits.copy()
        masked[1::2] = -np.inf
        return masked

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_a_grammar_checks_the_chosen_token_and_masks_only_when_it_refuses_it() -> None:
    grammar = EvenTokens()
    sampler = Sampler(replace(PLAIN, temperature=0.0), grammar)
    assert sampler.choose(np.array([0.0, 1.0, 5.0, 2.0], dtype=np.float32)) == 2
    assert grammar.masked == 0  # the likeliest was allowed: no pass over the vocabulary
    assert sampler.choose(np.array([0.0, 9.0, 5.0, 2.0], dtype=np.float32)) == 2
    assert grammar.masked == 1
    sampler.accept(2, generated=False)  # a prompt token is not the grammar's
    sampler.accept(2)
    assert grammar.accepted == [2]


def test_a_grammar_refused_token_is_drawn_again_with_the_same_draw() -> None:
    # One draw per token, also when the grammar sends the choice round again: a replay takes exactly one.
    seen = counts(replace(PLAIN, temperature=1.0), np.zeros(6, dtype=np.float32), draws=10)
    assert len(seen) > 1
    sampler, reference = Sampler(PLAIN, EvenTokens()), Sampler(PLAIN)
    for _ in range(50):
        assert sampler.choose(np.zeros(6, dtype=np.float32)) % 2 == 0
        reference.choose(np.zeros(6, dtype=np.float32))
    assert sampler._draw() == reference._draw()


def test_logprobs_are_the_models_own_log_softmax_with_the_likeliest_first() -> None:
    found = logprobs(LOGITS, 2, 3)
    assert found.logprob == pytest.approx(np.log(0.125), abs=1e-6)
    assert [token for token, _ in found.top] == [0, 1, 2]
    assert [value for _, value in found.top] == pytest.approx(list(np.log([0.5, 0.25, 0.125])), abs=1e-6)
    assert logprobs(LOGITS, 0, 0).top == []


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The demo model's vocabulary in llama-cpp-python (no weights)."""
    import llama_cpp

    path: Path = write_demo_model(tmp_path_factory.mktemp("demo") / "demo.gguf")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield llm
    llm.close()


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["colour", "count", "ok"]}


def constrained_tokens(vocab: Any, seed: int, replay: int = 0, tokens: list[int] | None = None) -> list[int]:
    """Tokens chosen from seeded random logits under SCHEMA's grammar, until the end-of-text token; with
    ``replay``, the first ``replay`` of ``tokens`` are replayed instead (as after a coordinator restart)."""
    import llama_cpp

    request = Generate(1, 8, temperature=1.0, seed=seed, json_schema=json.dumps(SCHEMA), top_k=0, top_p=1.0,
                       min_p=0.0)
    sampler = sampler_for(request, llama_cpp, llama_cpp.llama_model_get_vocab(vocab.model), vocab.n_vocab())
    rng = np.random.default_rng(seed)
    chosen = []
    for step in range(400):
        logits = rng.standard_normal(vocab.n_vocab()).astype(np.float32) * 3
        if step < replay and tokens is not None:
            sampler.replayed(tokens[step])
            chosen.append(tokens[step])
            continue
        token = sampler.choose(logits)
        if token == vocab.token_eos():
            return chosen
        sampler.accept(token)
        chosen.append(token)
    raise AssertionError(f"no end of text after 400 tokens: {vocab.detokenize(chosen)!r}")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_llama_cpps_grammar_makes_random_logits_write_json_that_follows_the_schema(vocab: Any, seed: int) -> None:
    tokens = constrained_tokens(vocab, seed)
    answer = json.loads(vocab.detokenize(tokens).decode())
    assert set(answer) == {"colour", "count", "ok"}
    assert answer["colour"] in ("red", "green") and isinstance(answer["count"], int)
    assert isinstance(answer["ok"], bool)
    # A restart half-way replays the first tokens: grammar, penalties and draws are where they were.
    assert constrained_tokens(vocab, seed, replay=len(tokens) // 2, tokens=tokens) == tokens


def test_json_object_is_a_grammar_that_opens_an_object(vocab: Any) -> None:
    import llama_cpp

    # Any object: its strings are unbounded, so random logits would write on for ever; its first token is "{".
    request = Generate(1, 8, json_schema=json.dumps({"type": "object"}))
    sampler = sampler_for(request, llama_cpp, llama_cpp.llama_model_get_vocab(vocab.model), vocab.n_vocab())
    logits = np.zeros(vocab.n_vocab(), dtype=np.float32)
    logits[vocab.token_eos()] = 10.0  # the model would rather stop at once
    assert vocab.detokenize([sampler.choose(logits)]) == b"{"


def test_a_schema_the_grammar_cannot_express_is_a_grammar_error(vocab: Any) -> None:
    import llama_cpp

    native = llama_cpp.llama_model_get_vocab(vocab.model)
    for schema in ({"type": "nonsense"}, {"$ref": "https://example.com/schema.json"}):
        with pytest.raises(GrammarError, match="cannot be turned into a grammar"):
            Grammar.from_json_schema(llama_cpp, native, vocab.n_vocab(), json.dumps(schema))
    with pytest.raises(GrammarError, match="could not parse"):
        Grammar(llama_cpp, native, vocab.n_vocab(), "root ::= (")
