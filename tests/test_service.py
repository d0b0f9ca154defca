"""The one generation request every way in builds: validated by name, whatever the client sent."""

from __future__ import annotations

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
