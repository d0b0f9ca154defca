"""The command line's side of a running controller: where a cluster's state lives, its status, and runs.

Light on purpose: `status` and `run`, the commands people type most, load only this and the plain data
(bringing a cluster up and down is core.lifecycle, which loads SSH, GGUF and the planner).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from core.endpoints.control import ask, exchange
from core.inventory import Inventory
from core.state import StateDir, state_path
from core.status import ClusterStatus


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
