"""Requests: first come, first served, up to ``api.parallel`` at once (the coordinator decodes them together);
each runs on the coordinator and, when the coordinator is lost, resumes from its own tokens on the next one, so
every client sees one stream with nothing lost or repeated."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.controller.admission import Admission, Turns
from core.controller.events import EventLog
from core.controller.supervisor import CoordinatorSupervisor, drain
from core.engine.protocol import Answer, Cancel, Done, Exited, Failed, Generate, Progress, PromptTokens, Token, encode
from core.errors import PromptError, RequestError
from core.service import GenerateRequest, Send
from core.status import CoordinatorState
from core.stop_text import StopText

MAX_RECOVERIES = 5  # per request
# Events a request waiting for the cluster to come back passes on to its client, as notices.
RECOVERY_NOTICES = frozenset({"watchdog", "coordinator-exit", "coordinator-failed", "node-failed", "worker-hung",
                              "node-reconnecting", "node-reconnected"})


class Mailboxes:
    """One coordinator's answers, each to the request attempt it names; its exit to every attempt."""

    def __init__(self, source: asyncio.Queue[Answer]) -> None:
        self.source = source
        self._boxes: dict[int, asyncio.Queue[Answer]] = {}
        self._exited: Exited | None = None
        self._task = asyncio.ensure_future(self._deliver())

    def open(self, rid: int) -> asyncio.Queue[Answer]:
        """The answers to attempt ``rid`` (its exit, at once, if the coordinator has already gone)."""
        box: asyncio.Queue[Answer] = asyncio.Queue()
        if self._exited is not None:
            box.put_nowait(self._exited)
        self._boxes[rid] = box
        return box

    def close(self, rid: int) -> None:
        """Attempt ``rid`` is over: later answers to it are dropped."""
        self._boxes.pop(rid, None)

    async def _deliver(self) -> None:
        while True:
            answer = await self.source.get()
            if isinstance(answer, Exited):
                self._exited = answer
                for box in self._boxes.values():
                    box.put_nowait(answer)
                return
            to = self._boxes.get(getattr(answer, "id", None) or 0)
            if to is not None:
                to.put_nowait(answer)


