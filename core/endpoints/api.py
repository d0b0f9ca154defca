"""The OpenAI-compatible HTTP API (aiohttp), served by the controller on its own event loop.

`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events, or whole), `/v1/models`,
`/health`. Every request goes through `Service.generate`, the path `ggml-cluster run` takes: requests
queue first come, first served (one beyond the queue's bound is a 503 with Retry-After), and one in flight when
a node fails is resumed like any other. With an API key, every route but `/health` needs it as a Bearer token.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.endpoints.auth import bearer_matches
from core.errors import Busy, ClusterError, PromptError
from core.service import GenerateRequest, Service
from core.status import CoordinatorState


class _Request(BaseModel):
    # OpenAI clients send fields this server does not use (user, logprobs: null, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1
    stop: str | list[str] | None = None


RequestT = TypeVar("RequestT", bound=_Request)


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[str]


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


def _authenticate(key: str) -> Middleware:
    """Every route but /health answers only requests that carry ``key`` as a Bearer token; the rest get 401."""
    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
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
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"])
    if param == "n":
        return _fail(400, "only n=1 is supported", "invalid_request_error", "n")
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
        parsed = model.model_validate(body)
    except ValidationError as exc:
        return _invalid(exc)
    if parsed.stop:
        return _fail(400, "stop sequences are not supported by this server; leave out 'stop' (generation ends at "
                     "the model's end-of-text token or max_tokens)", "invalid_request_error", "stop")
    return parsed


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
        return await self._serve(request, parsed, {"prompt": prompts[0], **self._sampling(parsed, 16)}, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed = await _parse(request, ChatRequest)
        if isinstance(parsed, web.Response):
            return parsed
        job = {"messages": [message.plain() for message in parsed.messages], **self._sampling(parsed, None)}
        return await self._serve(request, parsed, job, chat=True)

    def _sampling(self, parsed: _Request, default_max: int | None) -> dict[str, Any]:
        # No max_tokens on a chat: until the model stops or the context is full (the coordinator caps it).
        limit = parsed.max_completion_tokens or parsed.max_tokens or default_max or self.service.context
        return {"max_tokens": limit, "temperature": parsed.temperature, "seed": parsed.seed}

    async def _serve(self, request: web.Request, parsed: _Request, fields: dict[str, Any],
                     chat: bool) -> web.StreamResponse:
        try:
            job = GenerateRequest.parse(fields, self.service.context)
        except PromptError as exc:
            return _fail(400, str(exc), "invalid_request_error", exc.field)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if parsed.stream:
            return await self._stream(request, job, chat, ident, created)
        texts: list[str] = []
        done: dict[str, Any] = {}

        async def collect(event: dict[str, Any]) -> None:
            if event.get("event") == "done":
                done.update(event)
            elif event.get("event") == "token":
                texts.append(event["text"])

        try:
            await self.service.generate(job, collect)
        except PromptError as exc:
            return _fail(400, str(exc), "invalid_request_error")
        except ClusterError as exc:
            return _unavailable(exc)
        text, reason = "".join(texts), _finish_reason(done)
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": reason, "logprobs": None} if chat else
                                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return web.json_response({
            "id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.model_id, "choices": [choice], "usage": _usage(done)})

    async def _stream(self, request: web.Request, job: GenerateRequest, chat: bool, ident: str,
                      created: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def chunk(choice: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
            data = {"id": ident, "object": kind, "created": created, "model": self.model_id,
                    "choices": [{"index": 0, **choice}], **(extra or {})}
            if not response.prepared:
                await response.prepare(request)
            await response.write(f"data: {json.dumps(data)}\n\n".encode())

        async def relay(event: dict[str, Any]) -> None:
            if chat and not response.prepared and event.get("event") in ("token", "done"):
                # The role comes first; sent with the first token, so an error before it still gets a status.
                await chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None})
            if event.get("event") == "token" and event["text"]:
                await chunk({"delta": {"content": event["text"]}, "finish_reason": None, "logprobs": None}
                            if chat else {"text": event["text"], "finish_reason": None, "logprobs": None})
            elif event.get("event") == "done":
                reason = _finish_reason(event)
                await chunk({"delta": {}, "finish_reason": reason, "logprobs": None} if chat else
                            {"text": "", "finish_reason": reason, "logprobs": None}, {"usage": _usage(event)})

        try:
            await self.service.generate(job, relay)
        except ClusterError as exc:
            if not response.prepared:  # nothing sent yet: a plain error response with its status
                return _fail(400, str(exc), "invalid_request_error") if isinstance(exc, PromptError) else \
                    _unavailable(exc)
            await response.write(f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n".encode())
        if not response.prepared:
            await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _finish_reason(done: dict[str, Any]) -> str:
    return "stop" if done.get("reason") == "stop" else "length"


def _usage(done: dict[str, Any]) -> dict[str, int]:
    prompt, completion = int(done.get("prompt_tokens", 0)), int(done.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def serve_api(service: Service, host: str, port: int, key: str | None) -> ApiServer:
    """Serve the API on host:port; with ``key``, every route but /health needs it as a Bearer token (raises
    OSError when the port is taken)."""
    api = _Api(service)
    app = web.Application(client_max_size=16 << 20, middlewares=[] if key is None else [_authenticate(key)])
    app.add_routes([
        web.get("/health", api.health), web.get("/v1/models", api.models),
        web.post("/v1/completions", api.completions), web.post("/v1/chat/completions", api.chat),
    ])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    return ApiServer(runner, f"{bound[0]}:{bound[1]}")
