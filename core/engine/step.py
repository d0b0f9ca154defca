"""What one decode step is made of and what the scheduler (core.engine.slots) drives: a batch's entries, a failed
compute a worker reported, and the protocols of llama.cpp's context, a sampler on the node and a slot's drafts, so
the scheduler runs as well against a stand-in for them (the tests) as against llama.cpp (core.engine.llama_context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Entry:
    """One token of a batch: where it goes in its sequence, and whether its logits are wanted."""

    token: int
    pos: int
    seq: int
    logits: bool


@dataclass(frozen=True)
class ComputeFailure:
    """A failed graph compute that a worker reported (ggml-cluster's patch on ggml-rpc)."""

    endpoint: str
    device: int
    status: int  # enum ggml_status
    failures: int


class NodeChain(Protocol):
    """A request's sampler as it runs on the node that holds the output layer (core.engine.chain.NodeSampler)."""

    chain: Any  # what the engine hands llama.cpp

    def accept(self, token: int) -> None:
        """``token`` is part of the text now."""
        ...

    def replayed(self, token: int) -> None:
        """A token chosen before a restart: its draw, then accepted."""
        ...

    def on_backend(self) -> bool:
        """Whether all of it runs where it was attached."""
        ...


class Draft(Protocol):
    """A slot's drafts (core.engine.speculation.NgramDraft, core.engine.draft_model.DraftSequence)."""

    def add(self, token: int) -> None:
        """``token`` follows the sequence."""
        ...

    def propose(self, room: int) -> list[int]:
        """At most ``room`` tokens likely to follow."""
        ...

    def judged(self, drafted: int, accepted: int) -> None:
        """Of ``drafted`` tokens, the model chose the first ``accepted``."""
        ...

    def release(self) -> None:
        """The slot is done: free what the drafts held."""
        ...


class Engine(Protocol):
    """The model's llama.cpp context as the slots use it."""

    n_batch: int

    def decode(self, entries: list[Entry]) -> int:
        """llama_decode of one batch; its status (0: done, or on its way)."""
        ...

    def synchronize(self) -> None:
        """Wait until the last batch's graph is done on every device."""
        ...

    def take_failure(self) -> ComputeFailure | None:
        """A failed compute reported since the last call (after ``synchronize``), if any."""
        ...

    def logits(self, index: int) -> np.ndarray:
        """The logits of the batch's ``index``-th entry."""
        ...

    def forget(self, seq: int, start: int) -> None:
        """Drop sequence ``seq``'s KV cells from position ``start`` on."""
        ...

    def copy(self, source: int, target: int, length: int) -> None:
        """Make sequence ``target``'s KV cells those of ``source``'s first ``length`` positions."""
        ...

    def text(self, token: int) -> bytes:
        """A token's bytes."""
        ...

    def attach(self, seq: int, sampler: NodeChain) -> bool:
        """Sample sequence ``seq``'s outputs with ``sampler`` on the output layer's device; False if it cannot."""
        ...

    def detach(self, seq: int) -> None:
        """Sequence ``seq``'s outputs are logits again."""
        ...

    def sampled(self, index: int) -> int:
        """The token sampled on the node for the batch's ``index``-th entry."""
        ...

    def sampled_report(self, index: int) -> np.ndarray | None:
        """The logprobs reported with that token (core.engine.chain.reported_logprobs); None: none."""
        ...

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends generation (end of text, end of turn)."""
        ...
