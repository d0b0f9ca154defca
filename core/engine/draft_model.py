"""Drafts from a small model on the head (inventory ``speculative: {draft_model: PATH}``).

A draft model with the target's vocabulary runs in the coordinator's process on this machine's CPU (llama.cpp,
no RPC device), one KV sequence per slot. Before the slot's step it proposes greedily: it catches its cells up
with the tokens the slot kept since its last draft, then decodes its own choices one at a time, stopping at the
room it is given, at an end-of-text token, or where it is unsure (its top token below ``p_min``, llama-server's
``--draft-p-min``). Verification is the
step's (core.engine.slots), as for n-gram drafts, so the text is the target's whatever the draft model says.

Its decodes run on the head between cluster steps, while no step is in flight: each drafted token costs one
decode of the draft model, paid in every step of the slot (``DraftModel.seconds`` counts it).
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Protocol

import numpy as np

from core.engine.llama_context import LlamaContext
from core.engine.step import Entry
from core.inventory_fields import DRAFT_P_MIN
from core.model import BATCH, DRAFT_MAX


class DraftContext(Protocol):
    """The draft model's llama.cpp context as a draft uses it (``LocalContext``, or a stand-in in the tests)."""

    n_batch: int

    def decode(self, entries: list[Entry]) -> int:
        """llama_decode of one batch; its status (0: done)."""
        ...

    def logits(self, index: int) -> np.ndarray:
        """The logits of the batch's ``index``-th entry."""
        ...

    def forget(self, seq: int, start: int) -> None:
        """Drop sequence ``seq``'s KV cells from position ``start`` on."""
        ...

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        ...


class LocalContext(LlamaContext):
    """A llama.cpp context of a GGUF on this machine's CPU alone, with ``parallel`` sequences of ``context`` cells."""

    def __init__(self, path: str, context: int, parallel: int, threads: int) -> None:
        """Load ``path``; ValueError when llama.cpp cannot."""
        from llama_cpp import llama_cpp as lib

        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        # An empty, NULL-terminated device list: no device but the CPU, not even the RPC workers this process has
        # registered (llama.cpp would otherwise put the draft model's layers and buffers on them).
        no_devices = (ctypes.c_void_p * 1)()
        params.devices = ctypes.cast(no_devices, ctypes.c_void_p)
        params.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp cannot load the draft model {path}")
        settings = lib.llama_context_default_params()
        settings.n_ctx = context * parallel
        settings.n_batch = settings.n_ubatch = min(BATCH, context)
        settings.n_seq_max = parallel
        settings.kv_unified = False  # each slot's own stream of `context` cells, as the target's
        settings.n_threads = settings.n_threads_batch = threads
        ctx = lib.llama_init_from_model(model, settings)
        if not ctx:
            raise ValueError(f"llama.cpp cannot make a context for the draft model {path}")
        vocab = lib.llama_model_get_vocab(model)
        super().__init__(lib, ctx, vocab, int(lib.llama_vocab_n_tokens(vocab)), int(settings.n_batch))
        self._model = model  # lives as long as the process, as the context does


class DraftModel:
    """The draft model shared by the slots: its context, which of its sequences are free, and its cost so far."""

    def __init__(self, context: DraftContext, parallel: int, p_min: float = DRAFT_P_MIN) -> None:
        """``context``: the loaded draft model with ``parallel`` sequences; ``p_min``: the least probability a
        drafted token needs under the draft model."""
        self.context = context
        self.p_min = p_min
        self._free = list(range(parallel - 1, -1, -1))  # sequences no draft holds (popped from the end: 0 first)
        self.decodes = 0      # llama_decode calls of the draft model
        self.seconds = 0.0    # spent in them, on the head, between cluster steps

    @classmethod
    def load(cls, path: str, context: int, parallel: int, threads: int, p_min: float = DRAFT_P_MIN) -> DraftModel:
        """Load the GGUF at ``path`` on this machine's CPU; ValueError when llama.cpp cannot."""
        return cls(LocalContext(path, context, parallel, threads), parallel, p_min)

    def sequence(self, tokens: list[int], limit: int = DRAFT_MAX) -> DraftSequence:
        """Drafts for a sequence that holds ``tokens`` so far, at most ``limit`` tokens each."""
        return DraftSequence(self, tokens, limit)

    def claim(self) -> int:
        """A free sequence of the draft context, emptied."""
        seq = self._free.pop()  # a slot each: never more drafts in flight than sequences
        self.context.forget(seq, 0)
        return seq

    def release(self, seq: int) -> None:
        """Sequence ``seq`` is free again."""
        self.context.forget(seq, 0)
        self._free.append(seq)

    def decode(self, entries: list[Entry]) -> np.ndarray:
        """Decode ``entries`` (the last one with its logits) and return those logits."""
        started = time.perf_counter()
        status = self.context.decode(entries)
        if status != 0:
            raise RuntimeError(f"the draft model's llama_decode returned {status}")
        logits = self.context.logits(len(entries) - 1)
        self.decodes += 1
        self.seconds += time.perf_counter() - started
        return logits

    def choice(self, logits: np.ndarray) -> int | None:
        """The draft model's greedy token, or None when its probability is below ``p_min``."""
        token = int(np.argmax(logits))
        if self.p_min > 0:
            top = float(logits[token])
            if 1.0 / float(np.exp(logits - top, dtype=np.float64).sum()) < self.p_min:
                return None
        return token


