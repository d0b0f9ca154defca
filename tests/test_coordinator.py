"""The coordinator's request loop against a stand-in for llama-cpp-python: timing, progress and cancels."""

from __future__ import annotations

import ctypes
import io
import json
import time
from typing import Any

import numpy as np

from core.engine.coordinator import Generator


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


def run(made: Generator, **request: Any) -> list[dict[str, Any]]:
    out = io.StringIO()
    made.generate({"op": "generate", "id": 7, "max_tokens": 4, **request}, out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_prompt_time_covers_the_whole_graph_not_only_the_call_that_starts_it() -> None:
    events = run(generator(FakeLlama(graph_s=0.3)), prompt="hello", max_tokens=1)
    done = events[-1]
    assert done["event"] == "done" and done["completion_tokens"] == 1
    assert done["prompt_s"] >= 0.3, done  # the graph was still running when eval() returned
    assert done["decode_s"] < 0.3, done


def test_a_long_prompt_is_evaluated_in_batches_and_each_is_reported() -> None:
    llm = FakeLlama()
    events = run(generator(llm), prompt="x" * 1299, max_tokens=2)
    assert [len(batch) for batch in llm.evals[:3]] == [512, 512, 276]  # as Llama.eval batches it (n_batch)
    progress = [event for event in events if event["event"] == "progress"]
    assert [(event["phase"], event["done"], event["total"]) for event in progress] == [
        ("prompt", 512, 1300), ("prompt", 1024, 1300), ("prompt", 1300, 1300)]


def test_a_replay_reports_progress_while_it_runs() -> None:
    llm = FakeLlama(graph_s=0.01)
    events = run(generator(llm), prompt_tokens=[1, 2, 3], replay=[5] * 80, max_tokens=82)
    assert llm.evals[1:81] == [[5]] * 80  # one at a time, as first decoded
    progress = [event for event in events if event["event"] == "progress" and event["phase"] == "replay"]
    assert progress and progress[-1]["done"] == 80 and progress[-1]["total"] == 80
    assert len(progress) < 80  # reported every so often, not a line per token
