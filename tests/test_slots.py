"""The coordinator's slots and continuous batching (core.engine.slots), against a stand-in for llama.cpp's context:
what goes into each batch, progress, timing, cancels, and retries of a step a worker reported failed."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

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
)
from core.engine.sampling import Logprobs
from core.engine.slots import RETRY_DELAYS_S, SHARE_MIN_TOKENS, PersistentComputeFailure, Scheduler, Slot
from core.engine.step import ComputeFailure, Entry

CONTEXT = 4096


class FakeEngine:
    """Just enough of a llama.cpp context: a graph that goes on running after ``decode`` returns, as RPC's does;
    sequence s always predicts token 5 + s."""

    def __init__(self, graph_s: float = 0.0, n_batch: int = 512, n_vocab: int = 16) -> None:
        self.n_batch = n_batch
        self.graph_s = graph_s
        self.ready_at = 0.0
        self.n_vocab = n_vocab
        self.batches: list[list[Entry]] = []
        self.forgotten: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int, int]] = []  # (source, target, length)
        self.statuses: dict[int, int] = {}  # decode index → llama_decode's status
        self.failing: set[int] = set()      # decode indexes a worker reports failed
        self.ends: set[int] = set()         # tokens that end generation
        self.attached: dict[int, object] = {}  # seq → its sampler on the node, which always picks 9 + seq
        self.refuse: bool = False           # the output layer's device cannot run a node sampler
        self.unsampled: set[int] = set()    # sequences whose node returns no token
        self.unreported: set[int] = set()   # sequences whose node returns no logprobs

    def decode(self, entries: list[Entry]) -> int:
        self.batches.append(list(entries))
        self.ready_at = time.monotonic() + self.graph_s
        return self.statuses.get(len(self.batches) - 1, 0)

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))

    def take_failure(self) -> ComputeFailure | None:
        step = len(self.batches) - 1
        if step in self.failing:
            self.failing.discard(step)
            return ComputeFailure("127.0.0.1:50052", 0, -1, 1)
        return None

    def logits(self, index: int) -> np.ndarray:
        row = np.zeros(self.n_vocab, dtype=np.float32)
        row[5 + self.batches[-1][index].seq] = 1.0
        return row

    def forget(self, seq: int, start: int) -> None:
        self.forgotten.append((seq, start))

    def copy(self, source: int, target: int, length: int) -> None:
        self.copies.append((source, target, length))

    def text(self, token: int) -> bytes:
        return b" w%d" % token

    def attach(self, seq: int, sampler: object) -> bool:
        if not self.refuse:
            self.attached[seq] = sampler
        return not self.refuse

    def detach(self, seq: int) -> None:
        del self.attached[seq]

    def sampled(self, index: int) -> int:
        seq = self.batches[-1][index].seq
        assert seq in self.attached
        return -1 if seq in self.unsampled else 9 + seq

    def sampled_report(self, index: int) -> np.ndarray | None:
        """The node's logprobs: the token it picks at 1/2, then 2 at 1/4 and the token itself in no order."""
        seq = self.batches[-1][index].seq
        return None if seq in self.unreported else np.array([0.5, 0.25, 0.5, 2, 9 + seq], dtype=np.float32)

    def is_end(self, token: int) -> bool:
        return token in self.ends


class Ids:
    """Which requests were cancelled, and which are done."""

    def __init__(self) -> None:
        self.cancel: set[int] = set()
        self.done: list[int] = []

    def cancelled(self, rid: int) -> bool:
        return rid in self.cancel

    def closed(self, rid: int) -> None:
        self.done.append(rid)


def slot(rid: int, prompt: list[int], max_tokens: int, replay: list[int] | None = None,
         logprobs: int | None = None) -> Slot:
    replay = replay or []
    return Slot(Generate(rid, max_tokens, prompt_tokens=prompt, replay=replay, logprobs=logprobs), seq=-1,
                prompt=prompt,
                budget=min(max_tokens, CONTEXT - len(prompt)) - len(replay),
                choose=lambda logits: int(np.argmax(logits)), accept=lambda _token: None,
                replayed=lambda _token: None, explain=explained)


