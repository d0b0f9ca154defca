"""The node's sampler chain (llama.cpp's, core.engine.chain) chooses what the coordinator's own sampler chooses."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest
from llama_cpp import llama_cpp as lib

from core.engine.chain import NodeSampler, coordinator_reason
from core.engine.protocol import Generate
from core.engine.sampling import LLAMA_DEFAULT_SEED, Draws, Sampler, SamplingParams, chain_seed

VOCAB = 3000
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # struct llama_token_data


def cpu_choice(node: NodeSampler, logits: np.ndarray) -> int:
    """The token the node's chain chooses from ``logits`` on this machine's CPU, as the backend would."""
    data = np.zeros(logits.size, dtype=TOKEN_DATA)
    data["id"] = np.arange(logits.size, dtype=np.int32)
    data["logit"] = logits
    candidates = lib.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
                                            size=data.size, selected=-1, sorted=False)
    lib.llama_sampler_apply(node.chain, ctypes.byref(candidates))
    return int(candidates.data[candidates.selected].id)
BASE = SamplingParams(temperature=0.8, seed=7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                      repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0)
CASES = {
    "llama-server's defaults": BASE,
    "greedy": replace(BASE, temperature=0.0),
    "greedy with penalties": replace(BASE, temperature=0.0, repeat_penalty=1.5, presence_penalty=0.5,
                                     frequency_penalty=0.3, repeat_last_n=8),
    "hot, wide, penalised": replace(BASE, temperature=1.5, top_k=500, top_p=1.0, min_p=0.0, repeat_penalty=1.2),
    "top-k only": replace(BASE, top_p=1.0, min_p=0.0, seed=123456789),
}


def logits_stream(seed: int, steps: int) -> list[np.ndarray]:
    """Peaked random logits, like a model's: a few likely tokens, a long tail."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(VOCAB) * 2.5 + np.where(rng.random(VOCAB) < 0.01, 6.0, 0.0)).astype(np.float32)
            for _ in range(steps)]


@pytest.mark.parametrize("name", list(CASES))
def test_the_node_chain_chooses_the_coordinators_tokens(name: str) -> None:
    params = CASES[name]
    ours, node = Sampler(params), NodeSampler(lib, params, chain_seed(params.seed), VOCAB)
    prompt = [5, 6, 7, 5]
    for token in prompt:
        ours.accept(token, generated=False)
        node.accept(token)
    chosen = []
    for logits in logits_stream(1, 150):
        token = ours.choose(logits.copy())
        assert cpu_choice(node, logits.copy()) == token
        ours.accept(token)
        node.accept(token)
        chosen.append(token)
    assert len(set(chosen)) > 1 or params.temperature <= 0


def test_a_replayed_chain_goes_on_as_the_first_one_would() -> None:
    params = CASES["hot, wide, penalised"]
    steps = logits_stream(2, 60)
    first = NodeSampler(lib, params, 99, VOCAB)
    tokens = []
    for logits in steps:
        tokens.append(cpu_choice(first, logits.copy()))
        first.accept(tokens[-1])
    resumed = NodeSampler(lib, params, 99, VOCAB)
    for token in tokens[:25]:
        resumed.replayed(token)
    again = []
    for logits in steps[25:]:
        again.append(cpu_choice(resumed, logits.copy()))
        resumed.accept(again[-1])
    assert again == tokens[25:]


def test_ignore_eos_keeps_the_end_tokens_out_as_the_coordinator_does() -> None:
    ends = np.array([0, 1, 2], dtype=np.int64)
    node = NodeSampler(lib, replace(BASE, temperature=0.0), 1, VOCAB, ends)
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[1], logits[9] = 10.0, 5.0
    assert cpu_choice(node, logits) == 9


def test_draws_are_llama_cpps_mt19937_doubles() -> None:
    # std::mt19937(5489)'s first two words (the C++ standard's check value is its 10000th: 4123659995).
    draws = Draws(5489)
    assert draws() == pytest.approx((3499211612 + (581869302 << 32)) / 2**64)
    words = np.random.MT19937()
    words._legacy_seeding(5489)
    assert int(words.random_raw(10000)[-1]) == 4123659995


def test_what_stays_on_the_coordinator() -> None:
    plain = Generate(1, 8, temperature=0.7)
    assert coordinator_reason(plain) is None
    assert coordinator_reason(replace(plain, temperature=0.0, top_k=0)) is None
    assert coordinator_reason(replace(plain, top_k=0)) == "top_k 0"
    assert coordinator_reason(replace(plain, logprobs=2)) == "logprobs"
    assert coordinator_reason(replace(plain, json_schema="{}")) == "response_format"
    assert coordinator_reason(replace(plain, repeat_penalty=1.1)) == "penalties"
    assert coordinator_reason(replace(plain, repeat_penalty=1.1, repeat_last_n=0)) is None


def test_an_unseeded_request_gets_one_seed_for_both_ends() -> None:
    assert chain_seed(3) == 3 and chain_seed(2**32 + 3) == 3
    assert 0 <= chain_seed(None) < LLAMA_DEFAULT_SEED
    assert chain_seed(-1) != LLAMA_DEFAULT_SEED  # llama.cpp's "random seed" value becomes a chosen one
