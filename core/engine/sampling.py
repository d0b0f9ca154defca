"""How the coordinator picks each token: llama-server's sampler chain, per request, in numpy.

The chain and its defaults are llama.cpp's (common/sampling.cpp, common_params_sampling): repetition penalties
over the last ``repeat_last_n`` tokens (the prompt's too), then top-k, top-p, min-p, temperature, and one draw
from the request's seeded generator; temperature 0 is the likeliest token after the penalties. The draw is llama.cpp's
own (`Draws`: std::mt19937 seeded with the request's seed as llama-server takes it, a 53-bit uniform double), so a
token this sampler chooses is the one llama.cpp's sampler chain chooses from the same logits, on the coordinator
or on the node that holds the output layer (core.engine.chain). A grammar
(``response_format``'s JSON schema, through llama.cpp's grammar sampler) is checked as llama-server checks it: the
chosen token first, and only when the grammar refuses it are all the logits masked and the token chosen again, with
the same draw. So every token takes exactly one draw at temperature > 0, and a request resumed after a restart
rebuilds its sampler from the replayed tokens alone (`Sampler.replayed`).
"""

from __future__ import annotations

import ctypes
import weakref
from collections import Counter, deque
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from core.engine.protocol import Generate


class Draws:
    """The uniform draws of llama.cpp's ``dist`` sampler: std::mt19937 seeded with ``seed`` (a uint32, as llama.cpp
    takes it), through std::uniform_real_distribution<double>, which is generate_canonical of two 32-bit words."""

    def __init__(self, seed: int) -> None:
        self._bits = np.random.MT19937()
        self._bits._legacy_seeding(seed)  # init_genrand(seed): std::mt19937's own seeding

    def __call__(self) -> float:
        """The next draw in [0, 1)."""
        low, high = (int(word) for word in self._bits.random_raw(2))
        return min((low + (high << 32)) / 2.0**64, 1.0 - 2.0**-53)


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp draws a random seed for this one (llama.h)


