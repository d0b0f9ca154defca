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
        api.completions.create(model="any", prompt=PROMPT, max_tokens=8, stop=["\n"])
    assert "stop" in caught.value.message
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
