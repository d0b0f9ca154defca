"""Drafts from a draft model (core.engine.draft_model) verified in the step (core.engine.slots), against stand-in
models whose next token is a function of the sequence so far; and the inventory's check that a draft model has the
model's vocabulary (core.model.check_draft_model), on synthetic GGUFs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from core.engine.draft_model import DraftModel, DraftSequence
from core.engine.slots import Slot
from core.engine.step import Entry
from core.errors import InventoryError
from core.inventory import parse_inventory
from core.model import DRAFT_MAX, check_draft_model, write_demo_model
from tests.test_speculation import PROMPT, ScriptEngine, counting, done, drafting, generate, repeating, tokens


class Confident(ScriptEngine):
    """A stand-in draft model that gives its token ``peak`` more logit than any other (probability ~1 by default)."""

    def __init__(self, script: Callable[[list[int]], int], peak: float = 20.0, n_batch: int = 512) -> None:
        super().__init__(script, n_batch)
        self.peak = peak

    def logits(self, index: int) -> np.ndarray:
        return super().logits(index) * np.float32(self.peak)


def with_model(rid: int, prompt: list[int], max_tokens: int, model: DraftModel, *, replay: list[int] | None = None,
               limit: int = DRAFT_MAX) -> Slot:
    slot = drafting(rid, prompt, max_tokens, replay=replay, limit=0)
    slot.draft = model.sequence(prompt + (replay or []), limit)
    return slot


def plain(script: Callable[[list[int]], int], prompt: list[int], max_tokens: int) -> list[int]:
    return tokens(generate(ScriptEngine(script), drafting(1, prompt, max_tokens, limit=0)), 1)


def test_the_model_as_its_own_draft_model_has_every_draft_kept_and_the_same_text() -> None:
    engine, model = ScriptEngine(counting), DraftModel(Confident(counting), 1)
    events = generate(engine, with_model(1, [1, 2, 3], 40, model))
    assert tokens(events, 1) == plain(counting, [1, 2, 3], 40)  # n-grams draft nothing here: nothing repeats
    finished = done(events, 1)
    decode_steps = len(engine.batches) - 1
    assert finished.drafted == finished.accepted == 40 - 1 - decode_steps
    assert decode_steps <= -(-39 // (1 + DRAFT_MAX)) + 1, decode_steps


def test_a_draft_model_that_differs_has_drafts_rejected_and_the_text_is_the_models() -> None:
    def sometimes_wrong(seen: list[int]) -> int:
        return counting(seen) if len(seen) % 3 else 63

    engine = ScriptEngine(counting)  # it asserts that no batch writes over a rejected draft's cell
    drafts = Confident(sometimes_wrong)  # and so does the draft model's: its cells follow the kept tokens
    events = generate(engine, with_model(1, [1, 2, 3], 40, DraftModel(drafts, 1)))
    assert tokens(events, 1) == plain(counting, [1, 2, 3], 40)
    finished = done(events, 1)
    assert finished.drafted > finished.accepted > 0
    assert any(start > 0 for _, start in drafts.forgotten)  # rejected drafts' cells dropped, not the sequence's


def test_the_draft_sequence_keeps_kept_drafts_cells_and_catches_up_on_the_rest() -> None:
    drafts = Confident(counting)
    sequence = DraftSequence(DraftModel(drafts, 1), [1, 2, 3], limit=3)
    first = sequence.propose(3)
    assert first == [23, 24, 25]
    assert drafts.cells[0] == [1, 2, 3, 23, 24]  # the last draft needs no cell until it is kept
    sequence.add(23)  # one draft kept, then the model's own token after it
    sequence.add(50)
    decoded = len(drafts.batches)
    assert sequence.propose(2) == [25, 26]
    assert [entry.token for entry in drafts.batches[decoded]] == [50]  # only the new one: 23's cell was kept
    assert drafts.cells[0] == [1, 2, 3, 23, 50, 25]
    for token in (25, 26, 27):  # both drafts kept: the last one's cell was never written
        sequence.add(token)
    decoded = len(drafts.batches)
    sequence.propose(1)
    assert [entry.token for entry in drafts.batches[decoded]] == [26, 27]
    assert drafts.cells[0] == [1, 2, 3, 23, 50, 25, 26, 27]


def test_a_long_sequence_catches_up_in_batches_of_the_draft_contexts_size() -> None:
    drafts = Confident(counting, n_batch=4)
    sequence = DraftSequence(DraftModel(drafts, 1), list(range(1, 11)), limit=3)
    assert sequence.propose(3) == [30, 31, 32]
    assert [len(batch) for batch in drafts.batches] == [4, 4, 2, 1, 1]
    assert [entry.logits for entry in drafts.batches[2]] == [False, True]


def test_an_unsure_draft_model_drafts_nothing_and_a_sure_one_up_to_the_room() -> None:
    unsure = DraftModel(Confident(counting, peak=1.0), 1)  # 1 logit above 63 others: probability 0.04
    assert unsure.sequence([1, 2, 3], 3).propose(3) == []
    assert DraftModel(Confident(counting), 1).sequence([1, 2, 3], 3).propose(2) == [23, 24]
    assert DraftModel(Confident(counting), 1).sequence([1, 2, 3], 1).propose(3) == [23]  # the request's n_max
    assert DraftModel(Confident(counting, peak=1.0), 1, p_min=0).sequence([1, 2, 3], 3).propose(3) == [23, 24, 25]


def test_a_draft_ends_at_an_end_token() -> None:
    drafts = Confident(counting)
    drafts.ends = {24}
    assert DraftModel(drafts, 1).sequence([1, 2, 3], 3).propose(3) == [23, 24]


def test_slots_in_flight_draft_on_sequences_of_their_own_which_are_freed_for_the_next() -> None:
    engine, drafts = ScriptEngine(repeating), Confident(repeating)
    model = DraftModel(drafts, 2)
    prompts = [PROMPT, PROMPT[:-1], PROMPT[:-2]]
    spec = generate(engine, *(with_model(rid, prompt, 25, model) for rid, prompt in enumerate(prompts)), parallel=2)
    for rid, prompt in enumerate(prompts):
        assert tokens(spec, rid) == plain(repeating, prompt, 25)
        assert done(spec, rid).drafted == done(spec, rid).accepted > 5
    assert {entry.seq for batch in drafts.batches for entry in batch} == {0, 1}
    assert sorted(model._free) == [0, 1] and drafts.cells == {0: [], 1: []}


def test_a_resumed_request_drafts_from_its_prompt_and_replayed_tokens() -> None:
    first = plain(counting, [1, 2, 3], 30)
    engine, drafts = ScriptEngine(counting), Confident(counting)
    resumed = generate(engine, with_model(1, [1, 2, 3], 30, DraftModel(drafts, 1), replay=first[:12]))
    assert first[:12] + tokens(resumed, 1) == first
    assert done(resumed, 1).accepted > 0
    # Caught up at its first draft: the prompt, the replay, and the first token chosen after it.
    assert [entry.token for entry in drafts.batches[0]] == [1, 2, 3, *first[:13]]


def test_a_draft_model_that_fails_to_decode_stops_drafting_and_the_text_goes_on() -> None:
    class Failing(Confident):
        def decode(self, entries: list[Entry]) -> int:
            if len(self.batches) == 3:  # its KV cache full, say: the slot's third draft-model decode
                self.batches.append(list(entries))
                return 1
            return super().decode(entries)

    drafts = Failing(counting)
    events = generate(ScriptEngine(counting), with_model(1, [1, 2, 3], 30, DraftModel(drafts, 1)))
    assert tokens(events, 1) == plain(counting, [1, 2, 3], 30)
    assert 0 < done(events, 1).drafted < 10 and len(drafts.batches) == 4
    assert drafts.cells[0] == []  # its cells dropped with it


def test_a_request_with_no_drafts_asked_gets_none() -> None:
    slot = with_model(1, PROMPT, 10, DraftModel(Confident(repeating), 1), limit=0)
    assert done(generate(ScriptEngine(repeating), slot), 1).drafted == 0


# The inventory's check that a draft model can draft for the model.

def test_a_draft_model_with_the_models_vocabulary_passes(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "model.gguf", n_layers=2, n_embd=64, n_ff=128)
    draft = write_demo_model(tmp_path / "draft.gguf", n_layers=1, n_embd=32, n_ff=64, seed=7)
    check_draft_model(draft, model, "inv.yaml")


def write_vocabulary(path: Path, tokens: list[str]) -> Path:
    """A GGUF that holds a vocabulary and nothing else: all the check reads."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cut_short(model: Path, path: Path) -> Path:
    """``model``'s first half: a download that stopped."""
    data = model.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def test_a_draft_model_that_cannot_draft_for_the_model_is_one_located_line_with_a_fix(tmp_path: Path) -> None:
    import gguf

    model = write_demo_model(tmp_path / "model.gguf", n_layers=2, n_embd=64, n_ff=128)
    words = [str(item) for item in gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].contents()]
    renamed = [*words[:300], "▁elsewhere", *words[301:]]
    (tmp_path / "notes.txt").write_text("not a model\n")
    cases = {
        tmp_path / "none.gguf": "inv.yaml: speculative.draft_model: no such file",
        tmp_path / "notes.txt": "inv.yaml: speculative.draft_model: " + str(tmp_path / "notes.txt")
        + " is not a readable GGUF file: it does not start with 'GGUF'",
        write_vocabulary(tmp_path / "short.gguf", words[:-1]): "inv.yaml: speculative.draft_model: short.gguf has a "
        f"vocabulary of {len(words) - 1} tokens, the model model.gguf {len(words)}",
        write_vocabulary(tmp_path / "other.gguf", renamed): "inv.yaml: speculative.draft_model: other.gguf and the "
        f"model model.gguf have different vocabularies (token 300 is '▁elsewhere' in one, {words[300]!r} in the other)",
        write_vocabulary(tmp_path / "vocab.gguf", words): "inv.yaml: speculative.draft_model: vocab.gguf holds no "
        "model, only metadata (no layers)",
        cut_short(model, tmp_path / "cut.gguf"): "inv.yaml: speculative.draft_model: cut.gguf is cut short: ",
    }
    for draft, message in cases.items():
        with pytest.raises(InventoryError) as caught:
            check_draft_model(draft, model, "inv.yaml")
        assert str(caught.value.message).startswith(message), caught.value.message
        assert caught.value.hint and caught.value.hint.startswith("fix: ")
        assert "\n" not in str(caught.value)


