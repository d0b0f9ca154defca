"""Speculative decoding: n-gram drafts (core.engine.speculation) and their verification in one step
(core.engine.slots), against a stand-in model whose next token is a function of the sequence so far."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from core.engine.protocol import Answer, ComputeFailed, Done, Generate, Token
from core.engine.slots import Scheduler, Slot
from core.engine.speculation import NgramDraft
from core.engine.step import Entry
from core.model import DRAFT_MAX, INVARIANT_ROWS
from tests.test_slots import FakeEngine, Ids, OnNode

VOCAB = 64


class ScriptEngine(FakeEngine):
    """A model that continues each sequence with ``script(tokens)``, from the tokens its KV cells hold.

    It keeps each sequence's cells as llama.cpp does (a position is written by a decode, dropped by ``forget``),
    and checks that every batch writes a sequence's cells right after those it holds: a draft left in the cells
    after it was rejected, or a position skipped, fails the test.
    """

    def __init__(self, script: Callable[[list[int]], int], n_batch: int = 512) -> None:
        super().__init__(n_vocab=VOCAB, n_batch=n_batch)
        self.script = script
        self.cells: dict[int, list[int]] = {}

    def decode(self, entries: list[Entry]) -> int:
        status = super().decode(entries)
        for entry in entries:
            cells = self.cells.setdefault(entry.seq, [])
            assert entry.pos == len(cells), (entry, len(cells))
            cells.append(entry.token)
        return status

    def forget(self, seq: int, start: int) -> None:
        super().forget(seq, start)
        del self.cells.setdefault(seq, [])[start:]

    def copy(self, source: int, target: int, length: int) -> None:
        super().copy(source, target, length)
        self.cells[target] = self.cells[source][:length]

    def _next(self, index: int) -> int:
        entry = self.batches[-1][index]
        return int(self.script(self.cells[entry.seq][:entry.pos + 1]))

    def logits(self, index: int) -> np.ndarray:
        row = np.zeros(VOCAB, dtype=np.float32)
        row[self._next(index)] = 1.0
        return row

    def sampled(self, index: int) -> int:
        assert self.batches[-1][index].seq in self.attached
        return self._next(index)

    def sampled_report(self, index: int) -> np.ndarray | None:
        return None


def repeating(tokens: list[int]) -> int:
    """A text that repeats: 10 11 12 13 14 15 16 17, over and over."""
    return 10 + (tokens[-1] - 9) % 8 if tokens[-1] >= 10 else 10


def counting(tokens: list[int]) -> int:
    """A text with nothing to copy: every token new (wrapping over the vocabulary only after 40)."""
    return 20 + len(tokens) % 40


def drafting(rid: int, prompt: list[int], max_tokens: int, *, replay: list[int] | None = None,
             limit: int = DRAFT_MAX) -> Slot:
    replay = replay or []
    return Slot(Generate(rid, max_tokens, prompt_tokens=prompt, replay=replay), seq=-1, prompt=prompt,
                budget=max_tokens - len(replay), choose=lambda logits: int(np.argmax(logits)),
                accept=lambda _token: None, replayed=lambda _token: None, explain=lambda _token, _found: {},  # type: ignore[typeddict-item]
                draft=NgramDraft(prompt + replay, limit) if limit else None)


def generate(engine: ScriptEngine, *slots: Slot, parallel: int = 1) -> list[Answer]:
    events: list[Answer] = []
    made = Scheduler(engine, parallel, events.append, Ids())
    for each in slots:
        made.add(each)
    while made.busy:
        made.step()
    return events


def tokens(events: list[Answer], rid: int) -> list[int]:
    return [event.token for event in events if isinstance(event, Token) and event.id == rid]


def done(events: list[Answer], rid: int) -> Done:
    return next(event for event in events if isinstance(event, Done) and event.id == rid)


PROMPT = [1, 10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]


def test_a_draft_is_what_followed_the_sequences_end_where_it_occurred_before() -> None:
    draft = NgramDraft([1, 2, 3, 4, 5, 6, 9, 2, 3, 4])
    assert draft.propose(3) == [5, 6, 9]
    assert NgramDraft([1, 2, 3, 4, 5, 6]).propose(8) == []  # the end never occurred before
    assert NgramDraft([7, 1, 2, 8, 1, 2]).propose(8) == []  # two tokens in common: too common a phrase to trust


def test_the_latest_occurrence_wins_and_a_repeating_pattern_drafts_whole_periods() -> None:
    assert NgramDraft([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]).propose(2) == [5, 1]
    assert NgramDraft([4, 5, 6, 4, 5, 6], limit=7).propose(7) == [4, 5, 6, 4, 5, 6, 4]


def test_a_draft_grows_with_what_was_kept_and_shrinks_to_one_after_a_miss() -> None:
    draft = NgramDraft(PROMPT, limit=8)
    assert len(draft.propose(100)) == 8
    draft.judged(8, 0)
    assert len(draft.propose(100)) == 1
    draft.judged(1, 1)
    assert len(draft.propose(100)) == 3
    draft.judged(3, 3)
    assert len(draft.propose(100)) == 7
    draft.judged(7, 7)
    assert len(draft.propose(100)) == 8  # its limit


def test_drafts_are_verified_in_one_step_and_the_text_is_what_one_token_per_step_gives() -> None:
    plain = generate(ScriptEngine(repeating), drafting(1, PROMPT, 40, limit=0))
    engine = ScriptEngine(repeating)
    fast = generate(engine, drafting(1, PROMPT, 40))
    assert tokens(fast, 1) == tokens(plain, 1)
    assert len(tokens(fast, 1)) == 40
    decode_steps = len(engine.batches) - 1  # the first step is the prompt's
    assert decode_steps <= -(-39 // (1 + DRAFT_MAX)) + 1, decode_steps  # 1 + DRAFT_MAX tokens a step, not 39 steps
    finished = done(fast, 1)
    assert finished.completion_tokens == 40 and finished.accepted == 40 - 1 - decode_steps
    assert finished.drafted >= finished.accepted > 25


def test_with_nothing_to_copy_nothing_is_drafted_and_the_text_is_unchanged() -> None:
    plain = generate(ScriptEngine(counting), drafting(1, [1, 2, 3], 30, limit=0))
    engine = ScriptEngine(counting)
    spec = generate(engine, drafting(1, [1, 2, 3], 30))
    assert tokens(spec, 1) == tokens(plain, 1)
    assert all(len(batch) == 1 for batch in engine.batches[1:])
    assert done(spec, 1).drafted == 0


def test_rejected_drafts_leave_no_cells_and_the_models_own_token_is_kept() -> None:
    # After 30 tokens the text changes its pattern: the drafts from the old one are rejected at once.
    def changing(tokens: list[int]) -> int:
        return repeating(tokens) if len(tokens) < len(PROMPT) + 30 else 40 + len(tokens) % 3

    plain = generate(ScriptEngine(changing), drafting(1, PROMPT, 60, limit=0))
    engine = ScriptEngine(changing)  # it asserts that no batch writes over a rejected draft's cell
    spec = generate(engine, drafting(1, PROMPT, 60))
    assert tokens(spec, 1) == tokens(plain, 1)
    assert done(spec, 1).drafted > done(spec, 1).accepted
    assert any(start > 0 for _, start in engine.forgotten)


def test_drafts_never_take_the_request_past_its_budget() -> None:
    for budget in (1, 2, 5, 9, 10):
        engine = ScriptEngine(repeating)
        events = generate(engine, drafting(1, PROMPT, budget))
        assert len(tokens(events, 1)) == budget
        assert done(events, 1).reason == "length"
        assert all(len(batch) <= budget for batch in engine.batches[1:])


def test_an_end_token_inside_the_kept_drafts_ends_the_request_there() -> None:
    engine = ScriptEngine(repeating)
    engine.ends = {15}
    events = generate(engine, drafting(1, PROMPT, 40))
    assert tokens(events, 1) == [13, 14]
    assert done(events, 1).reason == "stop"


def test_slots_in_flight_verify_their_drafts_in_the_same_step() -> None:
    plain = generate(ScriptEngine(repeating), drafting(1, PROMPT, 30, limit=0), drafting(2, PROMPT[:-1], 30, limit=0),
                     parallel=2)
    engine = ScriptEngine(repeating)
    spec = generate(engine, drafting(1, PROMPT, 30), drafting(2, PROMPT[:-1], 30), parallel=2)
    for rid in (1, 2):
        assert tokens(spec, rid) == tokens(plain, rid)
    assert any(len({entry.seq for entry in batch}) == 2 and len(batch) > 2 for batch in engine.batches)


def test_drafts_leave_room_in_the_batch_for_every_other_slot() -> None:
    engine = ScriptEngine(repeating, n_batch=6)
    spec = generate(engine, drafting(1, PROMPT[-4:], 20), drafting(2, PROMPT[-5:], 20), drafting(3, [1, 10], 20),
                    parallel=3)
    assert all(len(batch) <= 6 for batch in engine.batches)
    plain = generate(ScriptEngine(repeating), drafting(1, PROMPT[-4:], 20, limit=0),
                     drafting(2, PROMPT[-5:], 20, limit=0), drafting(3, [1, 10], 20, limit=0), parallel=3)
    for rid in (1, 2, 3):
        assert tokens(spec, rid) == tokens(plain, rid)


def test_a_node_sampler_verifies_the_drafts_and_accepts_each_kept_token_once() -> None:
    engine = ScriptEngine(repeating)
    made = drafting(1, PROMPT, 30)
    node = OnNode()
    made.node = node
    events = generate(engine, made)
    assert tokens(events, 1) == tokens(generate(ScriptEngine(repeating), drafting(1, PROMPT, 30, limit=0)), 1)
    assert node.accepted == tokens(events, 1)  # a rejected draft's output is never accepted: its draw not taken
    assert done(events, 1).sampled_on == "node" and done(events, 1).accepted > 20


def test_a_verify_step_a_worker_reports_failed_is_retried_and_the_text_is_unchanged() -> None:
    engine = ScriptEngine(repeating)
    engine.failing = {3, 4}
    events = generate(engine, drafting(1, PROMPT, 40))
    assert tokens(events, 1) == tokens(generate(ScriptEngine(repeating), drafting(1, PROMPT, 40, limit=0)), 1)
    assert sum(isinstance(event, ComputeFailed) for event in events) == 2
    assert len(engine.batches[3]) > 1  # a step that carried drafts


def test_a_resumed_request_drafts_from_its_replayed_tokens_too() -> None:
    first = tokens(generate(ScriptEngine(repeating), drafting(1, PROMPT, 30, limit=0)), 1)
    engine = ScriptEngine(repeating)
    resumed = generate(engine, drafting(1, PROMPT, 30, replay=first[:12]))
    assert first[:12] + tokens(resumed, 1) == first
    replay_steps = 1 + 12  # the prompt, then each replayed token alone, as first decoded
    assert len(engine.batches[replay_steps]) > 1  # its first new step already carries drafts


def test_drafts_only_fill_the_rows_that_keep_every_tokens_logits_its_own() -> None:
    # Two slots generating: one step holds at most INVARIANT_ROWS rows of their tokens and drafts together; four
    # slots fill them with their own tokens, and nothing is drafted.
    for parallel in (2, 4):
        engine = ScriptEngine(repeating)
        prompts = [PROMPT[-4:], PROMPT[-5:], PROMPT[-6:], PROMPT[-7:]][:parallel]
        spec = generate(engine, *(drafting(rid, prompt, 20) for rid, prompt in enumerate(prompts)),
                        parallel=parallel)
        decode_steps = [batch for batch in engine.batches if len({entry.seq for entry in batch}) == parallel
                        and all(entry.logits for entry in batch)]
        assert decode_steps and all(len(batch) <= max(INVARIANT_ROWS, parallel) for batch in decode_steps)
        drafted = sum(done(spec, rid).drafted for rid in range(parallel))
        assert drafted > 0 if parallel == 2 else drafted == 0
