"""What every way into the cluster asks of it: one generation request, validated in one place."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import PromptError

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
