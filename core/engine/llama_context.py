"""The loaded model's llama.cpp context as the scheduler drives it (core.engine.step.Engine): batches of several
sequences, their logits or the tokens sampled on the node, KV cells dropped and copied, and the failed computes the
workers reported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from core.engine.step import ComputeFailure, Entry, NodeChain

if TYPE_CHECKING:
    from core.engine.coordinator import Generator


def last_logits(lib: Any, llm: Any, n_vocab: int, index: int = -1) -> np.ndarray:
    """The logits of the last decoded batch's ``index``-th output (default: its last token), without a copy
    (``lib``: the llama_cpp module).

    Reading them waits for the graph: llama_decode itself may return before it is done.
    """
    return np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, index), shape=(n_vocab,))


class LlamaContext:
    """A llama.cpp context driven with batches of entries: decoded, their logits read, KV cells dropped. The
    cluster's model (LlamaEngine) and the head's draft model (core.engine.draft_model) are both driven so."""

    def __init__(self, lib: Any, ctx: Any, vocab: Any, n_vocab: int, n_batch: int) -> None:
        """``lib``: the llama_cpp module; ``ctx``, ``vocab``: the context and its model's vocabulary; batches of
        at most ``n_batch`` entries."""
        self.n_batch = n_batch
        self._lib, self._ctx = lib, ctx
        self._vocab, self._n_vocab = vocab, n_vocab
        self._memory = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)  # lives as long as the process

    def decode(self, entries: list[Entry]) -> int:
        """llama_decode of one batch (at most ``n_batch`` entries)."""
        batch = self._batch
        batch.n_tokens = len(entries)
        for index, entry in enumerate(entries):
            batch.token[index] = entry.token
            batch.pos[index] = entry.pos
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = entry.seq
            batch.logits[index] = entry.logits
        return int(self._lib.llama_decode(self._ctx, batch))

    def logits(self, index: int) -> np.ndarray:
        """The logits of the batch's ``index``-th entry, without a copy."""
        return np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, index), shape=(self._n_vocab,))

    def sampled(self, index: int) -> int:
        """The token the node sampled for the batch's ``index``-th entry (-1: none)."""
        return int(self._lib.llama_get_sampled_token_ith(self._ctx, index))

    def sampled_report(self, index: int) -> np.ndarray | None:
        """The logprobs the node reported with the ``index``-th entry's token (core.engine.chain.reported_logprobs
        reads them); None: none."""
        count = int(self._lib.llama_get_sampled_probs_count_ith(self._ctx, index))
        if not count:
            return None
        return np.ctypeslib.as_array(self._lib.llama_get_sampled_probs_ith(self._ctx, index), shape=(count,)).copy()

    def attach(self, seq: int, sampler: NodeChain) -> bool:
        """Run ``sampler``'s chain on the output layer's device for ``seq`` (llama_set_sampler); False: it cannot
        run there whole."""
        if not self._lib.llama_set_sampler(self._ctx, seq, sampler.chain):
            return False
        if not sampler.on_backend():
            self.detach(seq)
            return False
        return True

    def detach(self, seq: int) -> None:
        """``seq``'s outputs are logits again."""
        self._lib.llama_set_sampler(self._ctx, seq, None)

    def forget(self, seq: int, start: int) -> None:
        """Drop a sequence's KV cells from ``start`` on."""
        self._lib.llama_memory_seq_rm(self._memory, seq, start, -1)

    def is_end(self, token: int) -> bool:
        """End of text or of a turn."""
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))


class LlamaEngine(LlamaContext):
    """The loaded model's llama.cpp context, driven with batches of several sequences (see core.engine.slots)."""

    def __init__(self, generator: Generator) -> None:
        """The context of ``generator``'s loaded model."""
        llm = generator.llm
        super().__init__(generator.lib, llm.ctx, generator.vocab, generator.n_vocab, int(llm.n_batch))
        self._llm = llm
        self._compute = generator.compute

    def synchronize(self) -> None:
        """Wait for the graph on every device (llama_decode may return before)."""
        self._lib.llama_synchronize(self._ctx)

    def take_failure(self) -> ComputeFailure | None:
        """A failed compute a worker reported, if any."""
        return self._compute.take() if self._compute is not None else None

    def copy(self, source: int, target: int, length: int) -> None:
        """Give ``target`` the cells of ``source``'s first ``length`` positions.

        Each sequence has a KV stream of its own, and llama.cpp copies across streams only whole: the copy (worker-
        side, RPC COPY_TENSOR per layer, at the next llama_decode) takes the stream, then the rest is dropped.
        """
        self._lib.llama_memory_seq_cp(self._memory, source, target, -1, -1)
        self._lib.llama_memory_seq_rm(self._memory, target, length, -1)

    def text(self, token: int) -> bytes:
        """A token's bytes."""
        return bytes(self._llm.detokenize([token]))
