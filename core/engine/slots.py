"""Parallel slots with continuous batching: every decode step carries the next token of each sequence in flight.

Decode on these nodes is bound by reading the weights, so a step that carries a token of each of four sequences
costs little more than a step with one. Each request holds a slot (its own KV sequence) from admission to its
end; each step is one llama_decode of a batch that holds, in this order:
- the next token of every slot that is generating (or replaying after a restart, one token at a time, as first
  decoded), and
- as much of the waiting prompts as fits, oldest first (at most ``Engine.n_batch`` tokens in all), so a long
  prompt is evaluated in chunks between the others' tokens instead of freezing their streams, and requests that
  arrive together start together.
A prompt that begins as another sequence's does (the choices of one request with ``n`` > 1, the same system
prompt) starts from a copy of that sequence's KV cells for the part they share (at least SHARE_MIN_TOKENS, or
all of it but the last token, which is evaluated for its logits) instead of evaluating it again; one whose
shared part is still being evaluated for another waits for it. A finished or cancelled request frees its slot and
its KV cells at once; requests beyond the slots wait here.
With one slot this is exactly the one-request-at-a-time decode: the prompt in batches of n_batch, then one token
per step, which keeps a replay after a restart bit-identical. With several, a sequence's numbers may differ from
a run alone (the CPU's matrix kernels take another path for a batch of several rows than for one), so a
resumed request continues its own tokens with nothing lost or repeated, but its greedy text after the fault
may differ from a fault-free run's when others ran beside it.

A step that a worker reports failed (ggml-cluster's patch on ggml-rpc) is retried in place: its cells are
dropped for every sequence in it and the same batch is decoded again.

A slot with a sampler for the node (core.engine.chain) has it set on its sequence while it holds the slot: its
tokens are sampled where the output layer is, and only they cross the network; the others choose from the logits.

A generating slot with a draft (core.engine.speculation, core.engine.draft_model) sends tokens drafted after its
next one in the same step, each with an output. Its outputs are then sampled in order, each as if it were the only
one, for as long as the token chosen is the draft's next: those drafts are kept with the token chosen after them,
the rest and their KV cells dropped. Each output samples exactly what one token per step would have (the same
logits; a seeded draw is taken per token kept), so the text is the same, with fewer steps.
"""

from __future__ import annotations

import codecs
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from core.engine.chain import reported_logprobs
from core.engine.protocol import (
    Answer,
    ComputeFailed,
    ComputeRetried,
    Done,
    Failed,
    Generate,
    Progress,
    PromptTokens,
    Token,
    TokenLogprobs,
)
from core.engine.sampling import Logprobs, logprobs
from core.engine.step import Draft, Engine, Entry, NodeChain
from core.model import INVARIANT_ROWS

PROGRESS_INTERVAL_S = 0.5  # a replay reports how far it got at most this often
# A step whose compute a worker reported failed is retried in place this often, after these pauses (a transient
# fault, such as a device briefly out of memory, may need a moment); then the controller's restart path takes over.
RETRY_DELAYS_S = (0.0, 0.01, 0.1)
# A prompt prefix shorter than this (unless it is the whole prompt) is evaluated again rather than copied: a copy
# moves the donor's whole KV stream, worker-side, which costs more than evaluating a few tokens.
SHARE_MIN_TOKENS = 32


class Requests(Protocol):
    """Which requests were cancelled (by another thread), and which are done."""

    def cancelled(self, rid: int) -> bool:
        """Whether request ``rid`` was cancelled."""
        ...

    def closed(self, rid: int) -> None:
        """Request ``rid`` is done, either way."""
        ...