INVENTORY = "cluster: lab\nspeculative: {}\nnodes:\n  - name: a\n    kind: local\n"


def test_the_inventory_takes_a_draft_model_resolved_against_its_folder(tmp_path: Path) -> None:
    inventory = parse_inventory(INVENTORY.format("{draft_model: small.gguf, threads: 2, p_min: 0.5}"),
                                str(tmp_path / "inv.yaml"))
    assert inventory.speculates
    assert inventory.draft_model_path == tmp_path / "small.gguf"
    assert inventory.draft is not None and (inventory.draft.threads, inventory.draft.p_min) == (2, 0.5)
    assert parse_inventory(INVENTORY.format("ngram"), "inv.yaml").draft_model_path is None


@pytest.mark.parametrize(("written", "message"), [
    ("fast", "inv.yaml:2: speculative: got 'fast'; expected ngram, off or {draft_model: PATH}"),
    ("{draft: a.gguf}", "inv.yaml:2: speculative.draft: unknown key 'draft' (fix: did you mean 'draft_model'?)"),
    ("{threads: 2}", "inv.yaml:2: speculative.draft_model: required field is missing (fix: add 'draft_model')"),
    ("{draft_model: a.gguf, p_min: 2}", "inv.yaml:2: speculative.p_min: 2: input should be less than or equal to 1"),
])
def test_a_bad_speculative_field_is_one_located_line(written: str, message: str) -> None:
    with pytest.raises(InventoryError) as caught:
        parse_inventory(INVENTORY.format(written), "inv.yaml")
    assert str(caught.value) == message

