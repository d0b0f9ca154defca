"""The controller's wiring: one detached process per cluster that owns the workers, the plan and the coordinator.

It builds the units and connects them by explicit hooks: the fleet (each node's life), the placement (profiles
and plan), the adaptation (the plan against the relays' live times), the coordinator's supervisor (its one owner,
with the watchdog), the request runner (resume, cancel); and serves them as the Service the endpoints (control
socket, OpenAI API, Prometheus) are written against. Shutdown stops them in order: nodes' lives, coordinator,
workers, relays and connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.controller.adapt import Adaptation, Traffic
from core.controller.events import EventLog, Tasks
from core.controller.fleet import Fleet, FleetHooks
from core.controller.health import Probe
from core.controller.placement import Placement
from core.controller.requests import RequestRunner
from core.controller.supervisor import COORDINATOR, CoordinatorSupervisor
from core.controller.watchdog import LIVENESS_WINDOW_S, Watchdog
from core.endpoints.api import ApiServer, serve_api
from core.endpoints.control import serve_control
from core.endpoints.prometheus import MetricsServer, serve_metrics
from core.engine.profile import ProfileCache
from core.inventory import Inventory, Node
from core.model import read_model
from core.nodes.build import cache_dir
from core.nodes.remote import remote_for
from core.nodes.shell import Remote
from core.plan_explained import plan_rows
from core.service import GenerateRequest, Send
from core.state import Launch, StateDir, read_launch
from core.status import ClusterStatus, CoordinatorState, CoordinatorStatus

GIL_SWITCH_S = 0.0002  # the GIL switch interval in the controller (see main)
DRIFT_CHECK_S = 1.0    # how often the live times are checked against the plan (a median of a few dozen numbers)


@dataclass(frozen=True)
class Seams:
    """The parts a test puts in place of the real ones (core.nodes.testing, tests/stub_coordinator.py)."""

    reach: Callable[[Node], Remote] = remote_for   # how a node is reached
    probe: Probe | None = None                     # how a worker is asked HELLO (None: over TCP)
    coordinator: str = COORDINATOR                 # the module that runs as the coordinator
    watchdog_s: float | None = None                # the watchdog's bound (None: the inventory's)
    liveness_s: float = LIVENESS_WINDOW_S          # how long the watchdog watches before it calls a hang


class Controller:
    """The cluster as the endpoints see it (the Service), built from its units."""

    def __init__(self, inventory: Inventory, launch: Launch, state: StateDir, seams: Seams | None = None) -> None:
        seams = seams or Seams()
        self.inventory = inventory
        self.state = state
        self.model = read_model(Path(launch.model), speculative=inventory.speculates)
        self.log = EventLog(state.events)
        self.tasks = Tasks()
        self.fleet = Fleet(inventory, state, self.log, self.tasks, FleetHooks(
            in_use=self._in_use, worker_lost=self._worker_lost, node_ready=self._node_ready), client=launch.protocol,
            probe=seams.probe, reach=seams.reach)
        self.nodes = self.fleet.nodes
        self.placement = Placement(inventory, self.model, model_path=Path(launch.model), protocol=launch.protocol,
                                   state=state, log=self.log, cache=ProfileCache(cache_dir() / "profiles"),
                                   slots_chosen=self._slots_chosen)
        bound = seams.watchdog_s if seams.watchdog_s is not None else inventory.watchdog
        watchdog = Watchdog(self.fleet, self.placement, self.log, bound, seams.liveness_s)
        self.supervisor = CoordinatorSupervisor(inventory, self.model, state, log=self.log, tasks=self.tasks,
                                                fleet=self.fleet, placement=self.placement, watchdog=watchdog,
                                                module=seams.coordinator)
        # api.parallel: auto admits one request at a time (the least any plan holds) until the first plan has
        # chosen the slots (_slots_chosen): never more than the coordinator will hold.
        self.requests = RequestRunner(self.supervisor, self.log, bound, self._failed_nodes, inventory.api.queue,
                                      parallel=self.placement.slots or 1)
        self.started_at = time.time()
        self.adaptation = Adaptation(self.fleet, self.placement, self.log, Traffic(
            tokens=lambda: self.requests.completion_tokens, started_at=self.started_at,
            reload_s=lambda: self.supervisor.load_s), replan=self._replan)
        self.metrics: MetricsServer | None = None
        self.api: ApiServer | None = None
        self.finished = asyncio.Event()
        self._stopping = False
        self._left_running: list[str] = []  # what `down` could not stop

    def start(self) -> None:
        """Begin every node's life and the coordinator's."""
        self.fleet.start()
        self.tasks.spawn(self.supervisor.run())
        self.tasks.spawn(self._check_drift())

    # --- the Service -------------------------------------------------------------------------------

    @property
    def context(self) -> int:
        """Tokens the context holds."""
        return self.inventory.context

    def fingerprint(self) -> str:
        """Identity of what this controller runs: its inventory and launch files, and the API key it read."""
        return self.state.fingerprint(self.inventory.api_key)

    def explain_plan(self) -> list[dict[str, Any]]:
        """Each node's part of the plan on the measured memory and speed and why, as `plan --json`'s rows."""
        _, rows = plan_rows(self.snapshot(), self.inventory, self.model, self.inventory.strategy)
        return [row.to_dict() for row in rows]

    def serving(self) -> bool:
        """Whether it runs on (False once it has shut down)."""
        return not self.finished.is_set()

    def record(self, kind: str, message: str, node: str | None = None) -> None:
        """Log an event, keep it for `status`, and wake watchers."""
        self.log.record(kind, message, node)

    async def wait_change(self, timeout: float) -> None:
        """Return on the next change or after ``timeout``."""
        await self.log.wait_change(timeout)

    def snapshot(self) -> ClusterStatus:
        """The current status of everything."""
        plan, profiles, runner = self.placement.plan, self.placement.profiles, self.requests
        admission = runner.admission
        nodes = self.fleet.statuses()
        self.adaptation.annotate(nodes)
        return ClusterStatus(
            cluster=self.inventory.cluster, model=self.model.name,
            coordinator=CoordinatorStatus(**vars(self.supervisor.status)),
            nodes=nodes, events=list(self.log.recent), n_layers=self.model.n_layers,
            tensor_split=list(plan.tensor_split) if plan else [],
            controller_pid=os.getpid(), started_at=self.started_at, requests_served=runner.served,
            requests_in_flight=runner.waiting, recoveries=runner.recoveries,
            prompt_tokens_per_s=runner.rates["prompt"], decode_tokens_per_s=runner.decode_rate(),
            aggregate_decode_tokens_per_s=runner.aggregate_decode_rate(),
            request_decode_tokens_per_s=runner.request_rates(), slots=admission.slots,
            slots_busy=admission.busy, queue_length=admission.queued, queue_limit=admission.queue,
            requests_deferred=admission.deferred, requests_rejected=admission.rejected,
            prompt_tokens_shared=runner.prompt_tokens_shared, completion_tokens=runner.completion_tokens,
            requests_sampled_on_coordinator=runner.sampled_on_coordinator,
            completion_tokens_batched=runner.completion_tokens_batched,
            tokens_drafted=runner.tokens_drafted, tokens_accepted=runner.tokens_accepted,
            metrics_endpoint=self.metrics.address if self.metrics else "",
            api_endpoint=self.api.address if self.api else "",
            strategy=plan.strategy if plan else "",
            predicted_ms=None if plan is None or plan.predicted_total_s is None else plan.predicted_total_s * 1000,
            overhead_ms=None if profiles is None else profiles.overhead_s * 1000)

    async def generate(self, request: GenerateRequest, send: Send) -> None:
        """Run one request to completion, resuming it across coordinator restarts."""
        await self.requests.generate(request, send)

    async def reprofile(self) -> None:
        """Measure the nodes again, re-plan and restart the coordinator, between requests."""
        async with self.requests.lock.alone():
            self.placement.remeasure = True
            loads = self.supervisor.loads
            self.supervisor.restart("measuring the nodes again and re-planning")
            await self.supervisor.reloaded(loads)

    async def retry(self) -> None:
        """`up` on a cluster that cannot serve all its nodes: try every failed or unreachable node now, and
        re-plan; returns once each has had its try and the coordinator has settled (or the window ran out)."""
        outcomes = {runtime.name: runtime.outcomes for runtime in self.nodes.values()}
        waiting = self.fleet.retry()
        self.supervisor.capacity.set()
        deadline = time.monotonic() + self.supervisor.recovery_window()
        settled = (CoordinatorState.READY, CoordinatorState.GENERATING, CoordinatorState.FAILED)
        while time.monotonic() < deadline:
            tried = all(runtime.outcomes > outcomes[runtime.name] for runtime in waiting)
            if tried and self.supervisor.status.state in settled:
                return
            await self.log.wait_change(0.5)

    async def shutdown(self, stop_workers: bool = True) -> list[str]:
        """Stop the coordinator and (normally) every worker; then let the process exit. Returns what could not
        be stopped: ``node: why`` for each node that could not be reached, with the worker it left running."""
        if self._stopping:
            await self.finished.wait()
            return self._left_running
        self._stopping = True
        self.log.record("down", "stopping the cluster")
        await self.fleet.stop_lives()
        await self.supervisor.stop()
        if stop_workers:
            self._left_running = await self.fleet.stop_workers()
            for line in self._left_running:
                self.log.record("down-incomplete", line)
        await self.fleet.close()
        self.finished.set()
        return self._left_running

    # --- what the nodes tell -----------------------------------------------------------------------

    def _in_use(self, name: str) -> bool:
        """The running coordinator holds this node's worker."""
        return self.supervisor.process is not None and self.placement.uses(name)

    def _worker_lost(self, name: str, failed: bool) -> None:
        """A worker exited (its supervisor restarts it) or its node failed: the coordinator's link to it is gone.
        Idle, the coordinator would only find out on the next request: restart it now."""
        if failed or not self.requests.lock.locked():
            self.supervisor.lost(name)

    def _node_ready(self, name: str) -> None:
        """A node became ready: a plan that did not fit may now; a node the plan left out may be used again."""
        self.supervisor.capacity.set()
        if self.placement.left_out(name) and self.supervisor.ready.is_set():
            self.tasks.spawn(self._replan_when_idle(name))

    async def _replan_when_idle(self, name: str) -> None:
        """A node the plan left out is back: re-plan to use it, between requests."""
        async with self.requests.lock.alone():
            if self.placement.left_out(name) and self.nodes[name].ready.is_set() and self.supervisor.ready.is_set():
                loads = self.supervisor.loads
                self.supervisor.restart(f"{name} is back; re-planning to use it")
                await self.supervisor.reloaded(loads)

    async def _check_drift(self) -> None:
        """Check the live times against the plan while the coordinator serves, until the controller stops."""
        while not self.finished.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.finished.wait(), DRIFT_CHECK_S)
            if self.supervisor.ready.is_set() and not self._stopping:
                self.adaptation.check()

    def _replan(self, reason: str) -> None:
        """Reload with a fresh plan between requests: requests that arrive meanwhile wait for it, as they wait for
        `profile`'s re-plan."""
        async def replan() -> None:
            async with self.requests.lock.alone():
                if self.supervisor.ready.is_set():
                    loads = self.supervisor.loads
                    self.supervisor.restart(reason)
                    await self.supervisor.reloaded(loads)

        self.tasks.spawn(replan())

    def _slots_chosen(self, slots: int) -> None:
        """The first plan chose the slots (api.parallel: auto): let that many requests generate at once."""
        self.requests.admission.resize(slots)

    def _failed_nodes(self) -> str:
        return "; ".join(f"{runtime.name} failed: {runtime.status.last_error}" for runtime in self.nodes.values()
                         if runtime.status.left_out)


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
    controller.start()
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
        controller.api = await serve_api(controller, settings.host, settings.port, controller.inventory.api_key,
                                         reserved=controller.inventory.worker_ports)
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
        controller.metrics = serve_metrics(settings.host, settings.port, controller.snapshot, loop,
                                           controller.inventory.api_key, reserved=controller.inventory.worker_ports)
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
