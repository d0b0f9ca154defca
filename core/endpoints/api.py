"""The OpenAI-compatible HTTP API (aiohttp), served by the controller on its own event loop.

`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events, or whole), `/v1/models`,
`/health`. Every request goes through `Service.generate`, the path `ggml-cluster run` takes: requests
queue first come, first served (one beyond the queue's bound is a 503 with Retry-After), and one in flight when
a node fails is resumed like any other. With an API key, every route but `/health` needs it as a Bearer token.

Each OpenAI field is used (the sampler's, `stop`, `logprobs`, `response_format`, `stream_options`), accepted as
metadata that changes nothing (`user`, `store`, ...), or refused with a 400 that names it. Answers carry `usage` and
llama-server's `timings`. The web dashboard (core.endpoints.dashboard) shares the app and its port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.endpoints.auth import bearer_matches
from core.endpoints.dashboard import Dashboard
from core.errors import Busy, ClusterError, PromptError
from core.listener import bound_socket
from core.service import MAX_LOGPROBS, GenerateRequest, Send, Service
from core.status import CoordinatorState


class StreamOptions(BaseModel):
    """``stream_options``."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with no choices and the usage, as OpenAI sends it


MAX_CHOICES = 16  # n: choices of one request, each generated in a slot of its own


class _Request(BaseModel):
    # Every field is used, or refused by name (extra="forbid"): a client never gets an answer that silently left
    # out something it asked for. A field sent as null counts as not sent (_parse drops it), as OpenAI's does.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    # The sampler's knobs; unset ones take llama-server's defaults (core.service), ranges are checked there.
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool | None = None  # llama-server's, which benchmark clients send
    # llama-server's: drafted tokens verified per step at most; 0 turns speculative decoding off for the request.
    speculative_n_max: int | None = Field(default=None, ge=0, alias="speculative.n_max")
    # Metadata that changes nothing in the answer.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


RequestT = TypeVar("RequestT", bound=_Request)


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (legacy shape)


class ChatMessage(BaseModel):
    """One message of a chat (text content; a list of text parts is joined)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def plain(self) -> dict[str, str]:
        """The message as the chat template expects it."""
        content = self.content
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An error in the shape OpenAI clients parse."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _fail(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, param), status=status)


def _unavailable(exc: ClusterError) -> web.Response:
    """503: the cluster cannot serve now; when it is only busy, Retry-After says when to come back."""
    if isinstance(exc, Busy):
        return web.json_response(error_body(str(exc), "server_error", code="server_busy"), status=503,
                                 headers={"Retry-After": str(exc.retry_after)})
    return _fail(503, str(exc), "server_error")


def _authenticate(key: str, dashboard: Dashboard) -> Middleware:
    """Every route but /health answers only requests that carry ``key`` as a Bearer token; the rest get 401. The
    dashboard's routes take its session cookie too, and send a browser without either to the sign-in form."""
    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if dashboard.owns(request):
            return await handler(request) if dashboard.admits(request) else dashboard.refuse(request)
        # /health stays open: load balancers and `curl` probes check it without the key, and it tells nothing
        # that the cluster's own status does not.
        if request.path == "/health" or bearer_matches(request.headers.get("Authorization", ""), key):
            return await handler(request)
        if "Authorization" in request.headers:
            message, challenge = "incorrect API key provided", 'Bearer error="invalid_token"'
        else:
            message, challenge = "no API key provided: send it as 'Authorization: Bearer <key>'", "Bearer"
        return web.json_response(error_body(message, "invalid_request_error", code="invalid_api_key"), status=401,
                                 headers={"WWW-Authenticate": challenge})
    return authenticate


def _invalid(exc: ValidationError) -> web.Response:
    errors = exc.errors()
    # A field this server does not implement says so first: its value is beside the point.
    first = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
    param = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return _fail(400, f"field {param} is not supported by this server", "invalid_request_error", param)
    return _fail(400, f"{param}: {first['msg']}", "invalid_request_error", param)


