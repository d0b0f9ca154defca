"""The coordinator's request loop against a stand-in for llama-cpp-python (timing, progress and cancels), and how
it renders chats, on a real llama-cpp-python vocabulary."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.engine.coordinator import (
    NO_CHAT_TEMPLATE,
    CoordinatorConfig,
    Generator,
    chat_format,
    load_chat,
)
from core.engine.protocol import (
    EXIT_COMPUTE_FAILED,
    Answer,
    Cancel,
    ComputeFailed,
    ComputeRetried,
    Done,
    Exited,
    Failed,
    Generate,
    Progress,
    PromptTokens,
    Ready,
    Shutdown,
    Token,
    TokenLogprobs,
    decode_answer,
    decode_request,
    encode,
    status_name,
)
from core.engine.slots import RequestIds, Scheduler, Slot
from core.inventory import CHAT_FORMATS
from core.model import DEMO_CHAT_TEMPLATE, write_demo_model
from tests.test_slots import FakeEngine, Ids


class FakeLlama:
    """Just enough of `llama_cpp.Llama` to prepare a request."""

    def __init__(self) -> None:
        self.model = object()
        self.metadata: dict[str, str] = {}

    def n_ctx(self) -> int:
        return 4096

    def n_vocab(self) -> int:
        return 16

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return [1] * add_bos + [3 + byte % 8 for byte in text]

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(b" w%d" % token for token in tokens)


class FakeLib:
    """The llama_cpp module's calls a Generator makes."""

    def llama_model_get_vocab(self, model: object) -> None:
        return None

    def llama_vocab_is_eog(self, vocab: object, token: int) -> bool:
        return token == 5  # the fake model's favourite


def prepare(**request: Any) -> Slot | Failed:
    return Generator(FakeLlama(), FakeLib()).prepare(Generate(**{"id": 7, "max_tokens": 4, **request}))


def run(engine: FakeEngine | None = None, **request: Any) -> list[Answer]:
    """A request prepared by a Generator and run on its own in the slots, over a fake model whose favourite token
    is 5 (logit 1, the others 0)."""
    prepared = prepare(**request)
    if isinstance(prepared, Failed):
        return [prepared]
    events: list[Answer] = []
    scheduler = Scheduler(engine or FakeEngine(), 1, events.append, Ids())
    scheduler.add(prepared)
    while scheduler.busy:
        scheduler.step()
    return events


def test_a_request_becomes_a_slot_with_its_budget_or_is_refused_with_why() -> None:
    made = prepare(prompt="hi", max_tokens=10, replay=[5, 5, 5])
    assert isinstance(made, Slot) and made.prompt == [1, 3 + ord("h") % 8, 3 + ord("i") % 8] and made.budget == 7
    assert prepare(prompt_tokens=[2] * 4096) == Failed("the prompt has 4096 tokens; the context holds 4096", 7)
    assert prepare(prompt_tokens=[2] * 4090, max_tokens=100).budget == 6  # type: ignore[union-attr]


def test_each_token_carries_its_logprobs_when_asked_with_the_texts_of_the_likeliest() -> None:
    tokens = [event for event in run(prompt="hi", max_tokens=2, logprobs=2)
              if isinstance(event, Token)]
    total = np.log(np.e + 15)  # token 5's logit is 1, the other 15 are 0
    assert [token.token for token in tokens] == [5, 5]
    chances = tokens[0].logprobs
    assert chances is not None
    assert (chances["token"], chances["bytes"]) == (" w5", list(b" w5"))
    assert chances["logprob"] == pytest.approx(1 - total)
    assert chances["top_logprobs"][0]["token"] == " w5"
    assert [top["logprob"] for top in chances["top_logprobs"]] == pytest.approx([1 - total, -total])
    assert all(token.logprobs is None for token in run(prompt="hi", max_tokens=2)
               if isinstance(token, Token))


def test_the_sampling_fields_reach_the_sampler_and_the_penalties_see_the_prompt() -> None:
    # "b" tokenizes to token 5 (after BOS, 1), the fake model's favourite: penalised from the start, it is not
    # chosen; then 0 has been, and 2 is the first that has not.
    events = run(prompt="b", max_tokens=2, presence_penalty=2.0)
    assert [event.token for event in events if isinstance(event, Token)] == [0, 2]
    events = run(prompt="a", max_tokens=2, presence_penalty=2.0)
    assert [event.token for event in events if isinstance(event, Token)] == [5, 0]


def test_ignore_eos_never_chooses_an_end_token_and_runs_to_max_tokens() -> None:
    engine = FakeEngine()
    engine.ends = {5}
    ended = run(engine, prompt="hi", max_tokens=3)
    assert isinstance(ended[-1], Done) and (ended[-1].reason, ended[-1].completion_tokens) == ("stop", 0)
    engine = FakeEngine()
    engine.ends = {5}
    events = run(engine, prompt="hi", max_tokens=3, ignore_eos=True, logprobs=1)
    tokens = [event for event in events if isinstance(event, Token)]
    assert [token.token for token in tokens] == [0, 0, 0]  # the likeliest after the end token, each time
    assert isinstance(events[-1], Done) and events[-1].reason == "length"
    assert tokens[0].logprobs is not None and tokens[0].logprobs["logprob"] == pytest.approx(-np.log(15))


def test_a_schema_that_cannot_be_a_grammar_fails_the_request_naming_response_format() -> None:
    engine = FakeEngine()
    events = run(engine, prompt="hi", json_schema='{"type": "nonsense"}')
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].field == "response_format" and events[0].id == 7
    assert "response_format" in events[0].message and "nonsense" in events[0].message
    assert engine.batches == []  # refused before any work