class DraftSequence:
    """One slot's drafts from the draft model (core.engine.step.Draft), its KV cells kept in step with the slot.

    Its cells hold ``_cells``: the slot's tokens as of its last draft, and the drafted tokens it decoded. A kept
    draft's cell stays (the slot's tokens then continue as the cells do); from the first token that differs on,
    the cells are dropped at the next draft and evaluated again, so they never hold a rejected token.
    """

    def __init__(self, model: DraftModel, tokens: list[int], limit: int) -> None:
        """``tokens``: the sequence so far (a prompt, and a replay's tokens); ``limit``: tokens per draft at most."""
        self.model = model
        self.limit = limit
        self.tokens = list(tokens)
        self._cells: list[int] = []  # the tokens in its KV cells, position by position
        self._valid = 0              # of those, how many are ``tokens``' own
        self._seq: int | None = None

    def add(self, token: int) -> None:
        """``token`` follows the sequence."""
        at = len(self.tokens)
        if self._valid == at and at < len(self._cells) and self._cells[at] == token:
            self._valid += 1  # a drafted token kept: its cell is the sequence's
        self.tokens.append(token)

    def propose(self, room: int) -> list[int]:
        """At most ``room`` tokens the draft model chooses after the sequence (fewer where it is unsure).

        A draft model that fails to decode costs the request its drafts, never its text: it drafts no more.
        """
        room = min(room, self.limit)
        if room <= 0:
            return []
        if self._seq is None:
            self._seq = self.model.claim()
        try:
            return self._draft(self._seq, room)
        except RuntimeError as exc:
            print(f"draft model: {exc}; this request drafts no more", file=sys.stderr, flush=True)
            self.model.context.forget(self._seq, 0)
            self._cells, self._valid, self.limit = [], 0, 0
            return []

    def _draft(self, seq: int, room: int) -> list[int]:
        model = self.model
        # At least the last token is decoded again: its logits give the first draft.
        start = min(self._valid, len(self.tokens) - 1)
        model.context.forget(seq, start)
        del self._cells[start:]
        self._valid = start
        logits: np.ndarray | None = None
        batch = model.context.n_batch
        while start < len(self.tokens):
            chunk = self.tokens[start:start + batch]
            logits = model.decode([Entry(token, start + offset, seq, start + offset == len(self.tokens) - 1)
                                   for offset, token in enumerate(chunk)])
            self._cells += chunk
            start += len(chunk)
        self._valid = len(self.tokens)
        draft: list[int] = []
        while logits is not None:
            token = model.choice(logits)
            if token is None:
                break
            draft.append(token)
            if len(draft) == room or model.context.is_end(token):
                break
            logits = model.decode([Entry(token, len(self._cells), seq, True)])
            self._cells.append(token)
        return draft

    def judged(self, drafted: int, accepted: int) -> None:
        """Nothing to adjust: the draft's length follows the draft model's confidence (``p_min``), and the kept
        tokens' cells are found as the tokens are added."""

    def release(self) -> None:
        """The slot is done: its draft sequence is free for another."""
        if self._seq is not None:
            self.model.release(self._seq)
            self._seq = None