async def _parse(request: web.Request, model: type[RequestT]) -> RequestT | web.Response:
    """The request body as ``model``, or the 400 response that says what is wrong with it."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _fail(400, "the request body is not JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return _fail(400, "the request body must be a JSON object", "invalid_request_error")
    try:
        # null is OpenAI's "not given" (clients send logit_bias: null, tools: null, ...): not a request to refuse.
        return model.model_validate({name: value for name, value in body.items() if value is not None})
    except ValidationError as exc:
        return _invalid(exc)


@dataclass
class ApiServer:
    """The running HTTP server."""

    runner: web.AppRunner
    address: str  # host:port, the real port when 0 was asked for

    async def close(self) -> None:
        """Stop serving; requests in flight are cut."""
        await self.runner.cleanup()


class _Api:
    def __init__(self, service: Service) -> None:
        self.service = service
        started = service.snapshot()
        self.model_id = started.model  # the same for the controller's whole life
        self.created = int(started.started_at)

    async def health(self, _: web.Request) -> web.Response:
        snapshot = self.service.snapshot()
        state = snapshot.coordinator.state
        serving = state in (CoordinatorState.READY, CoordinatorState.GENERATING)
        body = {"status": "ok" if serving else str(state), "coordinator": str(state),
                "requests_in_flight": snapshot.requests_in_flight}
        if not serving:
            body["error"] = snapshot.coordinator.last_error
            body["failed_nodes"] = {node.name: node.last_error for node in snapshot.nodes if node.left_out}
        return web.json_response(body, status=200 if serving else 503)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "ggml-cluster"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await _parse(request, CompletionRequest)
        if isinstance(parsed, web.Response):
            return parsed
        prompts = [parsed.prompt] if isinstance(parsed.prompt, str) else parsed.prompt
        if len(prompts) != 1:
            return _fail(400, "send one prompt per request", "invalid_request_error", "prompt")
        job = {"prompt": prompts[0], **self._sampling(parsed, 16, parsed.logprobs)}
        return await self._serve(request, parsed, job, _Shape(chat=False, offset=len(prompts[0])))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed = await _parse(request, ChatRequest)
        if isinstance(parsed, web.Response):
            return parsed
        if parsed.top_logprobs is not None and not parsed.logprobs:
            return _fail(400, "top_logprobs needs logprobs: true", "invalid_request_error", "top_logprobs")
        logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
        job = {"messages": [message.plain() for message in parsed.messages],
               **self._sampling(parsed, None, logprobs)}
        return await self._serve(request, parsed, job, _Shape(chat=True))

    def _sampling(self, parsed: _Request, default_max: int | None, logprobs: int | None) -> dict[str, Any]:
        # No max_tokens on a chat: until the model stops or the context is full (the coordinator caps it).
        limit = parsed.max_completion_tokens or parsed.max_tokens or default_max or self.service.context
        # Fields left out (None) take GenerateRequest's defaults; it checks the ranges and names what is wrong.
        return {"max_tokens": limit, "logprobs": logprobs, **parsed.model_dump(include={
            "temperature", "seed", "stop", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty", "response_format", "ignore_eos"}),
                "speculative.n_max": parsed.speculative_n_max}

    async def _serve(self, request: web.Request, parsed: _Request, fields: dict[str, Any],
                     shape: _Shape) -> web.StreamResponse:
        try:
            job = GenerateRequest.parse(fields, self.service.context)
        except PromptError as exc:
            return _fail(400, str(exc), "invalid_request_error", exc.field)
        ident = f"{'chatcmpl' if shape.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        jobs = _choices(job, parsed.n)
        if parsed.stream:
            usage_chunk = parsed.stream_options is not None and parsed.stream_options.include_usage
            return await self._stream(request, jobs, shape, ident, created, usage_chunk=usage_chunk)
        texts: list[list[str]] = [[] for _ in jobs]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in jobs]
        done: list[dict[str, Any]] = [{} for _ in jobs]

        def collect(index: int) -> Send:
            async def take(event: dict[str, Any]) -> None:
                if event.get("event") == "done":
                    done[index].update(event)
                elif event.get("event") == "token":
                    texts[index].append(event["text"])
                    logprobs[index].extend(event.get("logprobs", ()))
            return take

        try:
            await _together(self.service, jobs, collect)
        except PromptError as exc:
            return _fail(400, str(exc), "invalid_request_error", exc.field)
        except ClusterError as exc:
            return _unavailable(exc)
        choices: list[dict[str, Any]] = []
        for index in range(len(jobs)):
            text, reason = "".join(texts[index]), _finish_reason(done[index])
            chances = shape.logprobs(logprobs[index]) if job.logprobs is not None else None
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "finish_reason": reason, "logprobs": chances} if shape.chat else
                           {"index": index, "text": text, "finish_reason": reason, "logprobs": chances})
        return web.json_response({
            "id": ident, "object": "chat.completion" if shape.chat else "text_completion", "created": created,
            "model": self.model_id, "choices": choices, "usage": _usage(*done), "timings": _timings(done[0])})

    async def _stream(self, request: web.Request, jobs: list[GenerateRequest], shape: _Shape, ident: str,
                      created: int, *, usage_chunk: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chat = shape.chat
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
            data = {"id": ident, "object": kind, "created": created, "model": self.model_id,
                    "choices": choices, **(extra or {})}
            if not response.prepared:
                await response.prepare(request)
            await response.write(f"data: {json.dumps(data)}\n\n".encode())

        def choice(index: int, text: str | None, reason: str | None,
                   logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
            chances = shape.logprobs(logprobs) if logprobs else None
            if chat:
                return [{"index": index, "delta": {"content": text} if text is not None else {},
                         "finish_reason": reason, "logprobs": chances}]
            return [{"index": index, "text": text or "", "finish_reason": reason, "logprobs": chances}]

        started: set[int] = set()
        finished: list[dict[str, Any]] = []

        def relay(index: int) -> Send:
            async def forward(event: dict[str, Any]) -> None:
                if chat and index not in started and event.get("event") in ("token", "done"):
                    # The role comes first; sent with the first token, so an error before it still gets a status.
                    started.add(index)
                    await chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None, "logprobs": None}])
                if event.get("event") == "token":
                    await chunk(choice(index, event["text"], None, event.get("logprobs", [])))
                elif event.get("event") == "done":
                    finished.append(event)
                    await chunk(choice(index, None, _finish_reason(event), []),
                                {"usage": _usage(event), "timings": _timings(event)})
                    if usage_chunk and len(finished) == len(jobs):
                        # OpenAI's shape: one more chunk, without choices, that carries the usage of them all
                        await chunk([], {"usage": _usage(*finished)})
            return forward

        try:
            await _together(self.service, jobs, relay)
        except ClusterError as exc:
            if not response.prepared:  # nothing sent yet: a plain error response with its status
                return _fail(400, str(exc), "invalid_request_error", exc.field) if isinstance(exc, PromptError) \
                    else _unavailable(exc)
            await response.write(f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n".encode())
        if not response.prepared:
            await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass(frozen=True)
class _Shape:
    """Which answer shape: a chat's, or a legacy completion's (whose text offsets count from the prompt's start,
    ``offset`` characters before the completion's)."""

    chat: bool
    offset: int = 0

    def logprobs(self, tokens: list[dict[str, Any]]) -> dict[str, Any]:
        """The ``logprobs`` of a choice for these tokens' entries (the controller's token events)."""
        if self.chat:
            return {"content": [{"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"],
                                 "top_logprobs": entry["top_logprobs"]} for entry in tokens]}
        return {"tokens": [entry["token"] for entry in tokens],
                "token_logprobs": [entry["logprob"] for entry in tokens],
                "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in tokens],
                "text_offset": [self.offset + entry["text_offset"] for entry in tokens]}


