"""What happened, and who waits for it: the event log (memory, events.jsonl, change notification) and the
daemon's background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable
from pathlib import Path

from core.status import Event

log = logging.getLogger("ggml-cluster.controller")

EVENT_MEMORY = 50  # events kept for `status`; events.jsonl keeps them all


class EventLog:
    """Every event, appended to events.jsonl and the controller's log, the latest kept for `status`; and one
    notification for every change, events or not, that watchers (`status --watch`, waiting requests) wait on."""

    def __init__(self, path: Path, memory: int = EVENT_MEMORY) -> None:
        self.path = path
        self.recent: deque[Event] = deque(maxlen=memory)
        self.count = 0  # events recorded so far
        self._changed = asyncio.Event()  # set and replaced on every change

    def record(self, kind: str, message: str, node: str | None = None) -> None:
        """Log an event, keep it for `status`, and wake watchers."""
        event = Event(time=time.time(), kind=kind, message=message, node=node)
        self.recent.append(event)
        self.count += 1
        with contextlib.suppress(OSError), self.path.open("a") as handle:
            handle.write(json.dumps(event.to_dict()) + "\n")
        log.info("%s%s: %s", f"[{node}] " if node else "", kind, message)
        self.notify()

    def since(self, count: int) -> list[Event]:
        """The events recorded after the first ``count`` (those still kept)."""
        new = self.count - count
        return list(self.recent)[-new:] if new > 0 else []

    def notify(self) -> None:
        """Wake every watcher: something changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Return on the next change or after ``timeout``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


class Tasks:
    """The daemon's background tasks, referenced until they end (the event loop keeps only weak ones)."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future[None]] = set()

    def spawn(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``work`` in the background."""
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task
