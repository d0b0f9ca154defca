"""The coordinator's protocol, as typed messages: requests on its stdin, answers on its stdout, a JSON line each.

Both sides build and read them here, so the controller, the coordinator and a test's stand-in for it agree:

- requests: `Generate` (``replay`` holds tokens generated before a restart), `Cancel`, `Shutdown`;
- answers: `Ready` or `Failed` once at start-up; per request `PromptTokens`, `Progress` while the prompt or a
  replay is evaluated, a `Token` per new token, then `Done` or `Failed`; at any time `ComputeFailed` (a patched
  worker reported a failed graph compute; the step is retried in place) and `ComputeRetried` (the retry worked).
  `Exited` is never sent: the controller notes with it that the process ended (or was killed, with why).

A `ComputeFailed` with ``persistent`` set is the coordinator's last word: it exits with EXIT_COMPUTE_FAILED right
after, for the controller to restart that worker and the coordinator and resume the request.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypedDict

from core.service import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_REPEAT_PENALTY,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)

EXIT_COMPUTE_FAILED = 3  # the coordinator's exit code after a persistent compute failure (ComputeFailed.persistent)
# enum ggml_status (ggml.h) values other than GGML_STATUS_SUCCESS, as a worker reports them.
GGML_STATUS_NAMES = {-2: "GGML_STATUS_ALLOC_FAILED", -1: "GGML_STATUS_FAILED", 1: "GGML_STATUS_ABORTED"}


def status_name(status: int) -> str:
    """A ggml_status in words, e.g. ``GGML_STATUS_FAILED (-1)``; an unknown one by its number."""
    return f"{GGML_STATUS_NAMES.get(status, 'ggml_status')} ({status})"


@dataclass(frozen=True)
class Generate:
    """Run one request; ``prompt_tokens`` (the prompt as first tokenised) wins over ``messages`` and ``prompt``.

    The sampling fields mean what core.service.GenerateRequest's of the same names do (llama-server's defaults).
    """

    id: int
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_tokens: list[int] | None = None
    replay: list[int] = field(default_factory=list)
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None     # alternatives per token in each Token's logprobs; None: no logprobs
    json_schema: str | None = None  # JSON text of the schema the output must follow (llama.cpp's grammar sampler)
    ignore_eos: bool = False        # the end-of-text tokens are never chosen (llama-server's field)
    draft_max: int | None = None    # drafted tokens verified per step at most (0: none); None: the cluster's


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
    """A request (``id``) or the start-up (no ``id``) failed; ``field``: the request field at fault, if one is."""

    message: str
    id: int | None = None
    field: str | None = None


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


class TopLogprob(TypedDict):
    """One of the likeliest tokens at a position: its text (invalid UTF-8 replaced), bytes and log-probability."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobs(TopLogprob):
    """The chosen token's log-probability under the model (before any sampling knob), and the likeliest tokens."""

    top_logprobs: list[TopLogprob]


@dataclass(frozen=True)
class Token:
    """One new token and the text it completes (multi-byte characters arrive whole); its logprobs when asked;
    ``batch``: the sequences the decode step that gave it carried (1: decoded alone)."""

    id: int
    token: int
    text: str
    logprobs: TokenLogprobs | None = None
    batch: int = 1


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
    shared_tokens: int = 0  # of the prompt, copied from another sequence's KV cells instead of evaluated
    # node: its tokens were sampled where the output layer is (core.engine.chain); coordinator: from the logits
    sampled_on: str = ""
    drafted: int = 0   # tokens drafted for it and verified (speculative decoding)
    accepted: int = 0  # of those, the ones the model chose too (each one a token without a step of its own)
    draft_s: float = 0.0  # spent drafting for it (a draft model's decodes), here, before the steps it rode


@dataclass(frozen=True)
class ComputeFailed:
    """A worker reported a failed graph compute on a reply (patched workers); the coordinator retries the step."""

    endpoint: str      # the RPC endpoint the coordinator uses for that worker (the relay, or the worker itself)
    device: int        # the worker's device index
    status: int        # ggml_status: -1 FAILED, -2 ALLOC_FAILED, 1 ABORTED (see status_name)
    failures: int      # failed computes that report covers (>1 when several failed before a reply)
    attempt: int       # 1 for the first retry of this step, 2, ...
    id: int | None = None      # the request, if one was running
    persistent: bool = False   # retries exhausted: the coordinator exits (EXIT_COMPUTE_FAILED) for a restart


@dataclass(frozen=True)
class ComputeRetried:
    """The retried step succeeded."""

    endpoint: str
    attempts: int
    retry_ms: float    # from the failure being seen to the retried step's logits being ready
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
