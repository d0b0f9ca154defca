"""The real model (Gemma 3 270M Q4_K_M, tests/realmodel.py) through 2-worker clusters, local and over SSH.

Every cluster's greedy text is compared with llama-cpp-python running the same GGUF in this process (no RPC):
with the `memory` and the `compute` strategy, on local nodes and on SSH nodes (real sshd on loopback), each
plan checked to put layers on both workers. Multi-byte text is streamed through `/v1/completions` and `run`.
One cluster per variant serves all of a variant's tests (pytest groups them by the module-scoped parameter).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from core.engine.coordinator import FLASH_ATTENTION
from core.model import ModelFacts, read_model
from core.planner import RESERVE_FRACTION, RESERVE_MIN_BYTES, NodeCapacity, depths_for, device_bytes
from tests.harness import CLI, Cluster
from tests.realmodel import real_model
from tests.sshd import NEEDS_SSHD, SshWorld, running_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CONTEXT = 512
N_LAYERS = 18
PROMPT = "The capital of France is"
TOKENS = 16
# A prompt this model continues greedily in Japanese, writing 𠮷 (U+20BB7, 4 bytes in UTF-8) three times, each
# spelt by four byte tokens: characters split across tokens, which must still reach the client whole. 24 tokens
# end on a character boundary (found with a one-process Llama; the test checks it).
WIDE_PROMPT = "𠮷野家 𠮷野家 𠮷野家 𠮷"
WIDE_TOKENS = 24
WIDE_CHAR = "\U00020bb7"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 16



@pytest.fixture(scope="module")
def model() -> Path:
    return real_model()


@pytest.fixture(scope="module")
def llm(model: Path) -> Iterator[Any]:
    """The same GGUF in this process, on the CPU, with the coordinator's context and attention settings.

    A worker's CPU backend keeps the weights as the GGUF has them; a CPU backend in the same process as llama.cpp
    repacks some Q4_K matrices (attn_output, ffn_down) into an interleaved layout whose kernels round
    differently, and this model's greedy text then parts from the workers' after a few tokens. So the
    reference loads without llama.cpp's extra buffer types (`use_extra_bufts`, not an argument of `Llama`).
    """
    import llama_cpp
    from llama_cpp import llama_cpp as capi

    defaults = capi.llama_model_default_params

    def plain_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capi, "llama_model_default_params", plain_buffers)
        llama = llama_cpp.Llama(model_path=str(model), n_gpu_layers=0, n_ctx=CONTEXT, n_threads=2,
                                flash_attn=FLASH_ATTENTION, verbose=False)
    yield llama
    llama.close()


_REFERENCES: dict[tuple[str | tuple[int, ...], int], dict[str, Any]] = {}


def completion(llm: Any, prompt: str | list[int], tokens: int) -> dict[str, Any]:
    """llama-cpp-python's own greedy completion of ``prompt`` (text, or tokens as given), at most ``tokens``."""
    key = (prompt if isinstance(prompt, str) else tuple(prompt), tokens)
    if key not in _REFERENCES:
        llm.reset()  # no prefix reused from the last prompt: the prompt is evaluated whole, as the coordinator does
        _REFERENCES[key] = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)
    return _REFERENCES[key]


def reference(llm: Any, prompt: str | list[int], tokens: int) -> str:
    """The text of a greedy completion that runs all ``tokens`` long."""
    out = completion(llm, prompt, tokens)
    assert out["usage"]["completion_tokens"] == tokens, out
    return str(out["choices"][0]["text"])


@pytest.fixture(scope="module")
def world() -> Iterator[SshWorld]:
    yield from running_world("gcrs-", 2)


VARIANTS = [pytest.param(("local", "memory"), id="local-memory"),
            pytest.param(("local", "compute"), id="local-compute"),
            pytest.param(("ssh", "memory"), id="ssh-memory", marks=NEEDS_SSHD),
            pytest.param(("ssh", "compute"), id="ssh-compute", marks=NEEDS_SSHD)]


