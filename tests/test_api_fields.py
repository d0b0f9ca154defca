"""The API's request fields and answer shapes, through the official `openai` client, against a stand-in for the
cluster: what each field becomes in the GenerateRequest, what is refused by name, and how logprobs, usage and
timings come back (whole and streamed)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from core.endpoints.api import serve_api
from core.errors import PromptError
from core.service import GenerateRequest, Send
from core.status import ClusterStatus, CoordinatorState, CoordinatorStatus

PROMPT = "Say it"


def entry(token: str, logprob: float, offset: int) -> dict[str, Any]:
    """A token's logprobs as the controller's token events carry them."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "text_offset": offset,
            "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(token.encode())},
                             {"token": "x", "logprob": -3.0, "bytes": [120]}]}


# What the stand-in streams for every request: two token events (the second with two tokens' logprobs, as when a
# stop string held the first back), then done.
EVENTS = [
    {"event": "token", "text": "Hel", "logprobs": [entry("Hel", -0.5, 0)]},
    {"event": "token", "text": "lo é", "logprobs": [entry("lo", -0.25, 3), entry(" é", -1.0, 5)]},
    {"event": "done", "text": "Hello é", "reason": "stop", "prompt_tokens": 4, "completion_tokens": 3,
     "timings": {"prompt_s": 0.02, "decode_s": 0.5, "prompt_n": 4, "predicted_n": 3, "cache_n": 0}},
]


class FakeService:
    """The cluster as the API sees it: records each request and answers EVENTS (or raises ``error``)."""

    context = 512

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.error: PromptError | None = None

    def snapshot(self) -> ClusterStatus:
        return ClusterStatus(cluster="lab", model="demo.gguf", nodes=[],
                             coordinator=CoordinatorStatus(state=CoordinatorState.READY))

    async def generate(self, request: GenerateRequest, send: Send) -> None:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        for event in EVENTS:
            await send(event)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeService, str]]:
    service = FakeService()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(serve_api(service, "127.0.0.1", 0, None), loop).result(10)
    yield service, server.address
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def service(served: tuple[FakeService, str]) -> FakeService:
    served[0].requests.clear()
    served[0].error = None
    return served[0]


@pytest.fixture
def api(served: tuple[FakeService, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{served[1]}/v1", api_key="unused", max_retries=0, timeout=30)


def post(served: tuple[FakeService, str], path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://{served[1]}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


CHAT = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "any", "prompt": PROMPT}


@pytest.mark.parametrize(("path", "body", "field"), [
    *[("/v1/chat/completions", CHAT, name) for name in (
        "tools", "tool_choice", "functions", "function_call", "logit_bias", "parallel_tool_calls", "audio",
        "modalities", "prediction", "reasoning_effort", "web_search_options", "suffix", "not_an_openai_field")],
    *[("/v1/completions", COMPLETION, name) for name in ("suffix", "echo", "best_of", "logit_bias", "top_logprobs")],
])
def test_a_field_this_server_does_not_implement_is_a_400_that_names_it(
        served: tuple[FakeService, str], service: FakeService, path: str, body: dict[str, Any], field: str) -> None:
    status, answer = post(served, path, {**body, field: {"a": 1}})
    assert status == 400
    assert answer["error"] == {"message": f"field {field} is not supported by this server",
                               "type": "invalid_request_error", "param": field, "code": None}
    assert service.requests == []


def test_the_openai_client_gets_the_refusal_as_a_bad_request(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    assert caught.value.param == "tools" and "tools is not supported" in caught.value.message


def test_null_fields_and_metadata_are_accepted(served: tuple[FakeService, str], service: FakeService) -> None:
    nulls = dict.fromkeys(("tools", "logit_bias", "stop", "top_p", "seed", "response_format", "temperature"))
    status, answer = post(served, "/v1/chat/completions", {
        **CHAT, **nulls, "user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
        "stream_options": {"include_usage": True}})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello é"
    request = service.requests[0]
    assert (request.stop, request.top_p, request.json_schema, request.temperature) == ((), 0.95, None, 1.0)


def test_bad_values_and_sub_fields_are_named(served: tuple[FakeService, str], service: FakeService) -> None:
    for body, param in ((dict(CHAT, top_p=1.5), "top_p"), (dict(CHAT, top_k=-1), "top_k"),
                        (dict(CHAT, stop=["a", "b", "c", "d", "e"]), "stop"),
                        (dict(CHAT, response_format={"type": "yaml"}), "response_format"),
                        (dict(CHAT, stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
                        (dict(CHAT, top_logprobs=2), "top_logprobs"), (dict(CHAT, n=17), "n"), (dict(CHAT, n=0), "n"),
                        (dict(COMPLETION, logprobs=21), "logprobs")):
        status, answer = post(served, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    assert service.requests == []


def test_every_field_reaches_the_request(api: openai.OpenAI, service: FakeService) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    api.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "hi"}], temperature=0.5, top_p=0.8, seed=3,
        presence_penalty=0.5, frequency_penalty=-0.5, stop=["\n", "END"], max_tokens=9, logprobs=True,
        top_logprobs=2, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        extra_body={"top_k": 5, "min_p": 0.1, "repeat_penalty": 1.2, "repeat_last_n": 16})
    assert service.requests[-1] == GenerateRequest(
        messages=(("user", "hi"),), max_tokens=9, temperature=0.5, seed=3, top_k=5, top_p=0.8, min_p=0.1,
        repeat_penalty=1.2, repeat_last_n=16, presence_penalty=0.5, frequency_penalty=-0.5, stop=("\n", "END"),
        logprobs=2, json_schema=json.dumps(schema))
    api.completions.create(model="any", prompt=PROMPT, stop="x", logprobs=0, extra_body={"ignore_eos": True})
    assert (service.requests[-1].stop, service.requests[-1].logprobs, service.requests[-1].ignore_eos) == (
        ("x",), 0, True)
    api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                response_format={"type": "json_object"})
    assert service.requests[-1].logprobs == 0 and json.loads(service.requests[-1].json_schema or "") == {
        "type": "object"}


def test_a_field_the_cluster_refuses_is_named_whole_and_streamed(api: openai.OpenAI, service: FakeService) -> None:
    service.error = PromptError("response_format: the JSON schema cannot be turned into a grammar",
                                field="response_format")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], stream=stream,
                                        response_format={"type": "json_object"})
        assert caught.value.param == "response_format" and "grammar" in caught.value.message


