"""What every way into the cluster (the control socket, the OpenAI API, Prometheus) may ask of it: the Service,
and one generation request, validated in one place."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import PromptError
from core.status import ClusterStatus

Send = Callable[[dict[str, Any]], Awaitable[None]]  # a request's events to its client (raises ConnectionError)

DEFAULT_MAX_TOKENS = 128
MAX_TEMPERATURE = 100.0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class GenerateRequest:
    """One completion: a plain prompt, or chat messages rendered with the model's template."""

    prompt: str = ""
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = None

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
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise PromptError("'seed' must be a whole number", field="seed")
        return cls(prompt=prompt, messages=chat, max_tokens=int(max_tokens), temperature=float(temperature),
                   seed=seed)

    def to_dict(self) -> dict[str, Any]:
        """The request as the control socket carries it (``parse`` reads it back)."""
        data: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}
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