@dataclass
class RequestProgress:
    """One request's state, kept across coordinator restarts so that it can resume."""

    prompt_tokens: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # what the client was sent
    # The text held back while it may become one of the request's stop strings, with the tokens' logprobs.
    text: StopText[dict[str, Any]] = field(default_factory=StopText)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class RequestRunner:
    """Runs requests on the supervisor's coordinator, ``parallel`` at once, with resume, watchdog and cancel."""

    def __init__(self, supervisor: CoordinatorSupervisor, log: EventLog, bound_s: float,
                 failed_nodes: Callable[[], str], queue: int, *, parallel: int = 1) -> None:
        """``bound_s``: the watchdog's bound; ``failed_nodes``: why the nodes that are left out are, for a
        request the cluster cannot serve; ``queue``: how many requests may wait for a slot; ``parallel``: the
        coordinator's slots."""
        self.supervisor = supervisor
        self.log = log
        self.bound_s = bound_s
        self.failed_nodes = failed_nodes
        self.lock = Turns()  # requests together; a re-plan between requests alone
        self.served = 0
        self.prompt_tokens_shared = 0  # prompt tokens copied from another sequence's KV cells, not evaluated
        self.sampled_on_coordinator = 0  # requests whose logits came to the coordinator (sampling: node aside)
        self.tokens_drafted = 0     # drafted and verified (speculative decoding)
        self.tokens_accepted = 0    # of them, kept
        self.completion_tokens = 0  # generated, in every request
        self.completion_tokens_batched = 0  # of them, from a decode step that carried another sequence too
        self.waiting = 0            # in flight: generating, or queued behind those that are
        self.admission = Admission(parallel, queue, log.notify)
        self.recoveries = 0
        self.rates: dict[str, float | None] = {"prompt": None, "decode": None}  # tokens/s of the last request
        self.current: list[RequestProgress] = []  # the requests generating now
        # Every attempt of every request gets its own id: a cancel then reaches only the attempt it names.
        self._ids = itertools.count(1)
        self._mail: Mailboxes | None = None
        self._hang: asyncio.Task[str | None] | None = None  # one watchdog look for every attempt that waits

    def decode_rate(self) -> float | None:
        """Tokens/s of the request generating now that started first (since its first token), else of the last."""
        rates = self.request_rates()
        return rates[0] if rates else self.rates["decode"]

    def aggregate_decode_rate(self) -> float:
        """Tokens/s of every request generating now, together (0 when none is)."""
        return sum(self.request_rates())

    def request_rates(self) -> list[float]:
        """Tokens/s of each request generating now (since its first token), the oldest first."""
        return [rate for rate in map(_decode_rate, self.current) if rate is not None]

    async def generate(self, request: GenerateRequest, send: Send) -> None:
        """Run one request to completion, resuming it across coordinator restarts."""
        self.waiting += 1
        self.log.notify()
        try:
            async with self.admission.place(), self.lock.request():
                progress = RequestProgress(text=StopText(request.stop))
                self.current.append(progress)
                try:
                    await self._resume_until_done(request, progress, send)
                finally:
                    self.current.remove(progress)
        finally:
            self.waiting -= 1
            self.log.notify()

    def _mailbox(self, messages: asyncio.Queue[Answer], rid: int) -> asyncio.Queue[Answer]:
        """Attempt ``rid``'s answers from the coordinator whose queue is ``messages``."""
        if self._mail is None or self._mail.source is not messages:
            self._mail = Mailboxes(messages)
        return self._mail.open(rid)

    async def _hung(self, waiting: str, arrived: Callable[[], bool]) -> str | None:
        """The watchdog's verdict; attempts that time out together share one look (and one kill)."""
        if self._hang is None or self._hang.done():
            self._hang = asyncio.ensure_future(self.supervisor.watchdog.hung(waiting, arrived))
        return await asyncio.shield(self._hang)

    async def _resume_until_done(self, request: GenerateRequest, progress: RequestProgress, send: Send) -> None:
        while True:
            await self._await_coordinator(progress.recoveries, send)
            process, messages = self.supervisor.process, self.supervisor.messages
            if process is None or process.stdin is None:
                continue
            cause = await self._attempt(request, progress, next(self._ids), process=process, messages=messages,
                                        send=send)
            if cause is None:
                return
            self.recoveries += 1
            progress.recoveries.append({"at_token": len(progress.generated), "time": time.time(), "cause": cause})
            if len(progress.recoveries) > MAX_RECOVERIES:
                raise RequestError(f"gave up after {MAX_RECOVERIES} recoveries; last: {cause}")
            await send({"event": "notice", "message": f"recovering: {cause}; resuming"})

    async def _attempt(self, request: GenerateRequest, progress: RequestProgress, rid: int, *,
                       process: asyncio.subprocess.Process, messages: asyncio.Queue[Answer],
                       send: Send) -> str | None:
        """Run the request on this coordinator: None once it is done, else why the coordinator was lost."""
        # A resumed request continues exactly the tokens it started from: the prompt as first tokenised (a chat
        # as first rendered with the model's template), then what it generated, replayed as first decoded.
        prompt = progress.prompt_tokens is None
        message = Generate(rid, request.max_tokens, request.temperature, request.seed,
                           prompt=request.prompt if prompt and request.messages is None else None,
                           messages=[{"role": role, "content": content} for role, content in request.messages]
                           if prompt and request.messages is not None else None,
                           prompt_tokens=progress.prompt_tokens, replay=list(progress.generated),
                           **request.sampling())
        self.supervisor.set_state(CoordinatorState.GENERATING)
        box = self._mailbox(messages, rid)
        try:
            await _write(process, message)
            return await self._follow(progress, rid, process=process, messages=box, send=send)
        except asyncio.CancelledError:  # its client gave up on it (another choice of its request failed)
            await asyncio.shield(_write(process, Cancel(rid)))
            raise
        finally:
            if self._mail is not None:
                self._mail.close(rid)

    async def _follow(self, progress: RequestProgress, rid: int, *, process: asyncio.subprocess.Process,
                      messages: asyncio.Queue[Answer], send: Send) -> str | None:
        """Attempt ``rid``'s answers until it is done (None) or the coordinator is lost (why)."""
        while True:
            try:
                async with asyncio.timeout(self.bound_s):  # no task per token, unlike wait_for
                    answer = await messages.get()
            except TimeoutError:
                cause = await self._hung(f"after {len(progress.generated)} tokens", lambda: not messages.empty())
                if cause is None:
                    continue
                await drain(messages, lambda answer: isinstance(answer, Exited), 10)
                return cause
            if isinstance(answer, Exited):
                why = f" ({answer.cause})" if answer.cause else ""  # it gave up on a persistent compute failure
                return f"coordinator exited with {answer.code}{why} after {len(progress.generated)} tokens"
            if isinstance(answer, PromptTokens):
                progress.prompt_tokens = list(answer.tokens)
            elif isinstance(answer, Progress):
                self.supervisor.status.progress = f"{answer.phase} {answer.done}/{answer.total} tokens"
                self.log.notify()
            elif isinstance(answer, Token):
                self.supervisor.status.progress = ""
                self._note_token(progress, answer)
                try:
                    await _forward(progress, answer.text, answer.logprobs, send)
                except ConnectionError:
                    await self._cancel(process, messages, rid, "client disconnected")
                    raise
                if progress.text.stopped:  # checked here, in the controller, a stop holds across coordinator restarts
                    done = await self._cancel(process, messages, rid, "the text reached a stop string")
                    await self._finish(progress, done or _clocked(progress, rid), send)
                    return None
            elif isinstance(answer, Failed):
                self._idle()
                raise PromptError(answer.message, field=answer.field)
            elif isinstance(answer, Done):
                self._idle()
                await self._finish(progress, answer, send)
                return None

    def _note_token(self, progress: RequestProgress, answer: Token) -> None:
        progress.generated.append(answer.token)
        self.completion_tokens += 1
        self.completion_tokens_batched += int(answer.batch > 1)
        if progress.first_token_s is None:
            progress.first_token_s = time.perf_counter() - progress.started
        last = progress.recoveries[-1] if progress.recoveries else None
        if last is not None and "first_token_after_s" not in last:
            last["first_token_after_s"] = time.time() - last["time"]
            self.log.record("recovered", f"request resumed at token {last['at_token']}, "
                            f"{last['first_token_after_s']:.2f}s after the fault was seen")

    async def _finish(self, progress: RequestProgress, answer: Done, send: Send) -> None:
        """The request is done: the last text (the decoder's tail, what stop strings held back), then `done`."""
        self.served += 1
        self.prompt_tokens_shared += answer.shared_tokens
        self.sampled_on_coordinator += answer.sampled_on == "coordinator"
        self.tokens_drafted += answer.drafted
        self.tokens_accepted += answer.accepted
        self.rates = {"prompt": _rate(answer.prompt_tokens - answer.shared_tokens, answer.prompt_s),
                      "decode": _rate(answer.completion_tokens, answer.decode_s)}
        await _forward(progress, answer.text, None, send)
        text, logprobs = progress.text.finish()
        await _send_text(progress, text, logprobs, send)
        await send({
            "event": "done", "text": "".join(progress.texts),
            "reason": "stop" if progress.text.stopped else answer.reason,
            "prompt_tokens": len(progress.prompt_tokens or []), "completion_tokens": len(progress.generated),
            # prompt_n: what this coordinator evaluated before its first new token (after a recovery, the replay
            # too); predicted_n: the tokens it then generated.
            "timings": {"total_s": time.perf_counter() - progress.started, "first_token_s": progress.first_token_s,
                        "prompt_s": answer.prompt_s, "decode_s": answer.decode_s,
                        "decode_tokens_per_s": _rate(answer.completion_tokens, answer.decode_s),
                        "prompt_n": answer.prompt_tokens + answer.replayed_tokens - answer.shared_tokens,
                        "cache_n": answer.shared_tokens,
                        "predicted_n": answer.completion_tokens},
            "recoveries": progress.recoveries})

    async def _cancel(self, process: asyncio.subprocess.Process, messages: asyncio.Queue[Answer], rid: int,
                      why: str) -> Done | None:
        """Stop the request (its client went away, or its text is complete) and wait until the coordinator is free
        again; its `Done`, unless the coordinator went away."""
        self.log.record("cancelled", f"{why}; cancelling request {rid}")
        await _write(process, Cancel(rid))
        ended: list[Answer] = []

        def last(answer: Answer) -> bool:
            if isinstance(answer, Exited) or (isinstance(answer, Done | Failed) and answer.id == rid):
                ended.append(answer)
            return bool(ended)

        await drain(messages, last, self.bound_s)
        self._idle()
        return ended[0] if ended and isinstance(ended[0], Done) else None

    def _idle(self) -> None:
        """A request ended: the coordinator is ready once none other generates."""
        if len(self.current) <= 1:
            self.supervisor.set_state(CoordinatorState.READY)

    async def _await_coordinator(self, recoveries: list[dict[str, Any]], send: Send) -> None:
        """Until the coordinator is ready; meanwhile the client hears what the recovery runs into."""
        supervisor = self.supervisor
        window = supervisor.recovery_window()
        deadline = time.monotonic() + window
        seen = self.log.count
        while not supervisor.ready.is_set():
            if supervisor.status.state == CoordinatorState.FAILED:
                raise RequestError(f"the cluster cannot serve ({self.failed_nodes() or 'no node failed'}): "
                                   f"{supervisor.status.last_error}")
            if time.monotonic() > deadline:
                raise RequestError(f"the cluster did not recover within {window:.0f}s "
                                   f"({supervisor.status.last_error or 'coordinator not ready'})")
            await self.log.wait_change(0.5)
            news, seen = self.log.since(seen), self.log.count
            for event in news:
                if event.kind in RECOVERY_NOTICES:
                    await send({"event": "notice", "message": f"{event.node}: {event.message}" if event.node
                                else event.message})
        if recoveries and "resumed_after_s" not in recoveries[-1]:
            recoveries[-1]["resumed_after_s"] = time.time() - recoveries[-1]["time"]


