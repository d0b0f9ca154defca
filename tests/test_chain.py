"""The node's sampler chain (llama.cpp's, core.engine.chain) chooses what the coordinator's own sampler chooses."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from llama_cpp import llama_cpp as lib

from core.engine.chain import NodeSampler, coordinator_reason, reported_logprobs
from core.engine.llama_context import LlamaContext
from core.engine.protocol import Generate
from core.engine.sampling import LLAMA_DEFAULT_SEED, Draws, Sampler, SamplingParams, chain_seed, logprobs
from core.engine.step import Entry
from core.model import demo_model
from core.nodes.build import cache_dir

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
    node = NodeSampler(lib, replace(BASE, temperature=0.0), 1, VOCAB, ends=ends)
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
    assert coordinator_reason(replace(plain, logprobs=2)) is None  # reported with the token (patches/0006)
    assert coordinator_reason(replace(plain, json_schema="{}")) == "response_format"
    assert coordinator_reason(replace(plain, repeat_penalty=1.1, presence_penalty=0.5)) is None  # patches/0007


def test_an_unseeded_request_gets_one_seed_for_both_ends() -> None:
    assert chain_seed(3) == 3 and chain_seed(2**32 + 3) == 3
    assert 0 <= chain_seed(None) < LLAMA_DEFAULT_SEED
    assert chain_seed(-1) != LLAMA_DEFAULT_SEED  # llama.cpp's "random seed" value becomes a chosen one


def report_of(logits: np.ndarray, token: int, top_n: int) -> np.ndarray:
    """What the node's logprobs sampler reports: float32 softmax, the top in no particular order."""
    probabilities = np.exp(logits - logits.max())
    probabilities = (probabilities / probabilities.sum()).astype(np.float32)
    top = np.argsort(-probabilities)[:top_n][::-1]
    return np.concatenate([[probabilities[token]], probabilities[top], top.astype(np.float32)]).astype(np.float32)


def test_a_report_reads_as_the_logprobs_the_coordinator_takes_from_the_logits() -> None:
    logits = logits_stream(3, 1)[0]
    token = int(np.argsort(-logits)[7])  # not among the top: its own probability is reported first
    for top_n in (0, 1, 5):
        expected, found = logprobs(logits, token, top_n), reported_logprobs(report_of(logits, token, top_n), top_n)
        assert found.logprob == pytest.approx(expected.logprob, abs=1e-5)
        assert [other for other, _ in found.top] == [other for other, _ in expected.top]
        assert [value for _, value in found.top] == pytest.approx([value for _, value in expected.top], abs=1e-5)
    assert reported_logprobs(np.array([0.0], dtype=np.float32), 0).logprob == -np.inf


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    """The demo model on this machine's CPU backend."""
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(demo_model(cache_dir())), n_gpu_layers=0, n_ctx=128, verbose=False)
    yield model
    model.close()


def test_the_graph_reports_the_sampled_tokens_logprobs_as_the_logits_give_them(llm: Any) -> None:
    # patches/0006 on this machine's CPU backend: an output sampled in the graph with its logprobs, against the
    # logits of the same step decoded without the chain
    vocab = lib.llama_model_get_vocab(llm.model)
    n_vocab = lib.llama_vocab_n_tokens(vocab)
    context = LlamaContext(lib, llm.ctx, vocab, n_vocab, 64)
    prompt = llm.tokenize(b"The cluster said")
    step = [Entry(token, pos, 0, pos == len(prompt) - 1) for pos, token in enumerate(prompt)]
    params = replace(BASE, temperature=1.5, top_k=50, top_p=1.0, min_p=0.0, seed=11)
    node = NodeSampler(lib, params, chain_seed(params.seed), n_vocab, top_n=4)
    assert lib.llama_set_sampler(llm.ctx, 0, node.chain) and node.on_backend()
    assert context.decode(step) == 0
    token, report = context.sampled(len(step) - 1), context.sampled_report(len(step) - 1)
    assert report is not None and report.size == 9
    lib.llama_set_sampler(llm.ctx, 0, None)
    context.forget(0, 0)
    assert context.decode(step) == 0
    logits = context.logits(len(step) - 1).copy()
    expected, found = logprobs(logits, token, 4), reported_logprobs(report, 4)
    assert found.logprob == pytest.approx(expected.logprob, abs=1e-4)
    assert [other for other, _ in found.top] == [other for other, _ in expected.top]
    assert [value for _, value in found.top] == pytest.approx([value for _, value in expected.top], abs=1e-4)


@pytest.mark.parametrize("params", [
    replace(BASE, temperature=0.0, repeat_penalty=1.5, presence_penalty=1.5, frequency_penalty=1.0, repeat_last_n=3),
    replace(BASE, temperature=1.2, top_k=40, repeat_penalty=1.3, frequency_penalty=0.5, repeat_last_n=3, seed=5),
], ids=["greedy", "seeded"])
def test_each_output_of_a_step_counts_the_tokens_sampled_before_it_in_its_penalties(llm: Any,
                                                                                    params: SamplingParams) -> None:
    # patches/0007 on this machine's CPU backend: a step that verifies drafts has an output for each of its last
    # tokens, and the r-th output's penalties count the tokens sampled at the outputs before it, as the
    # coordinator's sampler does when it takes them one by one (the window of 3 drops the oldest as they come)
    vocab = lib.llama_model_get_vocab(llm.model)
    n_vocab = lib.llama_vocab_n_tokens(vocab)
    outputs = 5
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_outputs_max_per_seq, cparams.n_outputs_max = 128, outputs, outputs
    ctx = lib.llama_init_from_model(llm.model, cparams)
    try:
        context = LlamaContext(lib, ctx, vocab, n_vocab, 64)
        tokens = llm.tokenize(b"the cat and the cat and the cat and the cat")
        first = len(tokens) - outputs
        step = [Entry(token, pos, 0, pos >= first) for pos, token in enumerate(tokens)]
        node, ours = NodeSampler(lib, params, chain_seed(params.seed), n_vocab), Sampler(params)
        for token in tokens[:first + 1]:  # the history before the step: the drafts after it are not taken yet
            node.accept(token)
            ours.accept(token, generated=False)
        assert lib.llama_set_sampler(ctx, 0, node.chain) and node.on_backend()
        assert context.decode(step) == 0
        sampled = [context.sampled(index) for index in range(first, len(tokens))]
        lib.llama_set_sampler(ctx, 0, None)
        context.forget(0, 0)
        assert context.decode(step) == 0
        chosen, unpenalised = [], []
        for index in range(first, len(tokens)):
            logits = context.logits(index).copy()
            chosen.append(ours.choose(logits))
            ours.accept(chosen[-1])
            unpenalised.append(int(np.argmax(logits)))
        assert sampled == chosen
        assert params.temperature > 0 or chosen != unpenalised  # the penalties chose otherwise
    finally:
        lib.llama_free(ctx)