def explained(_token: int, found: Logprobs) -> Any:
    """Logprobs as a test compares them."""
    return {"logprob": found.logprob, "top": found.top}


class OnNode:
    """A node sampler's record of what it was told."""

    chain = None

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    def replayed(self, token: int) -> None:
        self.accepted.append(token)

    def on_backend(self) -> bool:
        return True


def on_node(made: Slot) -> tuple[Slot, OnNode]:
    node = OnNode()
    made.node = node
    return made, node


def scheduler(engine: FakeEngine, parallel: int = 1) -> tuple[Scheduler, list[Answer], Ids]:
    events: list[Answer] = []
    ids = Ids()
    return Scheduler(engine, parallel, events.append, ids), events, ids


def run(made: Scheduler, *slots: Slot) -> None:
    for each in slots:
        made.add(each)
    while made.busy:
        made.step()


def tokens(events: list[Answer], rid: int) -> list[int]:
    return [event.token for event in events if isinstance(event, Token) and event.id == rid]


def shapes(engine: FakeEngine) -> list[list[tuple[int, int]]]:
    """Each batch as (sequence, tokens of it)."""
    out = []
    for batch in engine.batches:
        counts: dict[int, int] = {}
        for entry in batch:
            counts[entry.seq] = counts.get(entry.seq, 0) + 1
        out.append(sorted(counts.items()))
    return out


def test_prompt_time_covers_the_whole_graph_not_only_the_call_that_starts_it() -> None:
    made, events, _ = scheduler(FakeEngine(graph_s=0.3))
    run(made, slot(7, [1, 2, 3], 1))
    done = events[-1]
    assert isinstance(done, Done) and done.completion_tokens == 1
    assert done.prompt_s >= 0.3, done  # the graph was still running when decode() returned
    assert done.decode_s < 0.3, done


def test_a_long_prompt_is_evaluated_in_batches_and_each_is_reported() -> None:
    engine = FakeEngine()
    made, events, _ = scheduler(engine)
    run(made, slot(7, [1] * 1300, 2))
    assert [len(batch) for batch in engine.batches[:3]] == [512, 512, 276]  # n_batch, as Llama.eval batches it
    assert [entry.logits for entry in engine.batches[2]] == [False] * 275 + [True]
    progress = [event for event in events if isinstance(event, Progress)]
    assert [(event.phase, event.done, event.total) for event in progress] == [
        ("prompt", 512, 1300), ("prompt", 1024, 1300), ("prompt", 1300, 1300)]
    assert isinstance(events[0], PromptTokens)


def test_a_replay_goes_one_token_at_a_time_as_first_decoded_and_reports_progress() -> None:
    engine = FakeEngine(graph_s=0.01)
    made, events, _ = scheduler(engine)
    run(made, slot(7, [1, 2, 3], 82, replay=[5] * 80))
    assert [[entry.token for entry in batch] for batch in engine.batches[1:81]] == [[5]] * 80
    assert [entry.pos for batch in engine.batches[1:81] for entry in batch] == list(range(3, 83))
    progress = [event for event in events if isinstance(event, Progress) and event.phase == "replay"]
    assert progress and progress[-1].done == 80 and progress[-1].total == 80
    assert len(progress) < 80  # reported every so often, not a line per token
    assert tokens(events, 7) == [5, 5]  # two more after the 80 replayed
    done = events[-1]
    assert isinstance(done, Done) and (done.replayed_tokens, done.completion_tokens) == (80, 2)


def test_each_decode_step_carries_the_next_token_of_every_request_in_flight() -> None:
    engine = FakeEngine()
    made, events, ids = scheduler(engine, parallel=2)
    run(made, slot(1, [1, 2, 3], 3), slot(2, [4, 5], 3), slot(3, [6], 2))
    # 1's and 2's prompts together (they came together), then both decode together; 3 waits for a free slot
    # (its KV cells are the freed sequence's).
    assert shapes(engine) == [[(0, 3), (1, 2)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1)], [(0, 1)]]
    assert tokens(events, 1) == [5, 5, 5] and tokens(events, 2) == [6, 6, 6] and tokens(events, 3) == [5, 5]
    # Each token says how many sequences its step carried: the record that they were decoded together.
    assert [(event.id, event.batch) for event in events if isinstance(event, Token)] == [
        (1, 2), (2, 2), (1, 2), (2, 2), (1, 2), (2, 2), (3, 1), (3, 1)]
    assert ids.done == [1, 2, 3]
    assert (0, 0) in engine.forgotten and (1, 0) in engine.forgotten  # freed at once


