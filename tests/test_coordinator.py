"""The coordinator's request loop against a stand-in for llama-cpp-python: timing, progress and cancels."""

from __future__ import annotations

import ctypes
import io
import time
from typing import Any

import numpy as np
import pytest

from core.engine.coordinator import Generator, RequestIds
from core.engine.protocol import (
    Answer,
    Cancel,
    Done,
    Exited,
    Failed,
    Generate,
    Progress,
    PromptTokens,
    Ready,
    Shutdown,
    Token,
    decode_answer,
    decode_request,
    encode,
)


class FakeLlama:
    """Just enough of `llama_cpp.Llama`: a graph that goes on running after ``eval`` returns, as RPC's does."""

    n_batch = 512

    def __init__(self, graph_s: float = 0.0, n_vocab: int = 16) -> None:
        self.graph_s = graph_s
        self.ready_at = 0.0
        self.logits = np.zeros(n_vocab, dtype=np.float32)
        self.logits[5] = 1.0  # greedy always picks token 5
        self.evals: list[list[int]] = []
        self.ctx = object()
        self.model = object()
        self.metadata: dict[str, str] = {}
        self._n_vocab = n_vocab

    def n_ctx(self) -> int:
        return 4096

    def n_vocab(self) -> int:
        return self._n_vocab

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return [1] * add_bos + [3 + byte % 8 for byte in text]

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(b" w%d" % token for token in tokens)

    def reset(self) -> None:
        self.evals.clear()

    def eval(self, tokens: list[int]) -> None:
        self.evals.append(list(tokens))
        self.ready_at = time.monotonic() + self.graph_s


class FakeLib:
    """The llama_cpp module's C calls the coordinator makes; reading logits waits for the graph."""

    def __init__(self, llm: FakeLlama) -> None:
        self.llm = llm

    def llama_model_get_vocab(self, model: object) -> None:
        return None

    def llama_vocab_is_eog(self, vocab: object, token: int) -> bool:
        return False

    def llama_synchronize(self, ctx: object) -> None:
        time.sleep(max(0.0, self.llm.ready_at - time.monotonic()))

    def llama_get_logits_ith(self, ctx: object, index: int) -> Any:
        self.llama_synchronize(ctx)
        return self.llm.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def generator(llm: FakeLlama) -> Generator:
    """A Generator over the fake model, as the coordinator builds one over a loaded model."""
    return Generator(llm, FakeLib(llm))


def run(made: Generator, **request: Any) -> list[Answer]:
    out = io.StringIO()
    made.generate(Generate(**{"id": 7, "max_tokens": 4, **request}), out)
    return [decode_answer(line) for line in out.getvalue().splitlines()]


def test_prompt_time_covers_the_whole_graph_not_only_the_call_that_starts_it() -> None:
    events = run(generator(FakeLlama(graph_s=0.3)), prompt="hello", max_tokens=1)
    done = events[-1]
    assert isinstance(done, Done) and done.completion_tokens == 1
    assert done.prompt_s >= 0.3, done  # the graph was still running when eval() returned
    assert done.decode_s < 0.3, done


def test_a_long_prompt_is_evaluated_in_batches_and_each_is_reported() -> None:
    llm = FakeLlama()
    events = run(generator(llm), prompt="x" * 1299, max_tokens=2)
    assert [len(batch) for batch in llm.evals[:3]] == [512, 512, 276]  # as Llama.eval batches it (n_batch)
    progress = [event for event in events if isinstance(event, Progress)]
    assert [(event.phase, event.done, event.total) for event in progress] == [
        ("prompt", 512, 1300), ("prompt", 1024, 1300), ("prompt", 1300, 1300)]


def test_a_replay_reports_progress_while_it_runs() -> None:
    llm = FakeLlama(graph_s=0.01)
    events = run(generator(llm), prompt_tokens=[1, 2, 3], replay=[5] * 80, max_tokens=82)
    assert llm.evals[1:81] == [[5]] * 80  # one at a time, as first decoded
    progress = [event for event in events if isinstance(event, Progress) and event.phase == "replay"]
    assert progress and progress[-1].done == 80 and progress[-1].total == 80
    assert len(progress) < 80  # reported every so often, not a line per token


def test_every_message_survives_the_wire_and_anything_else_is_refused() -> None:
    requests = [Generate(1, 8, prompt="hi"), Generate(2, 4, 0.7, 3, messages=[{"role": "user", "content": "é"}],
                                                        replay=[5, 6]), Cancel(1), Shutdown()]
    answers = [Ready(0.5, 512, 1000), Failed("no"), Failed("no", 3), PromptTokens(1, [1, 2]),
               Progress(1, "prompt", 512, 900), Token(1, 5, " w"), Done(1, "stop", "", 2, 0, 1, 0.1, 0.2), Exited(-9)]
    assert [decode_request(encode(message)) for message in requests] == requests
    assert [decode_answer(encode(message)) for message in answers] == answers
    for line in (b"llama.cpp writes to stdout\n", b'{"event": "token"}\n', b'{"op": "generate"}\n', b"[1]\n"):
        with pytest.raises(ValueError):
            decode_answer(line)
        with pytest.raises(ValueError):
            decode_request(line)


def test_a_cancel_reaches_only_a_request_that_is_queued_or_running() -> None:
    ids = RequestIds()
    ids.cancel(1)  # not there yet: dropped
    ids.opened(1)
    assert not ids.cancelled(1)
    ids.cancel(1)
    assert ids.cancelled(1)
    ids.closed(1)
    ids.cancel(1)  # done: dropped, so it can never reach a later request
    ids.opened(2)
    assert not ids.cancelled(1) and not ids.cancelled(2)
