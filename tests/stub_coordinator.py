"""A stand-in for the coordinator: speaks core.engine.protocol, loads nothing, and dies, stalls or fails on cue.

`python -m tests.stub_coordinator CONFIG`; the cues are a JSON file named by $GGML_STUB_CUES, and every start
of the stub counts itself in the file beside it (``<cues>.starts``), so a cue can name the start it is for:

- ``load_s``: seconds a load takes (0.05); ``loading``: {start: "die" | "hang" | "fail"} during the load;
- ``prompt_s``: seconds of busy CPU per 512-token batch of prompt (a long prompt on a slow cluster);
- ``die_at`` / ``stall_at``: {start: k}: exit 134 / sleep without CPU after the k-th token of that start;
- ``compute_fail``: {start: {"at": k, "node": i, "attempts": n, "persistent": bool}}: after the k-th token of that
  start, the worker at endpoint i (of the config's) fails the next step's compute n times in a row, each reported
  as `ComputeFailed` (attempt 1..n); then the step is retried in place (`ComputeRetried`, 4.2 ms) and the
  request goes on, or with "persistent" the n-th report is the last word and the stub exits with
  EXIT_COMPUTE_FAILED (3), as the coordinator does when its retries are exhausted.

Tokens are a function of the prompt and the position, so a resumed request's replay can be checked: a replay
that differs from what this stub would have generated is answered `Failed`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from core.engine.protocol import (
    EXIT_COMPUTE_FAILED,
    Cancel,
    ComputeFailed,
    ComputeRetried,
    Done,
    Failed,
    Generate,
    Progress,
    PromptTokens,
    Ready,
    Shutdown,
    Token,
    decode_request,
    encode,
)
from core.model import BATCH  # the prompt batch the real coordinator evaluates in

_OUT = threading.Lock()


def emit(message: Any) -> None:
    with _OUT:
        sys.stdout.buffer.write(encode(message))
        sys.stdout.flush()


def token_at(prompt: list[int], index: int) -> int:
    """The stub's greedy token at ``index`` after ``prompt``."""
    return (31 * (sum(prompt) + index) + 7) % 50 + 3


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def fail_computes(endpoint: str, cue: dict[str, Any], rid: int) -> None:
    """Report ``cue``'s failed computes on ``endpoint``; then the retry that worked, or exit as one that gave up."""
    attempts, persistent = int(cue.get("attempts", 1)), bool(cue.get("persistent", False))
    for attempt in range(1, attempts + 1):
        emit(ComputeFailed(endpoint, 0, -1, 1, attempt, rid, persistent and attempt == attempts))
    if persistent:
        os._exit(EXIT_COMPUTE_FAILED)
    emit(ComputeRetried(endpoint, attempts, 4.2, rid))


def main() -> int:
    endpoints = json.loads(sys.argv[1])["endpoints"]
    cues_path = Path(os.environ["GGML_STUB_CUES"])
    cues = json.loads(cues_path.read_text())
    counter = cues_path.with_name(cues_path.name + ".starts")
    start = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(start))
    key = str(start)
    time.sleep(float(cues.get("load_s", 0.05)))
    loading = cues.get("loading", {}).get(key)
    if loading == "die":
        os._exit(134)
    if loading == "hang":
        time.sleep(3600)
    if loading == "fail":
        emit(Failed("cannot load the model: the stub was told to fail"))
        return 1
    emit(Ready(0.05, 4096, 53))
    cancelled: set[int] = set()
    requests: list[Generate] = []
    arrived = threading.Condition()

    def read() -> None:
        for line in sys.stdin:
            request = decode_request(line)
            with arrived:
                if isinstance(request, Cancel):
                    cancelled.add(request.id)
                elif isinstance(request, Generate):
                    requests.append(request)
                elif isinstance(request, Shutdown):
                    os._exit(0)
                arrived.notify()
        os._exit(0)

    threading.Thread(target=read, daemon=True).start()
    produced = 0  # tokens this start generated, for die_at / stall_at
    while True:
        with arrived:
            while not requests:
                arrived.wait()
            request = requests.pop(0)
        prompt = request.prompt_tokens or [1] + [byte % 50 + 3 for byte in (request.prompt or "").encode()]
        emit(PromptTokens(request.id, prompt))
        for done in range(BATCH, len(prompt) + BATCH, BATCH):
            busy(float(cues.get("prompt_s", 0.0)))
            emit(Progress(request.id, "prompt", min(done, len(prompt)), len(prompt)))
        if request.replay != [token_at(prompt, index) for index in range(len(request.replay))]:
            emit(Failed("the replay is not what was generated", request.id))
            continue
        generated, reason = len(request.replay), "length"
        while generated < request.max_tokens:
            if request.id in cancelled:
                reason = "cancelled"
                break
            token = token_at(prompt, generated)
            generated += 1
            produced += 1
            emit(Token(request.id, token, f" t{token}"))
            if cues.get("die_at", {}).get(key) == produced:
                os._exit(134)
            if cues.get("stall_at", {}).get(key) == produced:
                time.sleep(3600)
            failing = cues.get("compute_fail", {}).get(key)
            if failing is not None and failing["at"] == produced:
                fail_computes(endpoints[failing.get("node", 0)], failing, request.id)
            time.sleep(0.002)
        emit(Done(request.id, reason, "", len(prompt), len(request.replay), generated - len(request.replay),
                  0.01, 0.01))


if __name__ == "__main__":
    sys.exit(main())