def test_a_long_prompt_arriving_is_chunked_between_the_others_tokens() -> None:
    engine = FakeEngine(n_batch=8)
    made, events, _ = scheduler(engine, parallel=2)
    made.add(slot(1, [1, 2], 10))
    made.step()
    made.step()  # 1 is generating
    made.add(slot(2, list(range(100, 120)), 2))
    while made.busy:
        made.step()
    assert shapes(engine)[2:5] == [[(0, 1), (1, 7)], [(0, 1), (1, 7)], [(0, 1), (1, 6)]]
    assert len(tokens(events, 1)) == 10 and len(tokens(events, 2)) == 2


def test_a_prompt_arriving_while_others_generate_rides_with_their_tokens() -> None:
    engine = FakeEngine()
    made, events, _ = scheduler(engine, parallel=2)
    made.add(slot(1, [1, 2, 3], 3))
    made.step()
    made.add(slot(2, [4, 5], 2))
    run(made)
    assert shapes(engine) == [[(0, 3)], [(0, 1), (1, 2)], [(0, 1), (1, 1)]]
    assert tokens(events, 1) == [5, 5, 5] and tokens(events, 2) == [6, 6]


def test_the_choices_of_one_prompt_evaluate_it_once_and_copy_its_cells() -> None:
    engine = FakeEngine()
    made, events, _ = scheduler(engine, parallel=3)
    prompt = list(range(100, 110))
    run(made, slot(1, prompt, 2), slot(2, prompt, 2), slot(3, prompt, 2))
    # The prompt once, for the first; the others wait for it, copy all of it but the last token and evaluate that
    # one for their own logits, beside the first's next token.
    assert shapes(engine)[:2] == [[(0, 10)], [(0, 1), (1, 1), (2, 1)]]
    assert engine.copies == [(0, 1, 9), (0, 2, 9)]
    assert [(entry.seq, entry.token, entry.pos) for entry in engine.batches[1][1:]] == [(1, 109, 9), (2, 109, 9)]
    done = {event.id: event for event in events if isinstance(event, Done)}
    assert [done[rid].shared_tokens for rid in (1, 2, 3)] == [0, 9, 9]
    assert [done[rid].prompt_tokens for rid in (1, 2, 3)] == [10, 10, 10]
    assert tokens(events, 2) == [6, 6] and tokens(events, 3) == [7, 7]


def test_a_long_shared_prefix_is_copied_and_only_the_rest_evaluated() -> None:
    engine = FakeEngine()
    made, _, _ = scheduler(engine, parallel=2)
    system = list(range(100, 100 + SHARE_MIN_TOKENS + 8))
    made.add(slot(1, [*system, 1, 2], 4))
    made.step()
    made.add(slot(2, [*system, 3, 4, 5], 2))
    run(made)
    assert engine.copies == [(0, 1, len(system))]
    assert [(entry.seq, entry.token) for entry in engine.batches[1]] == [(0, 5), (1, 3), (1, 4), (1, 5)]
    assert [entry.pos for entry in engine.batches[1][1:]] == [len(system), len(system) + 1, len(system) + 2]


def test_a_short_shared_prefix_is_evaluated_again_beside_the_other_prompt() -> None:
    engine = FakeEngine()
    made, _, _ = scheduler(engine, parallel=2)
    run(made, slot(1, [1, 2, 3, 4, 7], 2), slot(2, [1, 2, 3, 4, 8, 9], 2))
    assert engine.copies == [] and shapes(engine)[0] == [(0, 5), (1, 6)]