def test_every_message_survives_the_wire_and_anything_else_is_refused() -> None:
    requests = [Generate(1, 8, prompt="hi"), Generate(2, 4, 0.7, 3, messages=[{"role": "user", "content": "é"}],
                                                        replay=[5, 6]),
                Generate(3, 4, prompt="x", top_k=0, top_p=0.5, min_p=0.0, repeat_penalty=1.1, repeat_last_n=8,
                         presence_penalty=-0.5, frequency_penalty=0.5, logprobs=2, json_schema='{"type": "object"}'),
                Cancel(1), Shutdown()]
    chances: TokenLogprobs = {"token": " w", "logprob": -0.5, "bytes": [32, 119],
                              "top_logprobs": [{"token": " w", "logprob": -0.5, "bytes": [32, 119]}]}
    answers = [Ready(0.5, 512, 1000), Failed("no"), Failed("no", 3), Failed("bad", 3, "response_format"),
               PromptTokens(1, [1, 2]), Progress(1, "prompt", 512, 900), Token(1, 5, " w"), Token(1, 5, " w", chances),
               Done(1, "stop", "", 2, 0, 1, 0.1, 0.2), Exited(-9)]
    assert [decode_request(encode(message)) for message in requests] == requests
    assert [decode_answer(encode(message)) for message in answers] == answers
    for line in (b"llama.cpp writes to stdout\n", b'{"event": "token"}\n', b'{"op": "generate"}\n', b"[1]\n"):
        with pytest.raises(ValueError):
            decode_answer(line)
        with pytest.raises(ValueError):
            decode_request(line)


def test_compute_failures_and_retries_survive_the_wire() -> None:
    answers = [ComputeFailed("127.0.0.1:41234", 0, -1, 1, 1), ComputeFailed("127.0.0.1:41234", 1, -2, 3, 2, id=7),
               ComputeFailed("10.0.0.2:50052", 0, 1, 1, 3, id=7, persistent=True),
               ComputeRetried("127.0.0.1:41234", 1, 4.2), ComputeRetried("127.0.0.1:41234", 2, 12.5, id=7)]
    assert [decode_answer(encode(message)) for message in answers] == answers
    assert encode(answers[2]) == (b'{"event": "compute_failed", "endpoint": "10.0.0.2:50052", "device": 0, '
                                  b'"status": 1, "failures": 1, "attempt": 3, "id": 7, "persistent": true}\n')
    assert decode_answer(b'{"event": "compute_retried", "endpoint": "e", "attempts": 1, "retry_ms": 4.2}') == (
        ComputeRetried("e", 1, 4.2))
    assert [status_name(status) for status in (-1, -2, 1, 7)] == [
        "GGML_STATUS_FAILED (-1)", "GGML_STATUS_ALLOC_FAILED (-2)", "GGML_STATUS_ABORTED (1)", "ggml_status (7)"]
    assert EXIT_COMPUTE_FAILED == 3


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


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the cluster?"}]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The demo model's vocabulary in llama-cpp-python (no weights): what a chat is tokenized with."""
    import llama_cpp

    path = write_demo_model(tmp_path_factory.mktemp("demo") / "demo.gguf")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def chat_tokens(llm: Any, **config: Any) -> list[int]:
    """A chat as the coordinator tokenizes it, with the inventory's chat settings ``config``."""
    import llama_cpp

    chat = load_chat(llm, CoordinatorConfig(model="m.gguf", endpoints=(), tensor_split=(), context=512, **config))
    return Generator(llm, llama_cpp, chat).prompt_tokens(Generate(1, 8, messages=CHAT))


def test_the_inventorys_chat_formats_are_llama_cpp_pythons() -> None:
    from llama_cpp import llama_chat_format

    handlers = llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers
    formats = {name for name, handler in handlers.items()
               if "chat_formatter" in inspect.getclosurevars(handler).nonlocals}
    assert sorted(formats) == sorted(CHAT_FORMATS)
    assert all(callable(chat_format(name)) for name in CHAT_FORMATS)
    with pytest.raises(ValueError, match="not a prompt format"):
        chat_format("functionary")


def test_a_chat_format_renders_as_llama_cpp_pythons_own_handler_does(vocab: Any) -> None:
    from llama_cpp.llama_chat_format import format_chatml

    rendered = format_chatml(messages=CHAT)
    assert rendered.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    expected = vocab.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True)
    assert chat_tokens(vocab, chat_format="chatml") == expected


def test_a_template_file_is_used_instead_of_the_ggufs(vocab: Any, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tokens = chat_tokens(vocab, chat_template_file=str(template))
    # The template writes the BOS token itself: the tokenizer adds no second one.
    assert tokens == vocab.tokenize(b"<s>[system] Be brief.\n[user] Where is the cluster?\n", add_bos=False,
                                    special=True)
    assert tokens.count(vocab.token_bos()) == 1
    assert vocab.metadata["tokenizer.chat_template"] == DEMO_CHAT_TEMPLATE
    assert chat_tokens(vocab) == vocab.tokenize(b"system: Be brief.\nuser: Where is the cluster?\nassistant:",
                                                add_bos=True, special=True)


def test_a_chat_without_any_template_is_refused_with_the_fix() -> None:
    assert prepare(messages=CHAT) == Failed(f"cannot render the chat: {NO_CHAT_TEMPLATE}", 7)
    assert "chat_template" in NO_CHAT_TEMPLATE
