"""The API key and the queue bound at the HTTP edge: the middleware against a stand-in Service, then the official
`openai` client against a real cluster with a key and no queue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

import core.endpoints.auth
from core.endpoints.api import serve_api
from core.errors import Busy
from core.service import GenerateRequest, Send
from core.status import ClusterStatus, CoordinatorState, CoordinatorStatus
from tests.harness import Cluster

KEY = "test-key-0123456789abcdef"
OPENAI_401 = {"message": "no API key provided: send it as 'Authorization: Bearer <key>'",
              "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


class Stand:
    """The Service as the API uses it: a context, a snapshot, and a generate that answers or is busy."""

    context = 512

    def __init__(self, busy: Busy | None = None) -> None:
        self.busy = busy
        self.requests: list[GenerateRequest] = []

    def snapshot(self) -> ClusterStatus:
        return ClusterStatus(cluster="lab", model="demo.gguf", nodes=[],
                             coordinator=CoordinatorStatus(state=CoordinatorState.READY))

    async def generate(self, request: GenerateRequest, send: Send) -> None:
        self.requests.append(request)
        if self.busy is not None:
            raise self.busy
        await send({"event": "token", "text": "hi"})
        await send({"event": "done", "reason": "length", "prompt_tokens": 1, "completion_tokens": 1})


async def exchange(service: Stand, key: str | None, calls: list[tuple[str, str, dict[str, str]]],
                   ) -> list[tuple[int, dict[str, str], Any]]:
    """Each (method, path, headers) sent to an API served with ``key``: status, headers, JSON body (or None)."""
    server = await serve_api(service, "127.0.0.1", 0, key)  # type: ignore[arg-type]
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for method, path, headers in calls:
                body = {"prompt": "x", "max_tokens": 4} if method == "POST" else None
                async with session.request(method, f"http://{server.address}{path}", json=body,
                                           headers=headers) as response:
                    text = await response.text()
                    parsed = json.loads(text) if response.content_type == "application/json" else None
                    answers.append((response.status, dict(response.headers), parsed))
    finally:
        await server.close()
    return answers


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_health_needs_the_key() -> None:
    service = Stand()
    models, completion, health, wrong, basic, lower, nowhere, nowhere_keyed = asyncio.run(exchange(service, KEY, [
        ("GET", "/v1/models", {}), ("POST", "/v1/completions", {}), ("GET", "/health", {}),
        ("GET", "/v1/models", bearer("test-key-0123456789abcdeF")), ("GET", "/v1/models", {"Authorization": KEY}),
        ("GET", "/v1/models", {"Authorization": f"bearer  {KEY} "}), ("GET", "/v1/nothing", {}),
        ("GET", "/v1/nothing", bearer(KEY))]))
    for refused in (models, completion, nowhere):  # a route that does not exist is not revealed either
        assert refused[0] == 401 and refused[1]["WWW-Authenticate"] == "Bearer"
        assert refused[2] == {"error": OPENAI_401}
    assert service.requests == []  # a refused completion never reached the cluster
    assert health[0] == 200 and health[2]["status"] == "ok"
    for offered in (wrong, basic):
        assert offered[0] == 401 and offered[1]["WWW-Authenticate"] == 'Bearer error="invalid_token"'
        assert offered[2]["error"] == {**OPENAI_401, "message": "incorrect API key provided"}
    assert lower[0] == 200 and lower[2]["data"][0]["id"] == "demo.gguf"  # the scheme in any case (RFC 7235)
    assert nowhere_keyed[0] == 404


def test_without_a_key_the_api_is_open() -> None:
    [(status, _, body)] = asyncio.run(exchange(Stand(), None, [("GET", "/v1/models", {})]))
    assert status == 200 and body["object"] == "list"


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = core.endpoints.auth.hmac.compare_digest

    def spy(offered: bytes, key: bytes) -> bool:
        compared.append((offered, key))
        return real(offered, key)

    monkeypatch.setattr(core.endpoints.auth.hmac, "compare_digest", spy)
    answers = asyncio.run(exchange(Stand(), KEY, [("GET", "/v1/models", bearer("guess")),
                                                  ("GET", "/v1/models", bearer("güess")),
                                                  ("GET", "/v1/models", bearer(KEY))]))
    assert [status for status, _, _ in answers] == [401, 401, 200]
    assert compared == [(b"guess", KEY.encode()), ("güess".encode(), KEY.encode()), (KEY.encode(), KEY.encode())]


def test_on_a_port_of_the_kernels_choosing_the_api_keeps_off_the_workers_ports() -> None:
    with pytest.raises(OSError, match="every port the kernel offered was a worker's"):
        asyncio.run(serve_api(Stand(), "127.0.0.1", 0, None, reserved=range(1, 65536)))  # type: ignore[arg-type]


def test_busy_is_a_503_with_retry_after_in_openais_error_shape() -> None:
    busy = Busy("the cluster is busy: 1/1 slots generating, 0/0 queued (api.queue)", 7)
    [(status, headers, body)] = asyncio.run(exchange(Stand(busy), None, [("POST", "/v1/completions", {})]))
    assert status == 503 and headers["Retry-After"] == "7"
    assert body == {"error": {"message": "the cluster is busy: 1/1 slots generating, 0/0 queued (api.queue) "
                                         "(retry in 7s)", "type": "server_error", "param": None, "code": "server_busy"}}


def test_a_streamed_request_that_finds_the_cluster_busy_gets_the_503_too() -> None:
    service = Stand(Busy("the cluster is busy", 3))

    async def post() -> tuple[int, str | None, Any]:
        server = await serve_api(service, "127.0.0.1", 0, None)  # type: ignore[arg-type]
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    f"http://{server.address}/v1/completions",
                    json={"prompt": "x", "max_tokens": 4, "stream": True}) as response:
                return response.status, response.headers.get("Retry-After"), await response.json()
        finally:
            await server.close()

    status, retry_after, body = asyncio.run(post())
    assert (status, retry_after, body["error"]["code"]) == (503, "3", "server_busy")


# --- a real cluster, the official client -------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed() -> Iterator[Cluster]:
    """A 2-worker cluster whose API and metrics need KEY, with one slot (not auto's four) and a queue that holds
    nobody: a second request is refused."""
    root = Path(tempfile.mkdtemp(prefix="gck-", dir="/tmp"))
    (root / "api.key").write_text(KEY + "\n")
    (root / "api.key").chmod(0o600)
    cluster = Cluster(root, nodes=2, api="{port: 0, key_file: api.key, queue: 0, parallel: 1}")
    cluster.cli("up")
    yield cluster
    cluster.cli("down", check=False)
    shutil.rmtree(root, ignore_errors=True)


def client(cluster: Cluster, key: str) -> openai.OpenAI:
    # max_retries=0: the client would otherwise retry a 503, honouring its Retry-After.
    return openai.OpenAI(base_url=f"http://{cluster.status()['api_endpoint']}/v1", api_key=key, max_retries=0,
                         timeout=120)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_official_client_needs_the_key(keyed: Cluster) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(keyed, "not-the-key-0123456789").models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    endpoint = keyed.status()["api_endpoint"]
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(f"http://{endpoint}/v1/models", timeout=10)
    assert http.value.code == 401 and http.value.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(http.value.read()) == {"error": OPENAI_401}
    with urllib.request.urlopen(f"http://{endpoint}/health", timeout=10) as response:
        assert response.status == 200

    completion = client(keyed, KEY).completions.create(model="any", prompt="The cluster", max_tokens=16,
                                                      temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens == 16
    # `run` speaks to the controller over its socket: no key.
    assert json.loads(keyed.cli("run", "The cluster", "-n", "16", "--json").stdout)["text"] == \
        completion.choices[0].text

    metrics = f"http://{keyed.status()['metrics_endpoint']}/metrics"
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(metrics, timeout=10)
    assert http.value.code == 401
    with urllib.request.urlopen(urllib.request.Request(metrics, headers=bearer(KEY)), timeout=10) as response:
        assert "ggml_cluster_queue_limit" in response.read().decode()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_full_queue_is_a_503_with_retry_after_and_run_says_busy(keyed: Cluster) -> None:
    api = client(keyed, KEY)
    expected = api.completions.create(model="any", prompt="The cluster", max_tokens=64, temperature=0)
    # One request holds the only slot: its worker is stopped, so it cannot finish while the others arrive.
    worker = keyed.worker_pid("n0")
    rejected = keyed.status()["requests_rejected"]
    signal_worker(worker, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(api.completions.create, model="any", prompt="The cluster", max_tokens=64,
                               temperature=0, stream=True)
            deadline = time.monotonic() + 30
            while keyed.status()["slots_busy"] == 0:
                assert time.monotonic() < deadline, "the held request never took its slot"
                time.sleep(0.1)

            with pytest.raises(openai.InternalServerError) as caught:
                api.completions.create(model="any", prompt="The cluster", max_tokens=8, temperature=0)
            assert caught.value.status_code == 503 and caught.value.code == "server_busy"
            assert int(caught.value.response.headers["Retry-After"]) >= 1
            assert "the cluster is busy" in caught.value.message

            refused = keyed.cli("run", "The cluster", "-n", "8", check=False)
            assert refused.returncode == 1
            assert refused.stderr.strip().startswith("error: the cluster is busy: 1/1 slots generating, 0/0 queued")
            assert "retry in " in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
            status = keyed.status()
            assert (status["slots_busy"], status["slots"], status["queue_length"], status["queue_limit"]) == \
                (1, 1, 0, 0)
            assert status["requests_rejected"] == rejected + 2

            signal_worker(worker, signal.SIGCONT)
            text = "".join(chunk.choices[0].text for chunk in held.result(timeout=120))
    finally:
        signal_worker(worker, signal.SIGCONT)
    assert text == expected.choices[0].text  # the held request finished whole


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_up_with_a_new_key_restarts_the_api_with_it(keyed: Cluster) -> None:
    """The key is in no state file, yet `up` sees it changed: a leaked key is revoked by replacing it."""
    assert "already up" in keyed.cli("up").stderr
    rotated = "rotated-key-0123456789abcdef"
    (keyed.root / "api.key").write_text(rotated)
    assert "restarted" in keyed.cli("up").stderr
    with pytest.raises(openai.AuthenticationError):
        client(keyed, KEY).models.list()
    assert [model.id for model in client(keyed, rotated).models.list()] == [keyed.status()["model"]]
    assert "already up" in keyed.cli("up").stderr
    assert not any(rotated in path.read_text(errors="replace") for path in keyed.state.rglob("*")
                   if path.is_file() and path.stat().st_size < 1 << 20)


def signal_worker(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