def test_a_prompt_waiting_to_share_evaluates_its_own_when_the_other_is_cancelled() -> None:
    engine = FakeEngine(n_batch=8)
    made, events, ids = scheduler(engine, parallel=2)
    prompt = list(range(100, 120))
    made.add(slot(1, prompt, 2))
    made.add(slot(2, prompt, 2))
    made.step()  # 1's first chunk; 2 waits to copy it
    ids.cancel.add(1)
    run(made)
    assert engine.copies == [] and tokens(events, 2) == [6, 6]
    assert [(entry.seq, entry.pos) for entry in engine.batches[1]] == [(1, pos) for pos in range(8)]


def test_a_failed_step_after_a_copy_keeps_the_copied_cells() -> None:
    engine = FakeEngine()
    engine.failing = {1}  # the step that evaluates the copies' last prompt token
    made, events, _ = scheduler(engine, parallel=2)
    prompt = list(range(100, 110))
    run(made, slot(1, prompt, 2), slot(2, prompt, 2))
    assert engine.copies == [(0, 1, 9)]
    # Admitted, then the failed step's cells only (the copy's stay), then freed at the end.
    assert engine.forgotten == [(0, 0), (1, 0), (0, 10), (1, 9), (0, 0), (1, 0)]
    assert tokens(events, 2) == [6, 6]


def test_a_cancel_frees_the_slot_and_its_cells_for_the_next_request() -> None:
    engine = FakeEngine()
    made, events, ids = scheduler(engine, parallel=1)
    made.add(slot(1, [1, 2], 100))
    made.add(slot(2, [3], 2))
    made.step()
    made.step()
    ids.cancel.add(1)
    while made.busy:
        made.step()
    done = [event for event in events if isinstance(event, Done)]
    assert [(event.id, event.reason) for event in done] == [(1, "cancelled"), (2, "length")]
    assert engine.forgotten.count((0, 0)) >= 2 and tokens(events, 2) == [5, 5]


def test_a_request_cancelled_while_it_waits_never_takes_a_slot() -> None:
    engine = FakeEngine()
    made, events, ids = scheduler(engine, parallel=1)
    made.add(slot(1, [1], 3))
    made.add(slot(2, [2], 3))
    ids.cancel.add(2)
    run(made)
    assert [(event.id, event.reason) for event in events if isinstance(event, Done)] == [(2, "cancelled"),
                                                                                        (1, "length")]
    assert all(entry.seq == 0 and entry.token != 2 for batch in engine.batches for entry in batch)


def test_a_step_reported_failed_with_its_logits_is_retried_in_place_and_the_text_is_unchanged() -> None:
    clean, clean_events, _ = scheduler(FakeEngine())
    run(clean, slot(7, [1, 2, 3], 4))
    engine = FakeEngine()
    engine.failing = {2}  # the step of the 2nd token
    made, events, _ = scheduler(engine)
    run(made, slot(7, [1, 2, 3], 4))
    assert tokens(events, 7) == tokens(clean_events, 7)
    assert [[entry.token for entry in batch] for batch in engine.batches] == [[1, 2, 3], [5], [5], [5], [5]]
    assert (0, 4) in engine.forgotten  # the failed step's cells, before it is decoded again
    failed = [event for event in events if isinstance(event, ComputeFailed | ComputeRetried)]
    assert len(failed) == 2 and isinstance(failed[0], ComputeFailed) and isinstance(failed[1], ComputeRetried)
    assert (failed[0].endpoint, failed[0].status, failed[0].attempt, failed[0].id, failed[0].persistent) == (
        "127.0.0.1:50052", -1, 1, 7, False)
    assert failed[1].attempts == 1 and failed[1].retry_ms >= 0 and failed[1].id == 7


def test_a_step_that_llama_decode_reports_failed_is_retried_in_place() -> None:
    engine = FakeEngine()
    engine.statuses, engine.failing = {0: -3}, {0}
    made, events, _ = scheduler(engine)
    run(made, slot(7, [1, 2, 3], 2))
    assert [[entry.token for entry in batch] for batch in engine.batches[:2]] == [[1, 2, 3], [1, 2, 3]]
    assert isinstance(events[-1], Done) and events[-1].completion_tokens == 2