def _finish_reason(done: dict[str, Any]) -> str:
    return "stop" if done.get("reason") == "stop" else "length"


def _usage(*done: dict[str, Any]) -> dict[str, int]:
    """Tokens used: the prompt once (its choices share it), the completions of every choice."""
    prompt = int(done[0].get("prompt_tokens", 0))
    completion = sum(int(each.get("completion_tokens", 0)) for each in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choices(job: GenerateRequest, n: int) -> list[GenerateRequest]:
    """A request for each of ``n`` choices: with a seed, choice i draws from seed + i (each its own sample)."""
    return [job if job.seed is None or index == 0 else dataclasses.replace(job, seed=job.seed + index)
            for index in range(n)]


async def _together(service: Service, jobs: list[GenerateRequest], send: Callable[[int], Send]) -> None:
    """Run a request's choices at once, each in a slot of its own (they queue for slots like any request); the
    first to fail fails them all and the others are cancelled."""
    if len(jobs) == 1:
        await service.generate(jobs[0], send(0))
        return
    try:
        async with asyncio.TaskGroup() as group:
            for index, job in enumerate(jobs):
                group.create_task(service.generate(job, send(index)))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the first failure is the answer


def _timings(done: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``timings``: the prompt (after a recovery, with the replay) and the generation that followed."""
    timings = done.get("timings") or {}
    shown: dict[str, Any] = {"cache_n": int(timings.get("cache_n", 0))}  # prompt tokens copied, not evaluated
    for name, seconds in (("prompt", "prompt_s"), ("predicted", "decode_s")):
        count, ms = int(timings.get(f"{name}_n", 0)), 1000.0 * float(timings.get(seconds) or 0.0)
        shown |= {f"{name}_n": count, f"{name}_ms": ms, f"{name}_per_token_ms": ms / count if count else None,
                  f"{name}_per_second": 1000.0 * count / ms if ms > 0 else None}
    return shown


async def serve_api(service: Service, host: str, port: int, key: str | None, *,
                    reserved: Collection[int] = ()) -> ApiServer:
    """Serve the API and the web dashboard on host:port (port 0: one the kernel picks, none of ``reserved``);
    with ``key``, every route but /health needs it (raises OSError when the port is taken)."""
    api, dashboard = _Api(service), Dashboard(service, key)
    app = web.Application(client_max_size=16 << 20,
                          middlewares=[] if key is None else [_authenticate(key, dashboard)])
    app.add_routes([
        web.get("/health", api.health), web.get("/v1/models", api.models),
        web.post("/v1/completions", api.completions), web.post("/v1/chat/completions", api.chat),
        *dashboard.routes(),
    ])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.SockSite(runner, bound_socket(host, reserved)) if port == 0 else web.TCPSite(runner, host, port)
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    return ApiServer(runner, f"{bound[0]}:{bound[1]}")
