"""The controller: one detached process per cluster that owns the workers, the plan and the coordinator.

It starts (or adopts) each node's supervised worker, follows its events, checks it with a HELLO probe,
plans the layers, runs the coordinator as a child, restarts it when it dies and resumes the request in
flight. Clients talk to it over a Unix socket with JSON lines (see `core.client`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.controller.events import EventLog, Tasks
from core.controller.fleet import Fleet, FleetHooks
from core.controller.health import READY_TIMEOUT_S, NodeRuntime
from core.controller.placement import Placement
from core.controller.watchdog import Watchdog
from core.endpoints.api import ApiServer, serve_api
from core.endpoints.control import serve_control
from core.endpoints.prometheus import MetricsServer, serve_metrics
from core.engine import child
from core.engine.coordinator import CoordinatorConfig
from core.engine.profile import ProfileCache
from core.errors import (
    ClusterError,
    PlanError,
    PromptError,
    RequestError,
    WorkerError,
)
from core.inventory import Inventory
from core.model import ModelFacts, read_model
from core.nodes import worker
from core.nodes.build import cache_dir
from core.service import GenerateRequest
from core.state import Launch, StateDir, read_launch
from core.status import (
    ClusterStatus,
    CoordinatorState,
    CoordinatorStatus,
)

log = logging.getLogger("ggml-cluster.controller")

RECOVERY_TIMEOUT_S = 120.0  # a request waits at least this long for the cluster to come back
LOAD_MIN_S = 60.0           # a model load may always take this long
LOAD_SLACK = 4.0            # ... and this many times what the measured load rate predicts
ASSUMED_LOAD_RATE = 10e6    # bytes/s before a load was measured: a slow link (a stall is the watchdog's)
MAX_START_FAILURES = 5      # coordinator starts that fail within the recovery window before it counts as failed
# Events a request waiting for the cluster to come back passes on to its client, as notices.
RECOVERY_NOTICES = frozenset({"watchdog", "coordinator-exit", "coordinator-failed", "node-failed", "worker-hung",
                              "node-reconnecting", "node-reconnected"})
MAX_RECOVERIES = 5          # per request
GIL_SWITCH_S = 0.0002        # the GIL switch interval in the controller (see main)
LIVENESS_WINDOW_S = 1.0     # a silent pipeline is looked at twice this far apart before it is called hung


class CoordinatorLost(ClusterError):
    """The coordinator exited, or hung and was killed, before it was ready."""


def _exit_cause(code: int) -> str:
    """Why a coordinator process ended, from its exit status."""
    if code in (-6, 134):
        return f"exit {code} (aborted: a worker connection was lost)"
    return f"exit {code} ({worker.classify_exit(code if code >= 0 else 128 - code, '')})"


@dataclass
class _Progress:
    """One request's state, kept across coordinator restarts so that it can resume."""

    prompt_tokens: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class Controller:
    """The daemon's state and tasks."""

    def __init__(self, inventory: Inventory, launch: Launch, state: StateDir) -> None:
        self.inventory = inventory
        self.launch = launch
        self.state = state
        self.model: ModelFacts = read_model(Path(launch.model))
        self.coordinator = CoordinatorStatus(endpoint=f"unix:{state.socket}")
        self.log = EventLog(state.events)
        self.tasks = Tasks()
        self.fleet = Fleet(inventory, state, self.log, self.tasks, FleetHooks(
            in_use=self._in_use, worker_lost=self._worker_lost, node_ready=self._node_ready), client=launch.protocol)
        self.nodes = self.fleet.nodes
        self.placement = Placement(inventory, self.model, model_path=Path(launch.model), protocol=launch.protocol,
                                   state=state, log=self.log, cache=ProfileCache(cache_dir() / "profiles"))
        self.watchdog = Watchdog(self.fleet, self.placement, self.log, inventory.watchdog,
                                 coordinator_pid=self._coordinator_pid, kill_coordinator=self._kill_coordinator)
        self._restart = asyncio.Event()  # set: the coordinator's owner should start a fresh one (a new plan)
        self._capacity = asyncio.Event()  # set: a node became ready, a failed plan may fit now
        self._load_rate: float | None = None  # bytes/s of the slowest model load so far (a cold one, usually)
        self._loads = 0  # coordinators that finished loading
        self._left_running: list[str] = []  # what `down` could not stop
        self.started_at = time.time()
        self.requests_served = 0
        self.requests_waiting = 0  # in flight: generating, or queued behind the one that is
        self.recoveries = 0
        self.rates: dict[str, float | None] = {"prompt": None, "decode": None}  # tokens/s of the last request
        self._current: _Progress | None = None  # the request generating now
        self.metrics: MetricsServer | None = None
        self.api: ApiServer | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._coordinator_ready = asyncio.Event()
        self._request_lock = asyncio.Lock()
        # Every attempt of every request gets its own id: a cancel then reaches only the attempt it names.
        self._attempt_ids = itertools.count(1)
        self._stopping = False
        self.finished = asyncio.Event()

    # --- status and events -------------------------------------------------------------------------

    @property
    def context(self) -> int:
        """Tokens the context holds."""
        return self.inventory.context

    def fingerprint(self) -> str:
        """Identity of what this controller runs: its inventory and launch files."""
        return self.state.fingerprint()

    def serving(self) -> bool:
        """Whether it runs on (False once it has shut down)."""
        return not self.finished.is_set()

    def snapshot(self) -> ClusterStatus:
        """The current status of everything."""
        plan, profiles = self.placement.plan, self.placement.profiles
        return ClusterStatus(
            cluster=self.inventory.cluster, model=self.model.name,
            coordinator=CoordinatorStatus(**vars(self.coordinator)),
            nodes=self.fleet.statuses(),
            events=list(self.log.recent), n_layers=self.model.n_layers,
            tensor_split=list(plan.tensor_split) if plan else [],
            controller_pid=os.getpid(), started_at=self.started_at, requests_served=self.requests_served,
            requests_in_flight=self.requests_waiting, recoveries=self.recoveries,
            prompt_tokens_per_s=self.rates["prompt"], decode_tokens_per_s=self._decode_rate(),
            metrics_endpoint=self.metrics.address if self.metrics else "",
            api_endpoint=self.api.address if self.api else "",
            strategy=plan.strategy if plan else "",
            predicted_ms=None if plan is None or plan.predicted_total_s is None else plan.predicted_total_s * 1000,
            overhead_ms=None if profiles is None else profiles.overhead_s * 1000)

    def _decode_rate(self) -> float | None:
        """Tokens/s of the request generating now (since its first token), else of the last one."""
        current = self._current
        if current is None or current.first_token_s is None or len(current.generated) < 2:
            return self.rates["decode"]
        return (len(current.generated) - 1) / (time.perf_counter() - current.started - current.first_token_s)

    def record(self, kind: str, message: str, node: str | None = None) -> None:
        """Log an event, keep it for `status`, and wake watchers."""
        self.log.record(kind, message, node)

    def notify(self) -> None:
        """Wake every watcher: something changed."""
        self.log.notify()

    async def wait_change(self, timeout: float) -> None:
        """Return on the next change or after ``timeout``."""
        await self.log.wait_change(timeout)

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        self.tasks.spawn(coroutine)

    # --- what the nodes tell ------------------------------------------------------------------------

    def _in_use(self, name: str) -> bool:
        """The running coordinator holds this node's worker."""
        return self._process is not None and self.placement.uses(name)

    def _worker_lost(self, name: str, failed: bool) -> None:
        """A worker exited (its supervisor restarts it) or its node failed: the coordinator's link to it is gone.
        Idle, the coordinator would only find out on the next request: restart it now."""
        if failed or not self._request_lock.locked():
            self._replan_after_loss(name)

    def _node_ready(self, name: str) -> None:
        """A node became ready: a plan that did not fit may now; a node the plan left out may be used again."""
        self._capacity.set()
        if self.placement.left_out(name) and self._coordinator_ready.is_set():
            self._spawn(self._replan_when_idle(self.nodes[name]))

    async def _replan_when_idle(self, runtime: NodeRuntime) -> None:
        """A node the plan left out is back: re-plan to use it, between requests."""
        async with self._request_lock:
            if not (self.placement.left_out(runtime.name) and runtime.ready.is_set()
                    and self._coordinator_ready.is_set()):
                return
            loads = self._loads
            self.restart_coordinator(f"{runtime.node.name} is back; re-planning to use it")
            while self._loads == loads and self.coordinator.state != CoordinatorState.FAILED:
                await self.wait_change(0.5)

    # --- plan and coordinator ----------------------------------------------------------------------

    async def _start_coordinator(self) -> None:
        """Wait for the workers, plan, start the coordinator and wait until it has loaded the model.

        Raises PlanError when the model cannot be placed, CoordinatorLost when the process exits or hangs
        during the load (what is stuck is killed), ClusterError when it reports that it cannot load.
        """
        self.coordinator.state = CoordinatorState.LOADING
        self.notify()
        usable = await self.fleet.verified()
        plan = await self.placement.place(usable, self.nodes)
        endpoints = []
        # A node without layers stays out: it would only add a connection the coordinator dies with.
        for name in plan.used:
            endpoint = self.nodes[name].relayed
            if endpoint is None:
                raise WorkerError(f"node {name} has no endpoint")
            endpoints.append(f"{endpoint[0]}:{endpoint[1]}")
        config = CoordinatorConfig(model=self.launch.model, endpoints=tuple(endpoints),
                                   tensor_split=plan.used_split, context=self.inventory.context)
        self.record("plan", self.placement.describe())
        started = time.monotonic()
        with self.state.coordinator_log.open("ab") as log_file:
            log_start = log_file.tell()
            process = self._process = await child.start("core.engine.coordinator", config.to_json(), log_file,
                                                        stdin=True)
        self.coordinator.pid = process.pid
        messages = self._messages = asyncio.Queue()
        self._spawn(self._read_coordinator(process, messages))
        message = await self._await_load(messages, started)
        if message.get("event") == "exit":
            raise CoordinatorLost(str(message.get("cause") or _exit_cause(int(message.get("code", -1)))))
        if message.get("event") != "ready":
            await self._kill_coordinator()
            raise ClusterError(f"the coordinator could not load the model: {message.get('message')}",
                               f"see {self.state.coordinator_log}")
        load_s = time.monotonic() - started
        rate = self.model.path.stat().st_size / max(load_s, 1e-3)
        self._load_rate = rate if self._load_rate is None else min(self._load_rate, rate)
        with self.state.coordinator_log.open("rb") as log_file:
            log_file.seek(log_start)
            self.placement.check(log_file.read().decode(errors="replace"))
        self.coordinator.state = CoordinatorState.READY
        self.coordinator.last_error = ""
        self._loads += 1
        self._coordinator_ready.set()
        self.record("coordinator-ready", f"model loaded across {len(plan.used)} worker(s) in {load_s:.1f}s")

    def load_deadline(self) -> float:
        """Seconds a model load may take: generous against the slowest load measured (or an assumed rate before
        the first), since a stall is caught sooner by the watchdog; a cold load over a slow link must not be cut
        short."""
        rate = self._load_rate or ASSUMED_LOAD_RATE
        return max(LOAD_MIN_S, LOAD_SLACK * self.model.path.stat().st_size / rate)

    def recovery_window(self) -> float:
        """How long a request waits for the cluster to come back: never less than a model load."""
        return max(RECOVERY_TIMEOUT_S, self.load_deadline() + READY_TIMEOUT_S)

    async def _await_load(self, messages: asyncio.Queue[dict[str, Any]], started: float) -> dict[str, Any]:
        """The coordinator's first message (ready or error), or its exit; a stalled or overlong load is killed
        and reported as an exit."""
        deadline = started + self.load_deadline()
        while True:
            try:
                async with asyncio.timeout(max(0.0, min(self.inventory.watchdog, deadline - time.monotonic()))):
                    return await messages.get()
            except TimeoutError:
                if time.monotonic() >= deadline:
                    cause = f"the model did not load within {self.load_deadline():.0f}s"
                    self.record("watchdog", f"{cause}; killing the coordinator and recovering")
                    await self._kill_coordinator()
                else:
                    found = await self.watchdog.hung("while loading the model", lambda: not messages.empty())
                    if found is None:
                        continue
                    cause = found
                await _drain(messages, lambda answer: answer.get("event") == "exit", 10)
                return {"event": "exit", "cause": cause}

    async def _coordinator_loop(self) -> None:
        """The one owner of the coordinator's life: starts it, restarts it when it exits or a restart is asked
        for, and when the model cannot be placed, waits (FAILED) until the nodes change."""
        failures: list[float] = []
        while not self._stopping:
            self._restart.clear()
            try:
                await self._start_coordinator()
            except PlanError as exc:
                self._coordinator_failed(f"cannot place the model: {exc}")
                await self._await_capacity()
                continue
            except CoordinatorLost as exc:
                if self._stopping:
                    return
                self._coordinator_exited(str(exc), loading=True)
                continue
            except ClusterError as exc:
                now = time.monotonic()
                failures = [when for when in failures if now - when < self.recovery_window()] + [now]
                if len(failures) >= MAX_START_FAILURES:
                    self._coordinator_failed(f"{exc} ({len(failures)} tries)")
                    failures = []
                    await self._await_capacity()
                else:
                    self.coordinator.last_error = str(exc)
                    self.record("coordinator-failed", f"{exc}; trying again in {len(failures)}s")
                    await asyncio.sleep(len(failures))
                continue
            failures = []
            process = self._process
            exited = asyncio.ensure_future(process.wait()) if process is not None else None
            wanted = asyncio.ensure_future(self._restart.wait())
            await asyncio.wait([task for task in (exited, wanted) if task is not None],
                               return_when=asyncio.FIRST_COMPLETED)
            wanted.cancel()
            asked = self._restart.is_set()
            await self._kill_coordinator()
            while self._process is not None:  # until its reader has seen it go
                await self.wait_change(0.1)
            if not asked and not self._stopping and process is not None:
                self._coordinator_exited(_exit_cause(process.returncode if process.returncode is not None else -1))

    def _coordinator_exited(self, cause: str, loading: bool = False) -> None:
        self.coordinator.restarts += 1
        self.coordinator.last_error = cause
        self.coordinator.state = CoordinatorState.LOADING
        self.record("coordinator-exit", f"coordinator {'lost while loading the model' if loading else 'exited'}: "
                    f"{cause}; restarting it")

    def _coordinator_failed(self, reason: str) -> None:
        self.coordinator.state = CoordinatorState.FAILED
        self.coordinator.last_error = reason
        self.record("coordinator-failed", f"{reason}; waiting for the nodes to change")

    async def _await_capacity(self) -> None:
        """Until a node becomes ready (or `up` asks for a retry): the plan may fit again."""
        self._capacity.clear()
        await self._capacity.wait()

    async def _read_coordinator(self, process: asyncio.subprocess.Process,
                                messages: asyncio.Queue[dict[str, Any]]) -> None:
        """Pass one coordinator's lines to its own queue (a later coordinator has another), then its exit."""
        if process.stdout is not None:
            async for raw in process.stdout:
                try:
                    messages.put_nowait(json.loads(raw))
                except json.JSONDecodeError:
                    log.warning("coordinator wrote a non-JSON line: %r", raw[:200])
        code = await process.wait()
        messages.put_nowait({"event": "exit", "code": code})
        if process is self._process:
            self._process = None
            self._coordinator_ready.clear()
            self.coordinator.pid = None
            self.notify()

    def restart_coordinator(self, reason: str) -> None:
        """Ask the coordinator's owner for a fresh coordinator (a new plan); a running one is killed first."""
        self.record("coordinator-restart", reason)
        self._coordinator_ready.clear()
        self._restart.set()

    async def reprofile(self) -> None:
        """Measure the nodes again, re-plan and restart the coordinator, between requests."""
        async with self._request_lock:
            self.placement.remeasure = True
            loads = self._loads
            self.restart_coordinator("measuring the nodes again and re-planning")
            while self._loads == loads and self.coordinator.state != CoordinatorState.FAILED:
                await self.wait_change(0.5)

    def _replan_after_loss(self, name: str) -> None:
        """The coordinator's connection to ``name`` is gone: restart it (on the survivors if ``name`` failed)."""
        if self.placement.uses(name) and self._process is not None:
            self.restart_coordinator(f"its connection to {name} is gone; restarting it")

    def _coordinator_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def _kill_coordinator(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.kill()
        await process.wait()

    # --- requests ----------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Run one request to completion, resuming it across coordinator restarts."""
        self.requests_waiting += 1
        self.notify()
        try:
            await self._generate(request, send)
        finally:
            self.requests_waiting -= 1
            self.notify()

    async def _generate(self, request: GenerateRequest, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        async with self._request_lock:
            progress = self._current = _Progress()
            try:
                await self._resume_until_done(request, progress, send)
            finally:
                self._current = None

    async def _resume_until_done(self, request: GenerateRequest, progress: _Progress,
                                 send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        while True:
            await self._await_coordinator(progress.recoveries, send)
            rid = next(self._attempt_ids)
            process, messages = self._process, self._messages
            if process is None or process.stdin is None:
                continue
            cause = await self._attempt(request, progress, rid, process=process, messages=messages, send=send)
            if cause is None:
                return
            self.recoveries += 1
            progress.recoveries.append({"at_token": len(progress.generated), "time": time.time(),
                                        "cause": cause})
            if len(progress.recoveries) > MAX_RECOVERIES:
                raise RequestError(f"gave up after {MAX_RECOVERIES} recoveries; last: {cause}")
            await send({"event": "notice", "message": f"recovering: {cause}; resuming"})

    async def _attempt(self, request: GenerateRequest, progress: _Progress, rid: int, *,
                       process: asyncio.subprocess.Process, messages: asyncio.Queue[dict[str, Any]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> str | None:
        """Run the request on this coordinator: None once it is done, else why the coordinator was lost."""
        message: dict[str, Any] = {"op": "generate", "id": rid, **request.to_dict(), "replay": progress.generated}
        if progress.prompt_tokens is not None:
            # The prompt as first tokenised (a chat as first rendered with the model's template): a resumed
            # request must continue exactly the tokens it started from.
            message.pop("prompt", None)
            message.pop("messages", None)
            message["prompt_tokens"] = progress.prompt_tokens
        self.coordinator.state = CoordinatorState.GENERATING
        self.notify()
        if process.stdin is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):  # it died: its "exit" is on the way
                process.stdin.write((json.dumps(message) + "\n").encode())
                await process.stdin.drain()
        while True:
            try:
                async with asyncio.timeout(self.inventory.watchdog):  # no task per token, unlike wait_for
                    answer = await messages.get()
            except TimeoutError:
                waiting = f"after {len(progress.generated)} tokens"
                cause = await self.watchdog.hung(waiting, lambda: not messages.empty())
                if cause is None:
                    continue
                await _drain(messages, lambda answer: answer.get("event") == "exit", 10)
                return cause
            kind = answer.get("event")
            if kind == "exit":
                return f"coordinator exited with {answer.get('code')} after {len(progress.generated)} tokens"
            if answer.get("id") != rid:
                continue
            if kind == "prompt":
                progress.prompt_tokens = list(answer["tokens"])
            elif kind == "progress":
                self.coordinator.progress = f"{answer.get('phase')} {answer.get('done')}/{answer.get('total')} tokens"
                self.notify()
            elif kind == "token":
                if self.coordinator.progress:
                    self.coordinator.progress = ""
                self._note_token(progress, answer)
                try:
                    await send({"event": "token", "text": answer["text"]})
                except ConnectionError:
                    await self._cancel(process, messages, rid)
                    raise
            elif kind == "error":
                self._set_ready()
                raise PromptError(str(answer.get("message")))
            elif kind == "done":
                self._set_ready()
                self.requests_served += 1
                self.rates = {"prompt": _rate(answer.get("prompt_tokens"), answer.get("prompt_s")),
                              "decode": _rate(answer.get("completion_tokens"), answer.get("decode_s"))}
                await self._finish(progress, answer, send)
                return None

    def _note_token(self, progress: _Progress, answer: dict[str, Any]) -> None:
        progress.generated.append(int(answer["token"]))
        progress.texts.append(answer["text"])
        if progress.first_token_s is None:
            progress.first_token_s = time.perf_counter() - progress.started
        last = progress.recoveries[-1] if progress.recoveries else None
        if last is not None and "first_token_after_s" not in last:
            last["first_token_after_s"] = time.time() - last["time"]
            self.record("recovered", f"request resumed at token {last['at_token']}, "
                        f"{last['first_token_after_s']:.2f}s after the fault was seen")

    @staticmethod
    async def _finish(progress: _Progress, answer: dict[str, Any],
                      send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if answer.get("text"):
            progress.texts.append(answer["text"])
            await send({"event": "token", "text": answer["text"]})
        await send({
            "event": "done", "text": "".join(progress.texts), "reason": answer.get("reason"),
            "prompt_tokens": len(progress.prompt_tokens or []), "completion_tokens": len(progress.generated),
            "timings": {"total_s": time.perf_counter() - progress.started, "first_token_s": progress.first_token_s,
                        "prompt_s": answer.get("prompt_s"), "decode_s": answer.get("decode_s"),
                        "decode_tokens_per_s": _rate(answer.get("completion_tokens"), answer.get("decode_s"))},
            "recoveries": progress.recoveries})

    async def _cancel(self, process: asyncio.subprocess.Process, messages: asyncio.Queue[dict[str, Any]],
                      rid: int) -> None:
        """The client went away: stop its request and wait until the coordinator is free again."""
        self.record("cancelled", f"client disconnected; cancelling request {rid}")
        if process.stdin is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                process.stdin.write((json.dumps({"op": "cancel", "id": rid}) + "\n").encode())
                await process.stdin.drain()
        await _drain(messages, lambda answer: answer.get("event") == "exit" or (
            answer.get("id") == rid and answer.get("event") in ("done", "error")), self.inventory.watchdog)
        self._set_ready()

    def _set_ready(self) -> None:
        self.coordinator.progress = ""
        if self._process is not None:
            self.coordinator.state = CoordinatorState.READY
            self.notify()

    async def _await_coordinator(self, recoveries: list[dict[str, Any]],
                                 send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Until the coordinator is ready; meanwhile the client hears what the recovery runs into."""
        window = self.recovery_window()
        deadline = time.monotonic() + window
        seen = self.log.count
        while not self._coordinator_ready.is_set():
            if self.coordinator.state == CoordinatorState.FAILED:
                failed = "; ".join(f"{r.node.name} failed: {r.status.last_error}" for r in self.nodes.values()
                                   if r.status.left_out)
                raise RequestError(f"the cluster cannot serve ({failed or 'no node failed'}): "
                                   f"{self.coordinator.last_error}")
            if time.monotonic() > deadline:
                raise RequestError(f"the cluster did not recover within {window:.0f}s "
                                   f"({self.coordinator.last_error or 'coordinator not ready'})")
            await self.wait_change(0.5)
            news, seen = self.log.since(seen), self.log.count
            for event in news:
                if event.kind in RECOVERY_NOTICES:
                    await send({"event": "notice", "message": f"{event.node}: {event.message}" if event.node
                                else event.message})
        if recoveries and "resumed_after_s" not in recoveries[-1]:
            recoveries[-1]["resumed_after_s"] = time.time() - recoveries[-1]["time"]

    # --- shutdown ----------------------------------------------------------------------------------

    async def shutdown(self, stop_workers: bool = True) -> list[str]:
        """Stop the coordinator and (normally) every worker; then let the process exit. Returns what could not
        be stopped: ``node: why`` for each node that could not be reached, with the worker it left running."""
        if self._stopping:
            await self.finished.wait()
            return self._left_running
        self._stopping = True
        self.record("down", "stopping the cluster")
        await self.fleet.stop_lives()
        process = self._process
        if process is not None and process.returncode is None:
            if process.stdin is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    process.stdin.write(b'{"op": "shutdown"}\n')
                    process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                process.kill()
                await process.wait()
        if stop_workers:
            self._left_running = await self.fleet.stop_workers()
            for line in self._left_running:
                self.record("down-incomplete", line)
        await self.fleet.close()
        self.finished.set()
        return self._left_running

    async def retry(self) -> None:
        """`up` on a cluster that cannot serve all its nodes: try every failed or unreachable node now, and
        re-plan; returns once each has had its try and the coordinator has settled (or the window ran out)."""
        outcomes = {runtime.name: runtime.outcomes for runtime in self.nodes.values()}
        waiting = self.fleet.retry()
        self._capacity.set()
        deadline = time.monotonic() + self.recovery_window()
        while time.monotonic() < deadline:
            tried = all(runtime.outcomes > outcomes[runtime.node.name] for runtime in waiting)
            if tried and self.coordinator.state in (CoordinatorState.READY, CoordinatorState.GENERATING,
                                                    CoordinatorState.FAILED):
                return
            await self.wait_change(0.5)


async def _drain(messages: asyncio.Queue[dict[str, Any]], until: Callable[[dict[str, Any]], bool],
                 timeout: float) -> None:
    """Skip a coordinator's messages up to the first for which ``until`` holds (or a silence of ``timeout``)."""
    with contextlib.suppress(TimeoutError):
        while not until(await asyncio.wait_for(messages.get(), timeout)):
            pass


def _rate(count: object, seconds: object) -> float | None:
    if isinstance(count, int) and isinstance(seconds, float) and seconds > 0:
        return count / seconds
    return None


async def serve(state: StateDir) -> int:
    """Run the controller for the cluster whose launch files are in ``state``."""
    controller = Controller(*read_launch(state), state)
    server = await serve_control(controller, state.socket)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(controller.shutdown()))
    controller.record("controller", f"controller started (pid {os.getpid()})")
    _serve_metrics(controller, loop)
    await _serve_api(controller)
    controller.fleet.start()
    controller._spawn(controller._coordinator_loop())
    await controller.finished.wait()
    if controller.api is not None:
        await controller.api.close()
    if controller.metrics is not None:
        await asyncio.to_thread(controller.metrics.close)  # a scrape in progress needs this loop to finish
    server.close()
    state.socket.unlink(missing_ok=True)
    state.pid.unlink(missing_ok=True)
    return 0


async def _serve_api(controller: Controller) -> None:
    """Start the OpenAI-compatible API; a port in use is an event and a warning, not a reason to stop."""
    settings = controller.inventory.api
    try:
        controller.api = await serve_api(controller, settings.host, settings.port)
    except OSError as exc:
        controller.record("api-failed", f"no API endpoint: cannot listen on {settings.host}:{settings.port} "
                          f"({exc.strerror or exc}); fix: set api.port (0: any free port)")
        return
    controller.record("api", f"OpenAI-compatible API on http://{controller.api.address}/v1")


def _serve_metrics(controller: Controller, loop: asyncio.AbstractEventLoop) -> None:
    """Start the Prometheus endpoint; a port in use is an event and a warning, not a reason to stop."""
    settings = controller.inventory.metrics
    if not settings.enabled:
        return
    try:
        controller.metrics = serve_metrics(settings.host, settings.port, controller.snapshot, loop)
    except OSError as exc:
        controller.record("metrics-failed", f"no metrics endpoint: cannot listen on {settings.host}:{settings.port} "
                          f"({exc.strerror or exc}); fix: set metrics.port (0: any free port) or "
                          "metrics.enabled: false")
        return
    controller.record("metrics", f"Prometheus metrics on http://{controller.metrics.address}/metrics")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached controller process."""
    parser = argparse.ArgumentParser(description="ggml-cluster controller (started by `ggml-cluster up`)")
    parser.add_argument("state_dir")
    args = parser.parse_args(argv)
    state = StateDir(Path(args.state_dir))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("asyncssh").setLevel(logging.WARNING)  # one line per channel otherwise
    state.write_pid()
    # The relays' thread (RPC to the workers) shares the GIL with this loop, which handles each token as the
    # coordinator starts the next one: a waiting thread gets the GIL after this interval at the latest (5 ms by
    # default). 0.2 ms: ssh decode +2-3% (paired rounds, two runs of 6 and 8).
    sys.setswitchinterval(GIL_SWITCH_S)
    return asyncio.run(serve(state))
