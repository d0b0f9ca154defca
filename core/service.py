"""What every way into the cluster (the control socket, the OpenAI API, Prometheus) may ask of it: the Service,
and one generation request, validated in one place."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import PromptError
from core.status import ClusterStatus

Send = Callable[[dict[str, Any]], Awaitable[None]]  # a request's events to its client (raises ConnectionError)

DEFAULT_MAX_TOKENS = 128
MAX_TEMPERATURE = 100.0
# llama-server's defaults (common/common.h, common_params_sampling), for the fields a request leaves out.
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_PENALTY = 1.0
DEFAULT_REPEAT_LAST_N = 64
MAX_STOPS = 4        # stop strings a request may give, as OpenAI allows
MAX_LOGPROBS = 20    # alternatives per token a request may ask for, as OpenAI's chat API allows


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ranged(data: Mapping[str, Any], name: str, default: float, low: float, high: float | None = None, *,
            above: bool = False) -> float:
    """``data[name]`` as a number from ``low`` (exclusive with ``above``) to ``high``; PromptError names it."""
    value = data.get(name, default)
    if value is None:
        return default
    if not (_number(value) and (value > low if above else value >= low) and (high is None or value <= high)):
        bound = f"above {low:g}" if above else f"from {low:g}" + (f" to {high:g}" if high is not None else "")
        raise PromptError(f"'{name}' must be a number {bound}", field=name)
    return float(value)


def _count(data: Mapping[str, Any], name: str, high: int | None = None) -> int | None:
    """``data[name]`` as a whole number from 0 (to ``high``), or None when absent."""
    value = data.get(name)
    if value is None:
        return None
    if not (_whole(value) and value >= 0 and (high is None or value <= high)):
        raise PromptError(f"'{name}' must be a whole number from 0" + (f" to {high}" if high is not None else ""),
                          field=name)
    return int(value)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _stops(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS and all(
            isinstance(stop, str) and stop for stop in stops)):
        raise PromptError(f"'stop' must be a text or a list of at most {MAX_STOPS} texts, none of them empty",
                          field="stop")
    return tuple(stops)


def _json_schema(value: object) -> str | None:
    """The JSON schema that ``response_format`` asks the output to follow, as JSON text (None: any text).

    OpenAI's shapes: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) and ``{"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}``. Whether llama.cpp's grammar can express the
    schema is for the coordinator to say (it converts it).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PromptError("'response_format' must be an object with 'type' text, json_object or json_schema",
                          field="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return json.dumps(schema)
        raise PromptError("'response_format' of type json_schema must be given its schema as json_schema.schema (a "
                          "JSON object)", field="response_format")
    raise PromptError(f"'response_format' type {kind!r} is not supported: it must be text, json_object or "
                      "json_schema", field="response_format")


@dataclass(frozen=True)
class GenerateRequest:
    """One completion: a plain prompt, or chat messages rendered with the model's template."""

    prompt: str = ""
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = None
    top_k: int = DEFAULT_TOP_K                  # 0: off
    top_p: float = DEFAULT_TOP_P                # 1: off
    min_p: float = DEFAULT_MIN_P                # 0: off
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY  # 1: off
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N  # tokens the penalties look back over (prompt included); 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # alternatives to report per token (0: the chosen token's alone); None: none
    json_schema: str | None = None   # the JSON schema (JSON text) the output must follow (response_format)
    ignore_eos: bool = False         # llama-server's: the end-of-text tokens are never chosen (until max_tokens)
    draft_max: int | None = None     # llama-server's speculative.n_max: drafted tokens per step (0: none)

    @classmethod
    def parse(cls, data: Mapping[str, Any], context: int) -> GenerateRequest:
        """Validate a request from any client; PromptError names the field and what it must be.

        The control socket takes JSON from any process of this user: a wrong type must be an answer, not a
        coordinator that crashes on every resume until the request gives up. ``max_tokens`` beyond the context
        could never be generated, so it is refused rather than cut short without a word.
        """
        prompt, messages = data.get("prompt", ""), data.get("messages")
        if not isinstance(prompt, str):
            raise PromptError("'prompt' must be text", field="prompt")
        chat: tuple[tuple[str, str], ...] | None = None
        if messages is not None:
            if not (isinstance(messages, list) and messages and all(
                    isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content", ""), str) for message in messages)):
                raise PromptError("'messages' must be a list of objects with a text 'role' and 'content'",
                                  field="messages")
            chat = tuple((message["role"], message.get("content", "")) for message in messages)
        max_tokens = data.get("max_tokens", min(DEFAULT_MAX_TOKENS, context))
        if not (_number(max_tokens) and max_tokens == int(max_tokens) and max_tokens >= 1):
            raise PromptError("'max_tokens' must be a whole number from 1", field="max_tokens")
        if max_tokens > context:
            shown = int(max_tokens) if max_tokens < 1e18 else f"{max_tokens:g}"
            raise PromptError(f"max_tokens {shown} is more than the context holds ({context} tokens, "
                              "prompt included)", f"fix: ask for at most {context}, or raise 'context' in the "
                              "inventory", "max_tokens")
        temperature, seed = data.get("temperature", 0.0), data.get("seed")
        if not (_number(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
            raise PromptError(f"'temperature' must be a number from 0 to {MAX_TEMPERATURE:g}", field="temperature")
        if seed is not None and not _whole(seed):
            raise PromptError("'seed' must be a whole number", field="seed")
        ignore_eos, json_schema = data.get("ignore_eos"), _json_schema(data.get("response_format"))
        ignore_eos = False if ignore_eos is None else ignore_eos  # not sent (null is not sent, as elsewhere)
        if not isinstance(ignore_eos, bool):
            raise PromptError("'ignore_eos' must be true or false", field="ignore_eos")
        if ignore_eos and json_schema is not None:
            raise PromptError("'ignore_eos' cannot go with a 'response_format': its grammar ends the output with "
                              "the end-of-text token", field="ignore_eos")
        return cls(prompt=prompt, messages=chat, max_tokens=int(max_tokens), temperature=float(temperature),
                   seed=seed, top_k=_or(_count(data, "top_k"), DEFAULT_TOP_K),
                   top_p=_ranged(data, "top_p", DEFAULT_TOP_P, 0.0, 1.0),
                   min_p=_ranged(data, "min_p", DEFAULT_MIN_P, 0.0, 1.0),
                   repeat_penalty=_ranged(data, "repeat_penalty", DEFAULT_REPEAT_PENALTY, 0.0, above=True),
                   repeat_last_n=_or(_count(data, "repeat_last_n"), DEFAULT_REPEAT_LAST_N),
                   presence_penalty=_ranged(data, "presence_penalty", 0.0, -2.0, 2.0),
                   frequency_penalty=_ranged(data, "frequency_penalty", 0.0, -2.0, 2.0),
                   stop=_stops(data.get("stop")), logprobs=_count(data, "logprobs", MAX_LOGPROBS),
                   json_schema=json_schema, ignore_eos=ignore_eos, draft_max=_count(data, "speculative.n_max"))

    def sampling(self) -> dict[str, Any]:
        """The fields the coordinator samples with (core.engine.protocol.Generate's of the same names)."""
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "repeat_penalty": self.repeat_penalty,
                "repeat_last_n": self.repeat_last_n, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "logprobs": self.logprobs,
                "json_schema": self.json_schema, "ignore_eos": self.ignore_eos, "draft_max": self.draft_max}

    def to_dict(self) -> dict[str, Any]:
        """The request as the control socket carries it (``parse`` reads it back)."""
        data: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed,
                                **self.sampling(), "stop": list(self.stop)}
        schema = data.pop("json_schema")
        data["speculative.n_max"] = data.pop("draft_max")
        data["response_format"] = None if schema is None else {
            "type": "json_schema", "json_schema": {"name": "response", "schema": json.loads(schema)}}
        if self.messages is not None:
            data["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        else:
            data["prompt"] = self.prompt
        return data


class Service(Protocol):
    """The cluster as its endpoints see it (the controller is the one implementation)."""

    @property
    def context(self) -> int:
        """Tokens the context holds: the largest ``max_tokens`` a request may ask for."""
        ...

    def snapshot(self) -> ClusterStatus:
        """The current status of everything."""
        ...

    def fingerprint(self) -> str:
        """Identity of the configuration it runs (inventory and launch files)."""
        ...

    def explain_plan(self) -> list[dict[str, Any]]:
        """Each node's part of the plan on the running cluster's measured memory and speed and why, as `plan
        --json`'s rows (the web dashboard's plan); PlanError when the nodes' speeds were not measured."""
        ...

    def serving(self) -> bool:
        """Whether it runs on (False once it has shut down)."""
        ...

    def record(self, kind: str, message: str, node: str | None = None) -> None:
        """Log an event (an endpoint's own, such as a refused connection)."""
        ...

    async def wait_change(self, timeout: float) -> None:
        """Return on the next change or after ``timeout`` seconds."""
        ...

    async def generate(self, request: GenerateRequest, send: Send) -> None:
        """Run one request to completion (resuming it across faults), its events to ``send``."""
        ...

    async def reprofile(self) -> None:
        """Measure the nodes again, re-plan and reload, between requests."""
        ...

    async def retry(self) -> None:
        """Try failed and unreachable nodes now; return once they had their try."""
        ...

    async def shutdown(self, stop_workers: bool = True) -> list[str]:
        """Stop everything it started; what it could not stop, a line each."""
        ...