def chain_seed(seed: int | None) -> int:
    """A request's seed as llama.cpp's sampler takes it (a uint32, as llama-server's JSON reader casts it); no seed
    is a random one, chosen here so that both ends of a request's sampling share it."""
    if seed is None or seed % (1 << 32) == LLAMA_DEFAULT_SEED:
        return int(np.random.default_rng().integers(0, LLAMA_DEFAULT_SEED))
    return seed % (1 << 32)


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling fields (see core.service.GenerateRequest)."""

    temperature: float
    seed: int | None
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float

    @property
    def penalised(self) -> bool:
        """Whether the penalties change anything (llama.cpp's penalties sampler is off otherwise:
        llama_sampler_penalties::is_disabled)."""
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)

    @classmethod
    def of(cls, request: Generate) -> SamplingParams:
        """The sampling fields of a `Generate`."""
        return cls(**{item.name: getattr(request, item.name) for item in fields(cls)})


class Constraint(Protocol):
    """What limits the tokens a sampler may choose (a grammar)."""

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next."""
        ...

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token that may not come next at -inf."""
        ...

    def accept(self, token: int) -> None:
        """``token`` came next (it was allowed)."""
        ...


class Sampler:
    """One request's token choice: its sampling fields, seeded generator, penalty history and grammar state."""

    def __init__(self, params: SamplingParams, grammar: Constraint | None = None) -> None:
        self.params = params
        self.grammar = grammar
        # Greedy takes a draw too, as llama.cpp's dist does from a single candidate: replays count the same.
        self._draw = Draws(chain_seed(params.seed))
        self._history: deque[int] | None = deque(maxlen=params.repeat_last_n) if params.penalised else None
        self._counts: Counter[int] = Counter()

    def accept(self, token: int, generated: bool = True) -> None:
        """``token`` is part of the text now: the prompt's (``generated`` False, for the penalties alone, as
        llama-server feeds them) or a chosen one."""
        history = self._history
        if history is not None:
            if len(history) == history.maxlen:
                oldest = history[0]
                self._counts[oldest] -= 1
                if not self._counts[oldest]:
                    del self._counts[oldest]
            history.append(token)
            self._counts[token] += 1
        if generated and self.grammar is not None:
            self.grammar.accept(token)

    def replayed(self, token: int) -> None:
        """A token chosen before a restart: the draw it took, then accepted, so the state is as it was."""
        self._draw()
        self.accept(token)

    def choose(self, logits: np.ndarray) -> int:
        """The next token for ``logits`` (the model's, left unchanged). Call `accept` with it unless it ends the
        text."""
        draw = self._draw()
        scores = self.penalised(logits)
        token = self._pick(scores, draw)
        if self.grammar is not None and not self.grammar.allows(token):
            scores = self.grammar.mask(scores)
            if not np.isfinite(scores.max()):
                raise RuntimeError("the grammar of response_format allows no token here")
            token = self._pick(scores, draw)
        return token

    def penalised(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` after the repetition, frequency and presence penalties (llama_sampler_penalties_apply)."""
        if self._history is None or not self._counts:
            return logits
        params = self.params
        ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
        seen = logits[ids]
        # Dividing a negative logit would make the token likelier: llama.cpp multiplies those instead.
        seen = np.where(seen <= 0, seen * params.repeat_penalty, seen / params.repeat_penalty)
        scores = logits.copy()
        scores[ids] = seen - counts * params.frequency_penalty - params.presence_penalty
        return scores

    def _pick(self, scores: np.ndarray, draw: float) -> int:
        params = self.params
        if params.temperature <= 0:
            return int(np.argmax(scores))
        size = scores.size
        if 0 < params.top_k < size:
            candidates = np.argpartition(scores, size - params.top_k)[size - params.top_k:]
        else:
            candidates = np.arange(size)
        candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
        kept = scores[candidates].astype(np.float64)
        if params.top_p < 1.0:
            cumulative = np.cumsum(_softmax(kept))
            # The fewest likeliest tokens whose probabilities add up to top_p (llama_sampler_top_p_apply).
            kept = kept[:min(int(np.searchsorted(cumulative, params.top_p)) + 1, kept.size)]
        if params.min_p > 0.0:
            # Tokens at least min_p times as likely as the likeliest (llama_sampler_min_p_apply, in logits).
            kept = kept[:max(1, int(np.count_nonzero(kept >= kept[0] + np.log(params.min_p))))]
        cumulative = np.cumsum(_softmax(kept / params.temperature))
        # The first token whose running sum reaches the draw (llama_sampler_dist_apply).
        index = int(np.searchsorted(cumulative, draw * cumulative[-1]))
        return int(candidates[min(index, kept.size - 1)])


def _softmax(values: np.ndarray) -> np.ndarray:
    exps: np.ndarray = np.exp(values - values[0])  # sorted: values[0] is the largest
    result: np.ndarray = exps / exps.sum()
    return result


@dataclass(frozen=True)
class Logprobs:
    """A chosen token's log-probability and the ``top`` likeliest tokens with theirs, likeliest first."""

    logprob: float
    top: list[tuple[int, float]]


def logprobs(logits: np.ndarray, token: int, top_n: int) -> Logprobs:
    """Log-probabilities under the model's own distribution (the raw logits, before penalties, temperature or a
    grammar: what llama-server reports unless asked for post-sampling probabilities)."""
    values = logits.astype(np.float64)
    largest = values.max()
    total = largest + np.log(np.exp(values - largest).sum())
    top: list[tuple[int, float]] = []
    if top_n > 0:
        count = min(top_n, values.size)
        best = np.argpartition(values, values.size - count)[values.size - count:]
        best = best[np.argsort(-values[best], kind="stable")]
        top = [(int(index), float(values[index] - total)) for index in best]
    return Logprobs(float(values[token] - total), top)


class GrammarError(ValueError):
    """A JSON schema that llama.cpp's grammar cannot express."""


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # struct llama_token_data


class Grammar:
    """llama.cpp's grammar sampler (llama_sampler_init_grammar) over a model's vocabulary, as a `Constraint`."""

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, gbnf: str) -> None:
        """``lib``: the llama_cpp module; ``vocab``: the model's llama_vocab; ``gbnf``: the grammar (rule ``root``)."""
        self._lib = lib
        sampler = lib.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not sampler:
            raise GrammarError("llama.cpp could not parse the grammar made from the schema")
        self._sampler = sampler
        weakref.finalize(self, lib.llama_sampler_free, sampler)
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._all["id"] = np.arange(n_vocab, dtype=np.int32)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    @classmethod
    def from_json_schema(cls, lib: Any, vocab: Any, n_vocab: int, schema: str) -> Grammar:
        """The grammar of a JSON schema (JSON text), converted by llama-cpp-python's json_schema_to_gbnf."""
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            gbnf = json_schema_to_gbnf(schema)
        except (AssertionError, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            # The converter reports what it does not support with assertions, e.g. "Unrecognized schema: ...".
            why = str(exc) or type(exc).__name__
            raise GrammarError(f"the JSON schema cannot be turned into a grammar: {why}") from None
        return cls(lib, vocab, n_vocab, gbnf)

    def _apply(self, data: np.ndarray) -> None:
        lib = self._lib
        candidates = lib.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
                                                size=data.size, selected=-1, sorted=False)
        lib.llama_sampler_apply(self._sampler, ctypes.byref(candidates))

    def allows(self, token: int) -> bool:
        """Whether the grammar lets ``token`` come next."""
        self._one[0] = (token, 0.0, 0.0)
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar refuses here at -inf."""
        self._all["logit"] = logits
        self._apply(self._all)
        masked: np.ndarray = self._all["logit"].copy()
        return masked

    def accept(self, token: int) -> None:
        """Advance the grammar past ``token`` (one it allows: llama.cpp aborts on any other)."""
        self._lib.llama_sampler_accept(self._sampler, token)


def sampler_for(request: Generate, lib: Any, vocab: Any, n_vocab: int) -> Sampler:
    """The sampler of a request on a loaded model; GrammarError when its JSON schema cannot be a grammar."""
    grammar = (Grammar.from_json_schema(lib, vocab, n_vocab, request.json_schema)
               if request.json_schema is not None else None)
    return Sampler(SamplingParams.of(request), grammar)