class RequestIds:
    """Which requests are queued or running, and which of those were cancelled (shared by two threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[object] = set()
        self._cancelled: set[object] = set()

    def opened(self, rid: int) -> None:
        """A request was queued."""
        with self._lock:
            self._open.add(rid)

    def cancel(self, rid: int) -> None:
        """Cancel a queued or running request; any other id is ignored (its request is done)."""
        with self._lock:
            if rid in self._open:
                self._cancelled.add(rid)

    def cancelled(self, rid: int) -> bool:
        """Whether ``rid`` was cancelled."""
        with self._lock:
            return rid in self._cancelled

    def closed(self, rid: int) -> None:
        """A request is done: forget it."""
        with self._lock:
            self._open.discard(rid)
            self._cancelled.discard(rid)



class PersistentComputeFailure(Exception):
    """A step kept failing after every retry in place."""


Choose = Callable[[np.ndarray], int]  # a request's sampler: logits → token
Explain = Callable[[int, Logprobs], TokenLogprobs]  # a chosen token's logprobs as the request gets them (texts)


@dataclass
class Slot:
    """One request in flight on its own KV sequence."""

    request: Generate
    seq: int
    prompt: list[int]
    budget: int                # new tokens it may still generate
    choose: Choose
    accept: Callable[[int], None]    # a token chosen and kept (the sampler's history, its grammar)
    replayed: Callable[[int], None]  # a replayed token: its random draw, history and grammar step, as first chosen
    explain: Explain
    node: NodeChain | None = None  # its sampler on the node, while the engine takes it; else it chooses here
    draft: Draft | None = None     # drafts its next tokens (speculative decoding); None: one token per step
    started: float = field(default_factory=time.perf_counter)
    n_past: int = 0            # tokens in its KV cells
    evaluated: int = 0         # of the prompt
    shared: int = 0            # of the prompt, copied from another sequence's cells instead of evaluated
    done_replaying: int = 0    # of request.replay
    pending: int | None = None  # the token it generated last, to evaluate next
    generated: int = 0
    drafted: int = 0           # drafted tokens verified
    accepted: int = 0          # of those, kept
    draft_s: float = 0.0       # spent drafting, before the steps the drafts rode
    prompt_done: float | None = None
    reported: float = field(default_factory=time.perf_counter)
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    @property
    def rid(self) -> int:
        """The request's id."""
        return self.request.id

    @property
    def prompting(self) -> bool:
        """Whether its prompt is still being evaluated."""
        return self.evaluated < len(self.prompt)


@dataclass
class _Planned:
    """What a batch entry does for its slot once the step is done."""

    slot: Slot
    index: int
    kind: str  # prompt | replay | decode
    count: int = 1
    drafts: tuple[int, ...] = ()  # of a decode: the tokens drafted after its token, at the next indexes


