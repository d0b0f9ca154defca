"""The OpenAI-compatible API against a running 3-worker cluster, through the official `openai` client."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.harness import Cluster
from tests.test_cluster import single_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "The cluster"


@pytest.fixture(scope="module")
def api(cluster3: Cluster) -> openai.OpenAI:
    endpoint = cluster3.status()["api_endpoint"]
    assert endpoint.startswith("127.0.0.1:")
    return openai.OpenAI(base_url=f"http://{endpoint}/v1", api_key="unused", max_retries=0, timeout=120)


def run_text(cluster: Cluster, *args: str) -> str:
    return json.loads(cluster.cli("run", PROMPT, "--json", *args).stdout)["text"]


def test_plain_completion_is_the_same_greedy_text_as_run(cluster3: Cluster, api: openai.OpenAI) -> None:
    completion = api.completions.create(model="any", prompt=PROMPT, max_tokens=48, temperature=0)
    assert completion.choices[0].text == run_text(cluster3, "-n", "48")
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 48
    assert completion.model == cluster3.status()["model"]


def test_streamed_chat_is_the_same_greedy_text_as_run_chat(cluster3: Cluster, api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=48, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert len([chunk for chunk in chunks if chunk.choices[0].delta.content]) > 1  # streamed, not one piece
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text == run_text(cluster3, "--chat", "-n", "48")
    assert text != run_text(cluster3, "-n", "48")  # the chat template shaped the prompt


def test_whole_chat_and_streamed_completion_agree(cluster3: Cluster, api: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    whole = api.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0)
    streamed = api.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0,
                                           stream=True)
    assert whole.choices[0].message.content == "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    pieces = api.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces) == run_text(cluster3, "-n", "24")


def test_requests_at_once_queue_and_all_finish(cluster3: Cluster, api: openai.OpenAI) -> None:
    expected = run_text(cluster3, "-n", "32")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(api.completions.create, model="any", prompt=PROMPT, max_tokens=32, temperature=0)
                   for _ in range(3)]
        texts = [future.result(timeout=300).choices[0].text for future in futures]
    assert texts == [expected] * 3


def test_models_and_health(cluster3: Cluster, api: openai.OpenAI) -> None:
    assert [model.id for model in api.models.list()] == [cluster3.status()["model"]]
    endpoint = cluster3.status()["api_endpoint"]
    with urllib.request.urlopen(f"http://{endpoint}/health", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read())["status"] == "ok"


def test_bad_requests_get_openai_error_bodies(cluster3: Cluster, api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="any", prompt=PROMPT, max_tokens=8, logit_bias={"5": 1})
    assert caught.value.param == "logit_bias" and "not supported" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="any", prompt="word " * 600, max_tokens=8)  # the test context is 512
    assert "context" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="any", messages=[], max_tokens=8)
    assert "messages" in caught.value.message
    endpoint = cluster3.status()["api_endpoint"]
    request = urllib.request.Request(f"http://{endpoint}/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=10)
    assert http.value.code == 400 and "error" in json.loads(http.value.read())


def test_a_client_that_disconnects_mid_stream_leaves_the_next_request_whole(cluster3: Cluster,
                                                                            api: openai.OpenAI) -> None:
    model = json.loads((cluster3.state / "launch.json").read_text())["model"]
    expected = single_process(model, "The capital of France is", 20)["text"]
    for _ in range(2):
        stream = api.completions.create(model="any", prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
        for index, _chunk in enumerate(stream):
            if index == 3:
                break
        stream.close()  # the client goes away mid-stream
        whole = api.completions.create(model="any", prompt="The capital of France is", max_tokens=20,
                                       temperature=0)
        assert whole.choices[0].text == expected
        assert whole.usage is not None and whole.usage.completion_tokens == 20


def streamed_tokens(api: openai.OpenAI, tokens: int) -> list[str]:
    """The greedy completion of PROMPT, a chunk per token (the demo model's tokens are whole ASCII words)."""
    chunks = api.completions.create(model="any", prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in chunks if chunk.choices and chunk.choices[0].text]
    assert len(pieces) == tokens
    return pieces


def test_a_stop_string_across_tokens_ends_the_text_streamed_and_whole(cluster3: Cluster, api: openai.OpenAI) -> None:
    pieces = streamed_tokens(api, 24)
    # The end of the 6th token and the start of the 7th: never in one token's text.
    stop = pieces[5][-3:] + pieces[6][:3]
    before = "".join(pieces[:5]) + pieces[5][:-3]
    assert stop not in "".join(pieces[:6]) and ("".join(pieces)).find(stop) == len(before)
    stream = api.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                    stop=["never in this text", stop])
    chunks = list(stream)
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == before and all(stop[:4] not in text for text in texts)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    run = json.loads(cluster3.cli("run", PROMPT, "--json", "-n", "24", "--top-k", "1", "--stop", "never in this text",
                                  "--stop", stop).stdout)  # `run` takes the same path
    assert (run["text"], run["reason"], run["completion_tokens"]) == (before, "stop", 7)
    chat_pieces = [chunk.choices[0].delta.content or "" for chunk in api.chat.completions.create(
        model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0, stream=True)]
    chat_stop = chat_pieces[4][-2:] + chat_pieces[5][:3]  # chat_pieces[0] is the role's chunk
    chat_before = "".join(chat_pieces[:4]) + chat_pieces[4][:-2]
    assert "".join(chat_pieces).find(chat_stop) == len(chat_before)
    whole = api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                        temperature=0, stop=chat_stop)
    assert whole.choices[0].message.content == chat_before
    assert whole.choices[0].finish_reason == "stop"
    # The stopped requests were ended in the coordinator: the next one is whole.
    assert streamed_tokens(api, 24) == pieces


def test_completion_and_chat_logprobs_are_the_models_for_each_token(api: openai.OpenAI) -> None:
    completion = api.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text and len(logprobs.tokens) == 8
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)  # greedy
    assert logprobs.text_offset == [len(PROMPT) + len("".join(logprobs.tokens[:index])) for index in range(8)]
    chat = api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2, stream=True)
    content, entries = "", []
    for chunk in chat:
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            entries += chunk.choices[0].logprobs.content
    assert len(entries) == 8 and "".join(entry.token for entry in entries) == content
    for entry in entries:
        assert bytes(entry.bytes or []).decode() == entry.token
        assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 2


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["colour", "count", "ok"]}


def test_json_schema_output_follows_the_schema_even_from_the_random_demo_model(api: openai.OpenAI) -> None:
    answer = api.chat.completions.create(
        model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=400, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    assert answer.choices[0].finish_reason == "stop"  # the grammar let the model end only once the object was whole
    value = json.loads(answer.choices[0].message.content or "")
    assert set(value) == {"colour", "count", "ok"} and value["colour"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and isinstance(value["ok"], bool)
    # Any object: the random model writes on in its first string until max_tokens, but an object it is.
    opened = api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                                         temperature=0, response_format={"type": "json_object"})
    assert (opened.choices[0].message.content or "").startswith('{ "')
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert caught.value.param == "response_format" and "grammar" in caught.value.message


def test_usage_and_timings_in_every_answer(api: openai.OpenAI) -> None:
    whole = api.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0)
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert whole.model_extra is not None
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == 6 and timings["prompt_n"] == whole.usage.prompt_tokens
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    chunks = list(api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    last = chunks[-2]
    assert last.choices[0].finish_reason == "length" and last.model_extra is not None
    assert last.model_extra["timings"]["predicted_n"] == 6