def halving_caps(facts: ModelFacts) -> list[int]:
    """`memory:` caps under which no node holds the whole model and the second holds at most its second half (with
    the output layer): a model too big for either, as on a real cluster, so every plan uses both.

    Identical workers with room to spare would get every layer on one of them under the `compute` strategy (the
    fastest plan). The caps come from the planner's own view of the model (weights, KV cache, compute buffers,
    the output layer and its logits on the last node) plus its reserve; the first node can still be measured.
    """
    half, slack = facts.n_layers // 2, min(facts.layer_bytes) // 2
    whole = device_bytes(facts, (0, facts.n_layers - 1), CONTEXT, output=True)
    second = device_bytes(facts, (half, facts.n_layers - 1), CONTEXT, output=True)
    usable = [whole - 2 * slack, second + slack]
    # The planner keeps max(64 MiB, 10%) of a node free: the cap that leaves exactly this much usable.
    caps = [max(size + RESERVE_MIN_BYTES, math.ceil(size / (1 - RESERVE_FRACTION))) for size in usable]
    assert [NodeCapacity("n", 1 << 40, cap).usable - size for cap, size in zip(caps, usable, strict=True)] in (
        [0, 0], [1, 0], [0, 1], [1, 1])
    assert depths_for(facts, usable[0]) is not None  # the first node can be profiled
    return caps


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> tuple[str, str]:
    """Which nodes (local, ssh) and which placement (memory, compute)."""
    return request.param


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, variant: tuple[str, str], model: Path) -> Iterator[Cluster]:
    """A running 2-worker cluster on the real model: local or SSH nodes, `memory` or `compute` placement."""
    transport, strategy = variant
    root = Path(tempfile.mkdtemp(prefix="gcr-", dir="/tmp"))
    top = [f"model: {model}", "chat_template: gemma"]  # this GGUF has no chat template of its own
    caps = halving_caps(read_model(model)) if strategy == "compute" else None
    extra = {index: [f"memory: {cap}"] for index, cap in enumerate(caps)} if caps else None
    if transport == "ssh":
        world: SshWorld = request.getfixturevalue("world")
        nodes = [[f"host: {server.address}", f"port: {server.port}", "user: root", f"identity: {world.identity}"]
                 for server in world.servers]
        made = Cluster(root, nodes=2, context=CONTEXT, ssh=nodes, base_env=world.env(), top=top, strategy=strategy,
                       extra=extra, defaults=[f"workdir: {root / 'nodes'}"])
    else:
        made = Cluster(root, nodes=2, context=CONTEXT, top=top, strategy=strategy, extra=extra)
    try:
        made.cli("up")
        yield made
    finally:
        made.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)


def test_reading_the_models_facts_skips_its_vocabulary(model: Path) -> None:
    """`up`, `plan` and the controller read the model's layout; the 262,144 token strings are not part of it."""
    started = time.monotonic()
    facts = read_model(model)
    elapsed = time.monotonic() - started
    assert (facts.architecture, facts.n_layers, facts.n_embd) == ("gemma3", N_LAYERS, 640)
    assert facts.input_bytes == 178_257_920  # the Q8_0 token_embd.weight, 262,144 x 640
    assert elapsed < 2.0, f"reading the model's facts took {elapsed:.1f}s"


def test_the_plan_puts_layers_on_both_workers(cluster: Cluster, variant: tuple[str, str]) -> None:
    status = cluster.status()
    plan = json.loads((cluster.state / "plan.json").read_text())
    strategy = {"memory": "memory", "compute": "compute (latency)"}[variant[1]]
    assert status["strategy"] == plan["strategy"] == strategy
    layers = [node["layers"] for node in status["nodes"]]
    assert [node["layers"] for node in plan["nodes"]] == layers
    if strategy == "memory":  # llama.cpp's shares of two equal memories: 10 of the 18 layers, then 8
        assert layers == [[0, 9], [10, N_LAYERS - 1]]
    else:  # the caps leave only placements over both, the second with at most half of the layers
        first, second = layers
        assert first[0] == 0 and second[0] == first[1] + 1 and second[1] == N_LAYERS - 1, layers
        assert second[1] - second[0] + 1 <= N_LAYERS // 2, layers


def test_greedy_text_equals_one_process_llama_cpp(cluster: Cluster, llm: Any) -> None:
    result = json.loads(cluster.cli("run", PROMPT, "-n", str(TOKENS), "--json").stdout)
    assert result["completion_tokens"] == TOKENS
    assert result["text"] == reference(llm, PROMPT, TOKENS)
    assert result["recoveries"] == []


