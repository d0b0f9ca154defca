"""The one generation request every way in builds: validated by name, whatever the client sent."""

from __future__ import annotations

import json

import pytest

from core.errors import PromptError
from core.service import GenerateRequest


@pytest.mark.parametrize(("request_", "field"), [
    ({"prompt": 5}, "prompt"), ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"), ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": float("inf")}, "max_tokens"), ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": -1}, "temperature"), ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "seed": "x"}, "seed"), ({"messages": [1]}, "messages"), ({"messages": [{1: "a"}]}, "messages"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"prompt": "a", "top_k": -1}, "top_k"), ({"prompt": "a", "top_k": 2.5}, "top_k"),
    ({"prompt": "a", "top_k": True}, "top_k"), ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_p": "x"}, "top_p"), ({"prompt": "a", "min_p": -0.1}, "min_p"),
    ({"prompt": "a", "repeat_penalty": 0}, "repeat_penalty"), ({"prompt": "a", "repeat_last_n": -1}, "repeat_last_n"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"prompt": "a", "stop": 3}, "stop"), ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"prompt": "a", "stop": ["a", 1]}, "stop"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"), ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"), ({"prompt": "a", "response_format": "json"}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"), ({"prompt": "a", "ignore_eos": 1}, "ignore_eos"),
])
def test_requests_of_the_wrong_shape_are_refused_by_name(request_: dict, field: str) -> None:
    with pytest.raises(PromptError, match="must be") as caught:
        GenerateRequest.parse(request_, context=512)
    assert caught.value.field == field and caught.value.exit_code == 2


def test_more_tokens_than_the_context_holds_is_refused_with_the_fix() -> None:
    with pytest.raises(PromptError) as caught:
        GenerateRequest.parse({"prompt": "a", "max_tokens": 20_000_000}, context=512)
    assert str(caught.value) == ("max_tokens 20000000 is more than the context holds (512 tokens, prompt included) "
                                 "(fix: ask for at most 512, or raise 'context' in the inventory)")
    assert GenerateRequest.parse({"prompt": "a", "max_tokens": 512}, context=512).max_tokens == 512


def test_a_good_request_is_normalised_and_travels_unchanged() -> None:
    request = GenerateRequest.parse({"prompt": "a", "max_tokens": 8.0, "temperature": 1, "seed": -3}, context=64)
    assert request == GenerateRequest(prompt="a", max_tokens=8, temperature=1.0, seed=-3)
    assert GenerateRequest.parse(request.to_dict(), context=64) == request
    chat = GenerateRequest.parse({"messages": [{"role": "user", "content": "hi"}, {"role": "system"}]}, context=64)
    assert chat.messages == (("user", "hi"), ("system", ""))
    assert GenerateRequest.parse(chat.to_dict(), context=64) == chat


def test_ignore_eos_travels_unchanged_and_is_refused_with_a_grammar() -> None:
    request = GenerateRequest.parse({"prompt": "a", "ignore_eos": True}, context=64)
    assert request.ignore_eos and GenerateRequest.parse(request.to_dict(), context=64) == request
    assert not GenerateRequest.parse({"prompt": "a"}, context=64).ignore_eos
    with pytest.raises(PromptError, match="cannot go with a 'response_format'") as caught:
        GenerateRequest.parse({"prompt": "a", "ignore_eos": True, "response_format": {"type": "json_object"}}, 64)
    assert caught.value.field == "ignore_eos"


def test_left_out_sampling_fields_take_llama_servers_defaults() -> None:
    request = GenerateRequest.parse({"prompt": "a", "top_p": None, "stop": None, "response_format": None}, context=64)
    assert (request.top_k, request.top_p, request.min_p, request.repeat_penalty, request.repeat_last_n) == (
        40, 0.95, 0.05, 1.0, 64)
    assert (request.presence_penalty, request.frequency_penalty, request.stop, request.logprobs) == (0.0, 0.0, (), None)
    assert request.json_schema is None


def test_the_new_fields_are_normalised_and_travel_unchanged() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    request = GenerateRequest.parse({
        "prompt": "a", "top_k": 0, "top_p": 1, "min_p": 0, "repeat_penalty": 1.1, "repeat_last_n": 0,
        "presence_penalty": -2, "frequency_penalty": 2, "stop": "\n\n", "logprobs": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
        context=64)
    assert (request.top_k, request.top_p, request.min_p, request.stop, request.logprobs) == (0, 1.0, 0.0, ("\n\n",), 0)
    assert request.json_schema == json.dumps(schema)  # the properties in their order: the grammar keeps it
    assert GenerateRequest.parse(request.to_dict(), context=64) == request
    assert GenerateRequest.parse({"prompt": "a", "stop": ["x", "yz"]}, context=64).stop == ("x", "yz")
    assert json.loads(GenerateRequest.parse({"prompt": "a", "response_format": {"type": "json_object"}},
                                            context=64).json_schema or "") == {"type": "object"}
    assert GenerateRequest.parse({"prompt": "a", "response_format": {"type": "text"}}, context=64).json_schema is None


def test_the_coordinator_gets_every_sampling_field_by_its_own_name() -> None:
    from core.engine.protocol import Generate

    request = GenerateRequest.parse({"prompt": "a", "top_k": 3, "logprobs": 2, "stop": "x"}, context=64)
    message = Generate(1, request.max_tokens, request.temperature, request.seed, **request.sampling())
    assert (message.top_k, message.logprobs, message.min_p) == (3, 2, 0.05)
