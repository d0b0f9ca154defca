"""The coordinator's one owner: a single loop starts it (plan, spawn, watched load), restarts it when it exits or
when a fresh plan is asked for, and waits, failed, when the model cannot be placed until the nodes change.
Everything else asks (`restart`) and waits (`ready`); nobody else starts or restarts a coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from core.controller.compute import ComputeFaults
from core.controller.events import EventLog, Tasks
from core.controller.fleet import Fleet
from core.controller.health import READY_TIMEOUT_S
from core.controller.placement import Placement
from core.controller.watchdog import Watchdog
from core.engine import child
from core.engine.coordinator import CoordinatorConfig
from core.engine.protocol import (
    Answer,
    ComputeFailed,
    ComputeRetried,
    Exited,
    Failed,
    Ready,
    Shutdown,
    decode_answer,
    encode,
)
from core.errors import ClusterError, PlanError, WorkerError
from core.inventory import Inventory
from core.inventory_fields import DRAFT_P_MIN
from core.model import ModelFacts
from core.nodes import worker
from core.state import StateDir
from core.status import CoordinatorState, CoordinatorStatus

log = logging.getLogger("ggml-cluster.controller")

COORDINATOR = "core.engine.coordinator"
RECOVERY_TIMEOUT_S = 120.0  # a request waits at least this long for the cluster to come back
LOAD_MIN_S = 60.0           # a model load may always take this long
LOAD_SLACK = 4.0            # ... and this many times what the measured load rate predicts
ASSUMED_LOAD_RATE = 10e6    # bytes/s before a load was measured: a slow link (a stall is the watchdog's)
MAX_START_FAILURES = 5      # starts that fail within the recovery window before the coordinator counts as failed
SHUTDOWN_S = 5.0            # a coordinator asked to exit gets this long before it is killed


class CoordinatorLost(ClusterError):
    """The coordinator exited, or hung and was killed, before it was ready."""


def exit_cause(code: int, reason: str = "") -> str:
    """Why a coordinator process ended, from its exit status (``reason``: what it said before, if anything)."""
    if reason:
        return f"exit {code} ({reason})"
    if code in (-6, 134):
        return f"exit {code} (aborted: a worker connection was lost)"
    return f"exit {code} ({worker.classify_exit(code if code >= 0 else 128 - code, '')})"


class CoordinatorSupervisor:
    """The coordinator process, its status, its messages (a queue per process) and the loop that owns it."""

    def __init__(self, inventory: Inventory, model: ModelFacts, state: StateDir, *, log: EventLog, tasks: Tasks,
                 fleet: Fleet, placement: Placement, watchdog: Watchdog, module: str = COORDINATOR) -> None:
        """``watchdog``: what decides that a silent load is hung (it reaches back here to kill the coordinator);
        ``module``: what runs as the coordinator (`python -m module CONFIG`; a test's stand-in speaks the same
        protocol)."""
        self.inventory = inventory
        self.model = model
        self.state = state
        self.log = log
        self.tasks = tasks
        self.fleet = fleet
        self.placement = placement
        self.module = module
        self.status = CoordinatorStatus(endpoint=f"unix:{state.socket}")
        self.watchdog = watchdog
        watchdog.watch(self.pid, self.kill)
        self.compute = ComputeFaults(fleet, log)  # failed computes it reports, and retries in place
        self.process: asyncio.subprocess.Process | None = None
        self.messages: asyncio.Queue[Answer] = asyncio.Queue()
        self.ready = asyncio.Event()      # set while a loaded coordinator runs
        self.capacity = asyncio.Event()   # set: a node became ready (or a retry was asked): a plan may fit now
        self.loads = 0                    # coordinators that finished loading
        self.stopping = False
        self._restart = asyncio.Event()   # set: start a fresh one (a new plan)
        self._load_rate: float | None = None  # bytes/s of the slowest model load so far (a cold one, usually)
        self.load_s: float | None = None  # the latest model load's seconds: what a reload costs now

    # --- asked from outside ------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The running coordinator's pid."""
        return self.process.pid if self.process is not None else None

    def restart(self, reason: str) -> None:
        """Ask for a fresh coordinator (a new plan); a running one is killed first."""
        self.log.record("coordinator-restart", reason)
        self.ready.clear()
        self._restart.set()

    def lost(self, name: str) -> None:
        """The coordinator's connection to node ``name`` is gone: restart it (on the survivors if it failed)."""
        if self.placement.uses(name) and self.process is not None:
            self.restart(f"its connection to {name} is gone; restarting it")

    async def reloaded(self, loads: int) -> None:
        """Until a coordinator after the ``loads``-th has loaded, or the coordinator failed."""
        while self.loads == loads and self.status.state != CoordinatorState.FAILED:
            await self.log.wait_change(0.5)

    def set_state(self, state: CoordinatorState) -> None:
        """What the running coordinator does (generating, or ready for the next request)."""
        self.status.progress = ""
        if self.process is not None:
            self.status.state = state
            self.log.notify()

    def load_deadline(self) -> float:
        """Seconds a model load may take: generous against the slowest load measured (or an assumed rate before
        the first), since a stall is caught sooner by the watchdog; a cold load over a slow link must not be cut
        short."""
        rate = self._load_rate or ASSUMED_LOAD_RATE
        return max(LOAD_MIN_S, LOAD_SLACK * self.model.path.stat().st_size / rate)

    def recovery_window(self) -> float:
        """How long a request waits for the cluster to come back: never less than a model load."""
        return max(RECOVERY_TIMEOUT_S, self.load_deadline() + READY_TIMEOUT_S)

    async def kill(self) -> None:
        """Kill the running coordinator (its owner starts another)."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.kill()
        await process.wait()

    async def stop(self) -> None:
        """Ask the coordinator to exit; kill it if it does not within a few seconds."""
        self.stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                process.stdin.write(encode(Shutdown()))
                process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), SHUTDOWN_S)
        except TimeoutError:
            process.kill()
            await process.wait()

    # --- the loop -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, restart, re-plan and wait, for as long as the controller runs."""
        failures: list[float] = []
        while not self.stopping:
            self._restart.clear()
            try:
                await self._start()
            except PlanError as exc:
                self._failed(f"cannot place the model: {exc}")
                await self._await_capacity()
                continue
            except CoordinatorLost as exc:
                if self.stopping:
                    return
                self._exited(str(exc), loading=True)
                continue
            except ClusterError as exc:
                now = time.monotonic()
                failures = [when for when in failures if now - when < self.recovery_window()] + [now]
                if len(failures) >= MAX_START_FAILURES:
                    self._failed(f"{exc} ({len(failures)} tries)")
                    failures = []
                    await self._await_capacity()
                else:
                    self.status.last_error = str(exc)
                    self.log.record("coordinator-failed", f"{exc}; trying again in {len(failures)}s")
                    await asyncio.sleep(len(failures))
                continue
            failures = []
            await self._until_exit_or_restart()

    async def _until_exit_or_restart(self) -> None:
        process = self.process
        exited = asyncio.ensure_future(process.wait()) if process is not None else None
        wanted = asyncio.ensure_future(self._restart.wait())
        await asyncio.wait([task for task in (exited, wanted) if task is not None], return_when=asyncio.FIRST_COMPLETED)
        wanted.cancel()
        asked = self._restart.is_set()
        await self.kill()
        while self.process is not None:  # until its reader has seen it go
            await self.log.wait_change(0.1)
        if not asked and not self.stopping and process is not None:
            code = process.returncode if process.returncode is not None else -1
            self._exited(exit_cause(code, self.compute.cause(code)))

    async def _start(self) -> None:
        """Wait for the workers, plan, start the coordinator and wait until it has loaded the model.

        Raises PlanError when the model cannot be placed, CoordinatorLost when the process exits or hangs
        during the load (what is stuck is killed), ClusterError when it reports that it cannot load.
        """
        self.status.state = CoordinatorState.LOADING
        self.log.notify()
        usable = await self.fleet.verified()
        plan = await self.placement.place(usable, self.fleet.nodes)
        endpoints = []
        # A node without layers stays out: it would only add a connection the coordinator dies with.
        for name in plan.used:
            endpoint = self.fleet.nodes[name].relayed
            if endpoint is None:
                raise WorkerError(f"node {name} has no endpoint")
            endpoints.append(f"{endpoint[0]}:{endpoint[1]}")
        self.compute.connect(dict(zip(endpoints, plan.used, strict=True)))  # its reports name the endpoint
        template_file = self.inventory.chat_template_file
        draft = self.inventory.draft
        config = CoordinatorConfig(model=str(self.model.path), endpoints=tuple(endpoints),
                                   tensor_split=plan.used_split, context=self.inventory.context,
                                   chat_format=self.inventory.chat_format,
                                   chat_template_file=str(template_file) if template_file else None,
                                   parallel=plan.slots, sampling=self.inventory.sampling,
                                   speculative="draft_model" if draft else str(self.inventory.speculative),
                                   draft_model=str(self.inventory.draft_model_path) if draft else None,
                                   draft_threads=draft.threads if draft else 1,
                                   draft_p_min=draft.p_min if draft else DRAFT_P_MIN)
        self.log.record("plan", self.placement.describe())
        started = time.monotonic()
        with self.state.coordinator_log.open("ab") as log_file:
            log_start = log_file.tell()
            process = self.process = await child.start(self.module, config.to_json(), log_file, stdin=True)
        self.status.pid = process.pid
        messages = self.messages = asyncio.Queue()
        self.tasks.spawn(self._read(process, messages))
        message = await self._await_load(messages, started)
        if isinstance(message, Exited):
            raise CoordinatorLost(message.cause or exit_cause(message.code))
        if not isinstance(message, Ready):
            await self.kill()
            reason = message.message if isinstance(message, Failed) else message
            raise ClusterError(f"the coordinator could not load the model: {reason}",
                               f"see {self.state.coordinator_log}")
        load_s = self.load_s = time.monotonic() - started
        rate = self.model.path.stat().st_size / max(load_s, 1e-3)
        self._load_rate = rate if self._load_rate is None else min(self._load_rate, rate)
        self.placement.check(_read_from(self.state.coordinator_log, log_start))
        self.status.state = CoordinatorState.READY
        self.status.last_error = ""
        self.loads += 1
        self.ready.set()
        self.log.record("coordinator-ready", f"model loaded across {len(plan.used)} worker(s) in {load_s:.1f}s")

    async def _await_load(self, messages: asyncio.Queue[Answer], started: float) -> Answer:
        """The coordinator's first message (ready or error), or its exit; a stalled or overlong load is killed
        and reported as an exit with why."""
        deadline = started + self.load_deadline()
        while True:
            try:
                async with asyncio.timeout(max(0.0, min(self.watchdog.bound_s, deadline - time.monotonic()))):
                    return await messages.get()
            except TimeoutError:
                if time.monotonic() >= deadline:
                    cause = f"the model did not load within {self.load_deadline():.0f}s"
                    self.log.record("watchdog", f"{cause}; killing the coordinator and recovering")
                    await self.kill()
                else:
                    found = await self.watchdog.hung("while loading the model", lambda: not messages.empty())
                    if found is None:
                        continue
                    cause = found
                await drain(messages, lambda answer: isinstance(answer, Exited), 10)
                return Exited(-9, cause)

    def _exited(self, cause: str, loading: bool = False) -> None:
        self.status.restarts += 1
        self.status.last_error = cause
        self.status.state = CoordinatorState.LOADING
        self.log.record("coordinator-exit", f"coordinator {'lost while loading the model' if loading else 'exited'}: "
                        f"{cause}; restarting it")

    def _failed(self, reason: str) -> None:
        self.status.state = CoordinatorState.FAILED
        self.status.last_error = reason
        self.log.record("coordinator-failed", f"{reason}; waiting for the nodes to change")

    async def _await_capacity(self) -> None:
        """Until a node becomes ready (or `up` asks for a retry): the plan may fit again."""
        self.capacity.clear()
        await self.capacity.wait()

    async def _read(self, process: asyncio.subprocess.Process, messages: asyncio.Queue[Answer]) -> None:
        """Pass one coordinator's answers to its own queue (a later coordinator has another), then its exit."""
        if process.stdout is not None:
            async for raw in process.stdout:
                try:
                    answer = decode_answer(raw)
                except ValueError:
                    log.warning("coordinator wrote a line that is not the protocol: %r", raw[:200])
                    continue
                if isinstance(answer, ComputeFailed | ComputeRetried):
                    self.compute.seen(answer)  # whether a request runs or not; the request goes on regardless
                else:
                    messages.put_nowait(answer)
        code = await process.wait()
        messages.put_nowait(Exited(code, self.compute.cause(code)))
        if self.compute.gave_up is not None:
            self.tasks.spawn(self.compute.restart_worker())
        if process is self.process:
            self.process = None
            self.ready.clear()
            self.status.pid = None
            self.log.notify()


async def drain(messages: asyncio.Queue[Answer], until: Callable[[Answer], bool], timeout: float) -> None:
    """Skip a coordinator's messages up to the first for which ``until`` holds (or a silence of ``timeout``)."""
    with contextlib.suppress(TimeoutError):
        while not until(await asyncio.wait_for(messages.get(), timeout)):
            pass


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as log_file:
        log_file.seek(offset)
        return log_file.read().decode(errors="replace")