def test_a_chat_is_rendered_in_gemmas_turn_format(cluster: Cluster, llm: Any) -> None:
    """The GGUF has no chat template; the inventory names llama-cpp-python's built-in `gemma` format."""
    from llama_cpp.llama_chat_format import format_gemma

    # The prompt as llama-cpp-python's own gemma chat handler tokenizes it.
    rendered = format_gemma(messages=CHAT)
    assert rendered.prompt == f"<start_of_turn>user\n{CHAT[0]['content']}<end_of_turn>\n<start_of_turn>model\n"
    prompt = llm.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True)
    expected = completion(llm, prompt, CHAT_TOKENS)
    api = openai.OpenAI(base_url=f"http://{cluster.status()['api_endpoint']}/v1", api_key="unused", max_retries=0,
                        timeout=120)
    answer = api.chat.completions.create(model="any", messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    content = answer.choices[0].message.content
    assert content and content.strip()
    assert content == expected["choices"][0]["text"]
    assert answer.usage.completion_tokens == expected["usage"]["completion_tokens"]


def whole_text(text: str) -> str:
    """``text``, checked to be whole characters: no replacement character, no lone surrogate."""
    assert "\ufffd" not in text, text
    text.encode("utf-8")  # a lone surrogate (half of a character beyond the BMP) would raise here
    return text


def test_streamed_multibyte_text_arrives_whole_through_the_api(cluster: Cluster, llm: Any) -> None:
    expected = whole_text(reference(llm, WIDE_PROMPT, WIDE_TOKENS))
    assert expected.count(WIDE_CHAR) >= 2
    host, port = cluster.status()["api_endpoint"].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"prompt": WIDE_PROMPT, "max_tokens": WIDE_TOKENS, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    events = [event for event in response.read().split(b"\n\n") if event]
    connection.close()
    assert events[-1] == b"data: [DONE]"
    texts = []
    for event in events[:-1]:
        assert event.startswith(b"data: ")
        chunk = json.loads(event[len(b"data: "):].decode("utf-8"))  # strict: every chunk is valid UTF-8
        texts.append(whole_text(chunk["choices"][0]["text"]))
    assert "".join(texts) == expected
    assert sum(1 for text in texts if text) > 1  # streamed, not one piece
    assert any(WIDE_CHAR in text for text in texts)  # the four tokens of one character arrived as one


def test_streamed_multibyte_text_arrives_whole_through_run(cluster: Cluster, llm: Any) -> None:
    expected = whole_text(reference(llm, WIDE_PROMPT, WIDE_TOKENS))
    run = subprocess.Popen([CLI, "-i", str(cluster.inventory), "run", WIDE_PROMPT, "-n", str(WIDE_TOKENS)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cluster.env())
    assert run.stdout is not None
    reads = []
    while chunk := os.read(run.stdout.fileno(), 1 << 16):  # each read: what `run` has written and flushed so far
        reads.append(chunk.decode("utf-8"))  # strict: `run` never writes part of a character
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr
    assert whole_text("".join(reads)) == expected + "\n"
    assert len(reads) > 1


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population": {"type": "integer"}}, "required": ["city", "population"]}


def test_a_json_schema_answer_of_the_real_model_parses_and_follows_the_schema(cluster: Cluster) -> None:
    api = openai.OpenAI(base_url=f"http://{cluster.status()['api_endpoint']}/v1", api_key="unused", max_retries=0,
                        timeout=300)
    messages = [{"role": "user", "content": "Which is the capital of France, and how many people live there? "
                                            "Answer in JSON."}]
    answer = api.chat.completions.create(
        model="any", messages=messages, max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert answer.choices[0].finish_reason == "stop", answer
    value = json.loads(answer.choices[0].message.content or "")
    assert set(value) == {"city", "population"} and isinstance(value["city"], str) and len(value["city"]) <= 24
    assert isinstance(value["population"], int)


def test_n_choices_of_the_real_model_share_its_prompt_and_each_says_what_it_alone_says(cluster: Cluster,
                                                                                      llm: Any) -> None:
    """Gemma 3's sliding-window layers keep a KV cache of their own: the copy of the prompt's cells covers both."""
    before = cluster.status()
    api = openai.OpenAI(base_url=f"http://{before['api_endpoint']}/v1", api_key="unused", max_retries=0,
                        timeout=300)
    answer = api.completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS, temperature=0, n=3)
    assert [choice.text for choice in answer.choices] == [reference(llm, PROMPT, TOKENS)] * 3
    assert answer.usage is not None
    shared = cluster.status()["prompt_tokens_shared"] - before["prompt_tokens_shared"]
    # Auto's 4 slots hold the 3 choices at once: the prompt is evaluated for the first, the other two copy it.
    assert before["slots"] == 4 and shared == 2 * (answer.usage.prompt_tokens - 1)