class Scheduler:
    """Admits requests into free slots and steps every slot in flight, one batch per step."""

    def __init__(self, engine: Engine, parallel: int, emit: Callable[[Answer], None], requests: Requests) -> None:
        """``emit``: an answer to the controller."""
        self.engine = engine
        self.slots: list[Slot | None] = [None] * parallel
        self.waiting: deque[Slot] = deque()  # admitted by the coordinator, no free slot yet
        self.emit = emit
        self._cancelled = requests.cancelled
        self._closed = requests.closed

    @property
    def busy(self) -> bool:
        """Whether any request is in flight or waiting."""
        return bool(self.waiting) or any(slot is not None for slot in self.slots)

    def add(self, slot: Slot) -> None:
        """Queue a prepared request; it starts as soon as a slot is free."""
        self.emit(PromptTokens(slot.rid, slot.prompt))
        self.waiting.append(slot)

    def step(self) -> None:
        """Admit, drop the cancelled, decode one batch, and take its results. Raises PersistentComputeFailure."""
        self._admit()
        for slot in [slot for slot in self.slots if slot is not None and self._cancelled(slot.rid)]:
            self._finish(slot, "cancelled")
        entries, planned = self._batch()
        if not entries:
            return
        try:
            self._decode(entries, planned)
        except RuntimeError as exc:  # no worker reported it: the batch's requests fail, the others go on
            for plan in planned:
                if self.slots[plan.slot.seq] is plan.slot:
                    self.emit(Failed(str(exc), plan.slot.rid))
                    self._release(plan.slot)
            return
        for plan in planned:
            try:
                self._advance(plan, len(planned))
            except RuntimeError as exc:  # this request's result is unusable: it fails, the others go on
                if self.slots[plan.slot.seq] is plan.slot:
                    self.emit(Failed(str(exc), plan.slot.rid))
                    self._release(plan.slot)

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            slot = self.waiting.popleft()
            slot.seq = self.slots.index(None)
            slot.started = slot.reported = time.perf_counter()
            self.engine.forget(slot.seq, 0)
            if slot.node is not None and not self.engine.attach(slot.seq, slot.node):
                slot.node = None  # the output layer's device cannot run it: the logits come here
            self.slots[slot.seq] = slot
            if self._cancelled(slot.rid):
                self._finish(slot, "cancelled")
        for slot in list(self.waiting):
            if self._cancelled(slot.rid):
                self.waiting.remove(slot)
                self.emit(Done(slot.rid, "cancelled", "", len(slot.prompt), 0, 0, 0.0, 0.0))
                self._closed(slot.rid)

    def _batch(self) -> tuple[list[Entry], list[_Planned]]:
        entries: list[Entry] = []
        planned: list[_Planned] = []
        active = [slot for slot in self.slots if slot is not None]
        # Drafts fill the rows the step's own tokens leave below INVARIANT_ROWS, so that a kept draft's token has
        # the logits it would have had decoded alone (they never take a row another slot's token needs).
        spare = INVARIANT_ROWS - sum(not slot.prompting for slot in active)
        for slot in active:
            if slot.prompting:
                continue
            if slot.done_replaying < len(slot.request.replay):
                token = slot.request.replay[slot.done_replaying]
                last = slot.done_replaying == len(slot.request.replay) - 1
                planned.append(_Planned(slot, len(entries), "replay"))
                entries.append(Entry(token, slot.n_past, slot.seq, last))
            elif slot.pending is not None:
                drafts = self._drafts(slot, spare)  # INVARIANT_ROWS rows always fit in a batch
                spare -= len(drafts)
                planned.append(_Planned(slot, len(entries), "decode", 1 + len(drafts), drafts))
                for offset, token in enumerate((slot.pending, *drafts)):
                    entries.append(Entry(token, slot.n_past + offset, slot.seq, True))
        prompting = sorted((slot for slot in active if slot.prompting), key=lambda slot: slot.started)
        for index, slot in enumerate(prompting):
            room = self.engine.n_batch - len(entries)
            if room <= 0:
                break
            if slot.evaluated == 0 and self._share(slot, prompting[:index]):
                continue  # an older prompt is evaluating what this one would copy
            chunk = slot.prompt[slot.evaluated:slot.evaluated + room]
            for offset, token in enumerate(chunk):
                entries.append(Entry(token, slot.n_past + offset, slot.seq, offset == len(chunk) - 1))
            planned.append(_Planned(slot, len(entries) - 1, "prompt", len(chunk)))
        return entries, planned

    @staticmethod
    def _drafts(slot: Slot, room: int) -> tuple[int, ...]:
        """The tokens drafted after ``slot``'s next: as many as its budget and the step's ``room`` allow."""
        room = min(slot.budget - slot.generated - 1, room)
        if slot.draft is None or room <= 0:
            return ()
        started = time.perf_counter()
        drafts = tuple(slot.draft.propose(room))
        slot.draft_s += time.perf_counter() - started
        return drafts

    def _share(self, slot: Slot, older: list[Slot]) -> bool:
        """Start ``slot``'s prompt from a copy of the longest prefix of it that another sequence's cells hold, when
        that is worth a copy. True: an older prompt still being evaluated will hold more of it, so wait for that."""
        wanted = slot.prompt[:-1]  # its last token is evaluated in any case: its logits give the first token
        held, donor = 0, None
        for other in self.slots:
            if other is not None and other is not slot:
                common = common_prefix(wanted, other.prompt[:other.evaluated])
                if common > held:
                    held, donor = common, other
        for other in older:
            coming = common_prefix(wanted, other.prompt)
            if coming > held and _worth_sharing(coming, len(wanted)):
                return True
        if donor is not None and _worth_sharing(held, len(wanted)):
            self.engine.copy(donor.seq, slot.seq, held)
            slot.evaluated = slot.n_past = slot.shared = held
        return False

    def _decode(self, entries: list[Entry], planned: list[_Planned]) -> None:
        """Decode one batch; a batch a worker reports failed is decoded again (its cells dropped first)."""
        engine = self.engine
        first_seen: float | None = None
        failed_on = ""
        rid: int | None = None  # the request a report names, when the step holds one (found once a step fails)
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            status = engine.decode(entries)
            engine.synchronize()  # what reading the logits waits for anyway
            failure = engine.take_failure()
            if failure is None:
                if status != 0:
                    raise RuntimeError(f"llama_decode returned {status}")
                if first_seen is not None:
                    self.emit(ComputeRetried(failed_on, attempt, (time.perf_counter() - first_seen) * 1000, rid))
                return
            if first_seen is None:
                first_seen = time.perf_counter()
                rids = {plan.slot.rid for plan in planned}
                rid = next(iter(rids)) if len(rids) == 1 else None
            failed_on = failure.endpoint
            for seq in {entry.seq for entry in entries}:  # llama_decode may have kept some: drop them all
                engine.forget(seq, min(entry.pos for entry in entries if entry.seq == seq))
            persistent = attempt == len(RETRY_DELAYS_S)
            self.emit(ComputeFailed(failure.endpoint, failure.device, failure.status, failure.failures,
                                    attempt + 1, rid, persistent))
            if persistent:
                raise PersistentComputeFailure(f"{failure.endpoint} failed the same step {attempt + 1} times")
            time.sleep(RETRY_DELAYS_S[attempt])

    def _advance(self, plan: _Planned, batch: int) -> None:
        """Take a step's result for one slot; ``batch``: the sequences that step carried."""
        slot = plan.slot
        if self.slots[slot.seq] is not slot:
            return
        slot.n_past += plan.count
        if plan.kind == "prompt":
            slot.evaluated += plan.count
            self.emit(Progress(slot.rid, "prompt", slot.evaluated, len(slot.prompt)))
            if slot.prompting:
                return
            if slot.request.replay:
                return  # its replay starts with the next step
        elif plan.kind == "replay":
            token = slot.request.replay[slot.done_replaying]
            slot.done_replaying += 1
            if slot.node is None:  # a sampler on the node took its replayed draws before the first step
                slot.replayed(token)
            slot.decoder.decode(self.engine.text(token))
            total = len(slot.request.replay)
            if slot.done_replaying == total or time.perf_counter() - slot.reported >= PROGRESS_INTERVAL_S:
                self.emit(Progress(slot.rid, "replay", slot.done_replaying, total))
                slot.reported = time.perf_counter()
            if slot.done_replaying < total:
                return
        if slot.prompt_done is None:
            slot.prompt_done = time.perf_counter()
        slot.drafted += len(plan.drafts)  # before a token that ends the request reports the counts
        chosen = self._sample(slot, plan.index, batch)
        if plan.drafts:
            self._verify(slot, plan, chosen, batch)

    def _verify(self, slot: Slot, plan: _Planned, token: int | None, batch: int) -> None:
        """Keep the drafts the model chose too (``token``: its choice after the slot's own token), each with its
        choice after it; drop the rest's KV cells."""
        kept = 0
        for draft in plan.drafts:
            if token != draft:
                break
            kept += 1
            slot.accepted += 1
            token = self._sample(slot, plan.index + kept, batch)
        if slot.draft is not None:
            slot.draft.judged(len(plan.drafts), kept)
        if kept < len(plan.drafts) and self.slots[slot.seq] is slot:
            slot.n_past -= len(plan.drafts) - kept
            self.engine.forget(slot.seq, slot.n_past)

    def _sample(self, slot: Slot, index: int, batch: int) -> int | None:
        """The slot's next token from the logits at ``index`` of a step that carried ``batch`` sequences; None:
        it ended."""
        slot.pending = None
        if slot.generated >= slot.budget:
            self._finish(slot, "length")
            return None
        node, top_n = slot.node, slot.request.logprobs
        found: Logprobs | None = None
        if node is not None:
            token = self.engine.sampled(index)
            if token < 0:
                raise RuntimeError("the output layer's node returned no sampled token")
            if top_n is not None:
                report = self.engine.sampled_report(index)
                if report is None:
                    raise RuntimeError("the output layer's node returned no logprobs")
                found = reported_logprobs(report, top_n)
        else:
            logits = self.engine.logits(index)
            token = slot.choose(logits)
            found = logprobs(logits, token, top_n) if top_n is not None else None  # before the next step's logits
        if self.engine.is_end(token):
            self._finish(slot, "stop")
            return None
        (node.accept if node is not None else slot.accept)(token)
        slot.generated += 1
        self.emit(Token(slot.rid, token, slot.decoder.decode(self.engine.text(token)),
                        slot.explain(token, found) if found is not None else None, batch))
        if slot.draft is not None:
            slot.draft.add(token)
        if slot.generated < slot.budget:
            slot.pending = token
            return token
        self._finish(slot, "length")
        return None

    def _finish(self, slot: Slot, reason: str) -> None:
        finished = time.perf_counter()
        prompt_done = slot.prompt_done or finished
        self.emit(Done(slot.rid, reason, slot.decoder.decode(b"", final=True), prompt_tokens=len(slot.prompt),
                       replayed_tokens=len(slot.request.replay), completion_tokens=slot.generated,
                       prompt_s=prompt_done - slot.started, decode_s=finished - prompt_done,
                       shared_tokens=slot.shared, sampled_on="node" if slot.node is not None else "coordinator",
                       drafted=slot.drafted, accepted=slot.accepted, draft_s=slot.draft_s))
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        if slot.node is not None:
            self.engine.detach(slot.seq)
        if slot.draft is not None:
            slot.draft.release()
        self.engine.forget(slot.seq, 0)
        self.slots[slot.seq] = None
        self._closed(slot.rid)


def common_prefix(first: list[int], second: list[int]) -> int:
    """How many tokens the two lists share from the start."""
    for index, (one, other) in enumerate(zip(first, second, strict=False)):
        if one != other:
            return index
    return min(len(first), len(second))


def _worth_sharing(common: int, wanted: int) -> bool:
    """Whether a prefix of ``common`` tokens (of the ``wanted`` a prompt could share) is worth a copy."""
    return common > 0 and (common >= SHARE_MIN_TOKENS or common == wanted)
