"""The command line's side of a running controller: where a cluster's state lives, its status, and runs.

Light on purpose: `status`, `run` and `down`, the commands people type most, load only this and the plain data
(bringing a cluster up, and stopping workers a dead controller left behind, is core.lifecycle, which loads SSH,
GGUF and the planner).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from core.endpoints.control import ask, exchange
from core.errors import ConnectError
from core.inventory import Inventory
from core.state import StateDir, process_alive, state_path
from core.status import ClusterStatus

DOWN_TIMEOUT_S = 30.0


def state_for(inventory: Inventory) -> StateDir:
    """The state dir of an inventory's cluster."""
    return StateDir(state_path(inventory.cluster))


async def status(state: StateDir) -> ClusterStatus:
    """One snapshot of a running cluster."""
    return ClusterStatus.from_dict(await ask(state, {"op": "status"}))


async def watch(state: StateDir, interval: float = 1.0) -> AsyncIterator[ClusterStatus]:
    """Snapshots as the cluster changes (at least every ``interval`` seconds)."""
    async for data in exchange(state, {"op": "watch", "interval": interval}):
        yield ClusterStatus.from_dict(data)


async def run(state: StateDir, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Stream a generation: ``token`` and ``notice`` events, then ``done``; a failure raises ClusterError."""
    async for answer in exchange(state, {"op": "run", **request}):
        yield answer
        if answer.get("event") == "done":
            return


@dataclass(frozen=True)
class DownResult:
    """What `down` did beyond asking the controller."""

    cleaned: list[str]      # nodes whose workers outlived their controller and were stopped
    unreachable: list[str]  # ``name: reason`` for nodes that could not be checked
    left_running: list[str] = field(default_factory=list)  # ``name: why`` for workers the controller could not stop


async def stop_controller(state: StateDir, keep_workers: bool = False) -> DownResult | None:
    """Ask the controller to stop its coordinator and workers (or keep the workers) and end; signal it when it does
    not answer. None when the workers are not settled (no controller stopped them, and they were not to stay):
    core.lifecycle's stop_leftover_workers finds them."""
    pid = state.controller_pid()  # None also when the pid file is stale: then nothing of it is signalled
    stopped_by_controller = False
    left: list[str] = []
    if pid is not None:
        try:
            answer = await ask(state, {"op": "down", "keep_workers": keep_workers})
            stopped_by_controller = answer.get("ok") is True
            left = [str(line) for line in answer.get("left_running") or []]
        except (ConnectError, ConnectionError, json.JSONDecodeError):
            # No socket yet: it started a moment ago (`up` was interrupted then). It handles SIGTERM like `down`
            # from when it opens its socket, before it starts anything; until then SIGTERM simply ends it.
            state.signal_controller(signal.SIGTERM)
        if not await wait_gone(pid, DOWN_TIMEOUT_S):
            state.signal_controller(signal.SIGKILL)
    state.socket.unlink(missing_ok=True)
    state.pid.unlink(missing_ok=True)
    return DownResult([], [], left) if stopped_by_controller or keep_workers else None


async def wait_gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False