async def _forward(progress: RequestProgress, text: str, logprobs: Mapping[str, Any] | None, send: Send) -> None:
    """A token's text to the client, once no stop string can begin in it (with its logprobs, placed in the text)."""
    item = None if logprobs is None else {**logprobs, "text_offset": progress.text.pushed}
    await _send_text(progress, *progress.text.push(text, item), send)


async def _send_text(progress: RequestProgress, text: str, logprobs: list[dict[str, Any]], send: Send) -> None:
    if text or logprobs:
        progress.texts.append(text)
        await send({"event": "token", "text": text, **({"logprobs": logprobs} if logprobs else {})})


def _clocked(progress: RequestProgress, rid: int) -> Done:
    """The `Done` of a request whose coordinator went away before it sent one: times from the controller's clock."""
    prompt_s = progress.first_token_s or 0.0
    return Done(rid, "cancelled", "", prompt_tokens=len(progress.prompt_tokens or []), replayed_tokens=0,
                completion_tokens=len(progress.generated), prompt_s=prompt_s,
                decode_s=time.perf_counter() - progress.started - prompt_s)


async def _write(process: asyncio.subprocess.Process, message: Generate | Cancel) -> None:
    if process.stdin is not None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # it died: its exit is on the way
            process.stdin.write(encode(message))
            await process.stdin.drain()


def _decode_rate(progress: RequestProgress) -> float | None:
    """A request's tokens/s since its first token; None before its second."""
    if progress.first_token_s is None or len(progress.generated) < 2:
        return None
    return (len(progress.generated) - 1) / (time.perf_counter() - progress.started - progress.first_token_s)


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None
