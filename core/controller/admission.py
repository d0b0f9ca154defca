"""Who may generate now: as many requests at once as the plan has slots (``api.parallel``) and a bounded queue in
front of them (Admission), and requests together but a re-plan alone (Turns)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from core.errors import Busy

RECENT_REQUESTS = 8  # the requests whose times estimate when a slot frees up


class Admission:
    """Who generates and who waits: ``slots`` requests at once, then up to ``queue`` more, first come, first
    served; one more is refused at once (Busy), with an estimate of when a place frees up."""

    def __init__(self, slots: int, queue: int, changed: Callable[[], None]) -> None:
        """``changed``: called whenever the counts change (it wakes status watchers)."""
        self.slots = slots
        self.queue = queue
        self.changed = changed
        self.busy = 0      # slots held, a slot handed to a waiter that has not resumed yet included
        self.deferred = 0  # requests that had to wait for a slot, since the controller started
        self.rejected = 0  # requests refused because the queue was full
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._started: list[float] = []  # when each request holding a slot got it (monotonic)
        self._held_s: deque[float] = deque(maxlen=RECENT_REQUESTS)  # how long recent requests held theirs

    def resize(self, slots: int) -> None:
        """The plan chose ``slots`` (no fewer than now): the new ones go to those waiting, first come, first
        served."""
        self.slots = slots
        while self._waiting and self.busy < self.slots:
            self.busy += 1  # held for the waiter from now, as _release hands one over
            self._waiting.popleft().set_result(None)
        self.changed()

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    def retry_after(self) -> int:
        """Seconds until a place is likely to free up: the recent mean time a request holds its slot, less what
        the longest-running request has had of it; at least 1."""
        if not self._held_s or not self._started:
            return 1
        mean = sum(self._held_s) / len(self._held_s)
        return max(1, math.ceil(mean - (time.monotonic() - min(self._started))))

    @contextlib.asynccontextmanager
    async def place(self) -> AsyncIterator[None]:
        """Hold a slot for the body: at once when one is free and nobody waits, else once those queued before
        have theirs; raises Busy when the queue is full."""
        if self.busy < self.slots and not self._waiting:
            self.busy += 1
        elif len(self._waiting) < self.queue:
            await self._wait()
        else:
            self.rejected += 1
            self.changed()
            raise Busy(f"the cluster is busy: {self.busy}/{self.slots} slots generating, {self.queued}/{self.queue} "
                       "queued (api.queue)", self.retry_after())
        started = time.monotonic()
        self._started.append(started)
        self.changed()
        finished = False
        try:
            yield
            finished = True
        finally:
            self._started.remove(started)
            if finished:  # a refused prompt or a client gone says nothing about how long requests take
                self._held_s.append(time.monotonic() - started)
            self._release()

    async def _wait(self) -> None:
        self.deferred += 1
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self.changed()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a slot just as it was cancelled: pass it on
                self._release()
            else:
                self._waiting.remove(turn)
                self.changed()
            raise

    def _release(self) -> None:
        """A slot is free: the first waiter gets it (so that no newcomer takes it first), else it is free."""
        if self._waiting:
            self._waiting.popleft().set_result(None)
        else:
            self.busy -= 1
        self.changed()


class Turns:
    """Requests run together (as many as Admission lets in), a re-plan alone.

    A readers-writer lock: a re-plan (``alone``) waits until no request runs, and requests that arrive while it
    waits queue behind it, so it is not starved by a steady stream of them.
    """

    def __init__(self) -> None:
        self.busy = 0
        self._alone = False
        self._waiting_alone = 0
        self._changed = asyncio.Condition()

    def locked(self) -> bool:
        """Whether a request (or a re-plan) runs."""
        return self.busy > 0 or self._alone

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Run one request (beside others)."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._alone and not self._waiting_alone)
            self.busy += 1
        try:
            yield
        finally:
            async with self._changed:
                self.busy -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """Run alone: no request runs meanwhile."""
        async with self._changed:
            self._waiting_alone += 1
            try:
                await self._changed.wait_for(lambda: self.busy == 0 and not self._alone)
            finally:
                self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            async with self._changed:
                self._alone = False
                self._changed.notify_all()