def test_a_decode_error_that_no_worker_reported_fails_only_the_requests_in_that_batch() -> None:
    engine = FakeEngine()
    engine.statuses = {0: -3}
    made, events, ids = scheduler(engine)
    run(made, slot(7, [1, 2, 3], 2), slot(8, [4], 1))
    assert Failed("llama_decode returned -3", 7) in events
    assert tokens(events, 8) == [5] and ids.done == [7, 8]


def test_a_failure_that_persists_gives_up_after_the_retries_for_the_restart_path() -> None:
    engine = FakeEngine()
    engine.failing = set(range(100))
    made, events, _ = scheduler(engine)
    with pytest.raises(PersistentComputeFailure):
        run(made, slot(7, [1, 2, 3], 4))
    failed = [event for event in events if isinstance(event, ComputeFailed)]
    assert [event.attempt for event in failed] == list(range(1, len(RETRY_DELAYS_S) + 2))
    assert [event.persistent for event in failed] == [False] * len(RETRY_DELAYS_S) + [True]


def test_generation_ends_at_the_models_end_token_or_its_budget(monkeypatch: Any) -> None:
    engine = FakeEngine()
    engine.ends = {6}
    made, events, _ = scheduler(engine, parallel=2)
    run(made, slot(1, [1], 3), slot(2, [2], 3))  # sequence 1 predicts 6: the end at once
    done = {event.id: (event.reason, event.completion_tokens) for event in events if isinstance(event, Done)}
    assert done == {1: ("length", 3), 2: ("stop", 0)}


def test_a_slot_sampled_on_the_node_takes_the_nodes_token_and_its_sampler_leaves_with_it() -> None:
    engine = FakeEngine()
    made, events, _ = scheduler(engine, parallel=2)
    node_slot, node = on_node(slot(1, [1, 2], 3))
    run(made, node_slot, slot(2, [3], 2))
    assert tokens(events, 1) == [9, 9, 9] and node.accepted == [9, 9, 9]
    assert tokens(events, 2) == [6, 6]  # the other one chose from its logits
    done = {event.id: event.sampled_on for event in events if isinstance(event, Done)}
    assert done == {1: "node", 2: "coordinator"}
    assert engine.attached == {}


def test_a_node_that_cannot_run_the_sampler_leaves_the_request_to_the_logits() -> None:
    engine = FakeEngine()
    engine.refuse = True
    made, events, _ = scheduler(engine)
    node_slot, node = on_node(slot(1, [1, 2], 2))
    run(made, node_slot)
    assert tokens(events, 1) == [5, 5] and node.accepted == []
    assert [event.sampled_on for event in events if isinstance(event, Done)] == ["coordinator"]


def test_a_slot_sampled_on_the_node_takes_its_logprobs_from_the_nodes_report_likeliest_first() -> None:
    engine = FakeEngine()
    made, events, _ = scheduler(engine, parallel=2)
    run(made, on_node(slot(1, [1, 2], 2, logprobs=1))[0], slot(2, [3], 2, logprobs=0))
    chances = [event.logprobs for event in events if isinstance(event, Token)]
    assert chances.count({"logprob": pytest.approx(np.log(0.5)), "top": [(9, pytest.approx(np.log(0.5)))]}) == 2
    # the other chose from its logits: token 6 of 16, its logit 1 and the others' 0
    assert chances.count({"logprob": pytest.approx(1 - np.log(np.e + 15)), "top": []}) == 2
    engine.unreported = {0, 1}
    run(made, on_node(slot(3, [1], 2, logprobs=0))[0])
    assert Failed("the output layer's node returned no logprobs", 3) in events


def test_a_node_that_returns_no_token_fails_that_request_alone() -> None:
    engine = FakeEngine()
    engine.unsampled = {0}
    made, events, ids = scheduler(engine, parallel=2)
    run(made, on_node(slot(1, [1, 2], 3))[0], slot(2, [3], 2))
    assert Failed("the output layer's node returned no sampled token", 1) in events
    assert tokens(events, 2) == [6, 6] and sorted(ids.done) == [1, 2] and engine.attached == {}