def test_chat_logprobs_usage_and_timings_whole(api: openai.OpenAI, service: FakeService) -> None:
    answer = api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                         top_logprobs=2)
    choice = answer.choices[0]
    assert choice.message.content == "Hello é" and choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [(item.token, item.logprob, item.bytes) for item in choice.logprobs.content] == [
        ("Hel", -0.5, list(b"Hel")), ("lo", -0.25, list(b"lo")), (" é", -1.0, list(" é".encode()))]
    assert [top.token for top in choice.logprobs.content[0].top_logprobs] == ["Hel", "x"]
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (4, 3)
    assert answer.model_extra is not None
    assert answer.model_extra["timings"] == {
        "cache_n": 0, "prompt_n": 4, "prompt_ms": 20.0, "prompt_per_token_ms": 5.0, "prompt_per_second": 200.0,
        "predicted_n": 3, "predicted_ms": 500.0, "predicted_per_token_ms": pytest.approx(500 / 3),
        "predicted_per_second": 6.0}
    plain = api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_openais_legacy_shape(api: openai.OpenAI) -> None:
    answer = api.completions.create(model="any", prompt=PROMPT, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["Hel", "lo", " é"]
    assert logprobs.token_logprobs == [-0.5, -0.25, -1.0]
    assert logprobs.top_logprobs == [{"Hel": -0.5, "x": -3.0}, {"lo": -0.25, "x": -3.0}, {" é": -1.0, "x": -3.0}]
    assert logprobs.text_offset == [len(PROMPT), len(PROMPT) + 3, len(PROMPT) + 5]  # from the prompt's start


def test_streamed_chunks_carry_their_tokens_logprobs_and_the_last_the_usage_and_timings(api: openai.OpenAI) -> None:
    chunks = list(api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                              stream=True, logprobs=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert [chunk.choices[0].delta.content for chunk in content] == ["Hel", "lo é"]
    assert [[item.token for item in chunk.choices[0].logprobs.content]
            for chunk in content] == [["Hel"], ["lo", " é"]]
    finish, usage = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason == "stop" and finish.model_extra is not None
    assert finish.model_extra["timings"]["predicted_n"] == 3
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 7
    legacy = list(api.completions.create(model="any", prompt=PROMPT, stream=True, logprobs=1))
    assert [chunk.choices[0].logprobs.tokens for chunk in legacy[:2]] == [
        ["Hel"], ["lo", " é"]]
    assert legacy[-1].usage is not None and legacy[-1].choices[0].finish_reason == "stop"


def test_n_choices_are_n_requests_each_with_its_own_seed_and_the_prompt_counted_once(
        api: openai.OpenAI, service: FakeService) -> None:
    whole = api.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], n=3, seed=40,
                                        temperature=0.8)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert [choice.message.content for choice in whole.choices] == ["Hello é"] * 3
    assert sorted(request.seed for request in service.requests) == [40, 41, 42]  # each choice its own draws
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 9)
    service.requests.clear()
    chunks = list(api.completions.create(model="any", prompt=PROMPT, n=2, stream=True,
                                         stream_options={"include_usage": True}))
    for index in (0, 1):
        assert "".join(chunk.choices[0].text for chunk in chunks
                       if chunk.choices and chunk.choices[0].index == index) == "Hello é"
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and
            chunk.choices[0].finish_reason] == ["stop", "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [request.seed for request in service.requests] == [None, None]


def test_when_one_choice_fails_the_request_fails(served: tuple[FakeService, str], service: FakeService) -> None:
    service.error = PromptError("the prompt is too long", field="prompt")
    status, answer = post(served, "/v1/completions", dict(COMPLETION, n=3))
    assert status == 400 and answer["error"]["param"] == "prompt"
