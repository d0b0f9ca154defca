"""Sampling on the node that holds the output layer: a request's sampler as a llama.cpp sampler chain.

llama.cpp runs a sequence's chain (set with llama_set_sampler) inside the graph, on the output layer's device, and
copies back what the chain leaves: the sampled token, plus its candidates. Without it the node sends every logit of
every token, n_vocab * 4 bytes (1 MiB for a 262k vocabulary), which over a 100 Mbit link caps decode near 12 tok/s.
The chain is the coordinator's own (core.engine.sampling): penalties, top-k, top-p, min-p, temperature and one draw
of the same generator, so a request chooses the same tokens wherever it is sampled. Its shape follows what the
backend can do without copying the whole vocabulary back:
- it always narrows the candidates with top-k before it draws (``greedy`` alone still copies every logit back, and
  top-k(1) + ``greedy`` returns token 0: its argmax indexes the narrowed candidates), so temperature 0 is
  top-k(1) + ``dist``, which maps back through the candidates;
- logprobs come back with the token: ggml-cluster's logprobs sampler (patches/0006) takes the softmax of the whole
  vocabulary's logits on the node and reports the sampled token's probability and the likeliest N's with their ids,
  read in the step's one copy (`reported_logprobs` makes them what the coordinator computes from the logits);
- the coordinator asks for several outputs per sequence (core.engine.coordinator), for drafts and for ``dist``'s
  transactional draws: a draw is committed only when its token is taken, so an output nobody takes (a step retried
  after a failed compute) leaves the request's draws as they were, and a seeded request resumes exactly. llama.cpp's
  backend penalties refuse more than one output per sequence; patches/0007 counts, in each later row's penalties,
  the tokens sampled at the rows before it, as the coordinator's sampler does when it takes them one by one;
- a request that needs every logit stays on the coordinator (`coordinator_reason`): a JSON schema (llama.cpp's
  grammar sampler has no backend part), or sampling at temperature > 0 with top-k off (the candidates would be the
  whole vocabulary).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import numpy as np

from core.engine.protocol import Generate
from core.engine.sampling import Logprobs, SamplingParams, chain_seed

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # struct llama_token_data


def coordinator_reason(request: Generate) -> str | None:
    """Why ``request`` must be sampled on the coordinator from the whole vocabulary's logits; None: on the node."""
    if request.json_schema is not None:
        return "response_format"
    if request.temperature > 0 and request.top_k <= 0:
        return "top_k 0"
    return None


class NodeSampler:
    """A request's llama.cpp sampler chain, to run on the output layer's device; it lives as long as the object."""

    def __init__(self, lib: Any, params: SamplingParams, seed: int, n_vocab: int, *,
                 ends: np.ndarray | None = None, top_n: int | None = None) -> None:
        """``lib``: the llama_cpp module; ``seed``: the request's seed as the chain takes it (chain_seed);
        ``n_vocab``: the model's vocabulary size; ``ends``: tokens never to choose (ignore_eos); ``top_n``: the
        alternatives whose logprobs each output reports (0: the chosen token's alone; None: no logprobs)."""
        self._lib = lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        self.chain = chain
        weakref.finalize(self, lib.llama_sampler_free, chain)  # the chain frees the samplers added to it

        def add(sampler: Any) -> None:
            lib.llama_sampler_chain_add(chain, sampler)

        if ends is not None and ends.size:
            biases = (lib.llama_logit_bias * int(ends.size))(*[lib.llama_logit_bias(int(token), -np.inf)
                                                               for token in ends])
            add(lib.llama_sampler_init_logit_bias(n_vocab, int(ends.size), biases))
        if top_n is not None:  # after the ends' bias: the logprobs see them at -inf, as the coordinator's do
            add(_init_logprobs()(top_n))
        if params.penalised:
            add(lib.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty,
                                                 params.frequency_penalty, params.presence_penalty))
        if params.temperature <= 0:
            add(lib.llama_sampler_init_top_k(1))
        else:
            add(lib.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(lib.llama_sampler_init_top_p(params.top_p, 0))
            if params.min_p > 0.0:
                add(lib.llama_sampler_init_min_p(params.min_p, 0))
            add(lib.llama_sampler_init_temp(params.temperature))
        add(lib.llama_sampler_init_dist(seed))
        self._dist = lib.llama_sampler_chain_get(chain, lib.llama_sampler_chain_n(chain) - 1)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    @classmethod
    def of(cls, lib: Any, request: Generate, ends: np.ndarray | None, n_vocab: int) -> NodeSampler:
        """The chain of a request (one that `coordinator_reason` leaves on the node)."""
        return cls(lib, SamplingParams.of(request), chain_seed(request.seed), n_vocab,
                   ends=ends if request.ignore_eos else None, top_n=request.logprobs)

    def on_backend(self) -> bool:
        """Whether every sampler of the chain runs on the backend it was attached to (llama.cpp names those that
        do ``+name``): one that does not leaves no sampled token, only its logits."""
        lib = self._lib
        return all(lib.llama_sampler_name(lib.llama_sampler_chain_get(self.chain, index)).startswith(b"+")
                   for index in range(lib.llama_sampler_chain_n(self.chain)))

    def accept(self, token: int) -> None:
        """``token`` is part of the text now (a prompt token or a chosen one): the penalties' history, and the draw
        the backend took for it, committed."""
        self._lib.llama_sampler_accept(self.chain, token)

    def replayed(self, token: int) -> None:
        """A token chosen before a restart: the draw it took (``dist`` over one candidate draws once, as the
        backend does per output), then accepted."""
        one = self._one
        one[0] = (token, 0.0, 0.0)
        lib = self._lib
        candidates = lib.llama_token_data_array(data=one.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
                                                size=1, selected=-1, sorted=False)
        lib.llama_sampler_apply(self._dist, ctypes.byref(candidates))
        self.accept(token)


def reported_logprobs(report: np.ndarray, top_n: int) -> Logprobs:
    """An output's logprobs report from the node (llama_sampler_init_logprobs: the sampled token's probability, then
    the likeliest tokens' probabilities and their ids, in no order) as core.engine.sampling.logprobs gives them from
    the logits: natural logs, the likeliest ``top_n`` first."""
    count = (report.size - 1) // 2
    probabilities = report[1:1 + count].astype(np.float64)
    ids = report[1 + count:1 + 2 * count].astype(np.int64)
    order = np.lexsort((ids, -probabilities))[:top_n]  # likeliest first; equals by id
    with np.errstate(divide="ignore"):  # a probability below float32's range is 0: its log is -inf
        logs = np.log(probabilities[order])
        return Logprobs(float(np.log(np.float64(report[0]))), [(int(ids[i]), float(logs[k]))
                                                                 for k, i in enumerate(order)])


@functools.cache
def _init_logprobs() -> Any:
    """llama_sampler_init_logprobs, ggml-cluster's sampler (patches/0006), which llama-cpp-python does not bind."""
    from llama_cpp import llama_cpp as capi

    init = capi._lib.llama_sampler_init_logprobs
    init.argtypes, init.restype = [ctypes.c_int32], capi.llama_sampler_p_ctypes
    return init
