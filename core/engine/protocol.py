"""The coordinator's protocol, as typed messages: requests on its stdin, answers on its stdout, a JSON line each.

Both sides build and read them here, so the controller, the coordinator and a test's stand-in for it agree:

- requests: `Generate` (``replay`` holds tokens generated before a restart), `Cancel`, `Shutdown`;
- answers: `Ready` or `Failed` once at start-up; per request `PromptTokens`, `Progress` while the prompt or a
  replay is evaluated, a `Token` per new token, then `Done` or `Failed`. `Exited` is never sent: the
  controller notes with it that the process ended (or was killed, with why).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Generate:
    """Run one request; ``prompt_tokens`` (the prompt as first tokenised) wins over ``messages`` and ``prompt``."""

    id: int
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_tokens: list[int] | None = None
    replay: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Cancel:
    """End request ``id`` after the token in progress (or before it starts); any other id is dropped."""

    id: int


@dataclass(frozen=True)
class Shutdown:
    """Exit."""


@dataclass(frozen=True)
class Ready:
    """The model is loaded across the workers."""

    load_s: float
    n_ctx: int
    n_vocab: int


@dataclass(frozen=True)
class Failed:
    """A request (``id``) or the start-up (no ``id``) failed."""

    message: str
    id: int | None = None


@dataclass(frozen=True)
class PromptTokens:
    """The request's prompt as tokens: what a resumed request must continue from."""

    id: int
    tokens: list[int]


@dataclass(frozen=True)
class Progress:
    """How far the prompt (``phase`` "prompt") or a replay ("replay") is evaluated."""

    id: int
    phase: str
    done: int
    total: int


@dataclass(frozen=True)
class Token:
    """One new token and the text it completes (multi-byte characters arrive whole)."""

    id: int
    token: int
    text: str


@dataclass(frozen=True)
class Done:
    """The request's end: why, the last text held back, counts and timings."""

    id: int
    reason: str  # length | stop | cancelled
    text: str
    prompt_tokens: int
    replayed_tokens: int
    completion_tokens: int
    prompt_s: float
    decode_s: float


@dataclass(frozen=True)
class ComputeFailed:
    """A worker reported a failed graph compute on a reply (patched workers); the coordinator retries the step."""

    endpoint: str
    device: int
    status: int
    failures: int
    attempt: int
    id: int | None = None
    persistent: bool = False


@dataclass(frozen=True)
class ComputeRetried:
    """The retried step succeeded."""

    endpoint: str
    attempts: int
    retry_ms: float
    id: int | None = None


@dataclass(frozen=True)
class Exited:
    """The process ended with ``code`` (noted by the controller, with ``cause`` when it killed it)."""

    code: int
    cause: str = ""


Request = Generate | Cancel | Shutdown
Answer = Ready | Failed | PromptTokens | Progress | Token | Done | ComputeFailed | ComputeRetried | Exited

_REQUESTS: dict[str, type[Request]] = {"generate": Generate, "cancel": Cancel, "shutdown": Shutdown}
_ANSWERS: dict[str, type[Answer]] = {"ready": Ready, "error": Failed, "prompt": PromptTokens, "progress": Progress,
                                     "token": Token, "done": Done, "compute_failed": ComputeFailed,
                                     "compute_retried": ComputeRetried, "exit": Exited}
_NAMES = {kind: name for table in (_REQUESTS, _ANSWERS) for name, kind in table.items()}


def encode(message: Request | Answer) -> bytes:
    """One protocol line."""
    key = "op" if isinstance(message, Generate | Cancel | Shutdown) else "event"
    return (json.dumps({key: _NAMES[type(message)], **asdict(message)}) + "\n").encode()


def decode_request(line: str | bytes) -> Request:
    """A request line as its message; ValueError when it is not one."""
    message: Request = _decode(line, "op", _REQUESTS)
    return message


def decode_answer(line: str | bytes) -> Answer:
    """An answer line as its message; ValueError when it is not one (llama.cpp may print to stdout too)."""
    message: Answer = _decode(line, "event", _ANSWERS)
    return message


def _decode(line: str | bytes, key: str, table: dict[str, Any]) -> Any:
    data = json.loads(line)
    if not isinstance(data, dict) or data.get(key) not in table:
        raise ValueError(f"not a protocol line: {str(line)[:120]!r}")
    kind = table[data.pop(key)]
    known = {item.name for item in fields(kind)}
    try:
        return kind(**{name: value for name, value in data.items() if name in known})
    except TypeError as exc:
        raise ValueError(f"a {kind.__name__} line without its fields: {exc}") from None
