"""The observing relay: the coordinator reaches each worker through it, and it watches the RPC stream go by.

It forwards bytes unchanged in both directions (small requests that the worker does not answer wait for the
next request, see WHOLE_FRAME) and reads only the frame headers of the coordinator's requests
(``cmd:u8, size:u64``, then ``size`` payload bytes it skips without looking at). That gives per node:
graph computes (and recomputes of a cached graph), bytes each way, and the time from a GRAPH_COMPUTE to the
first answer after it (the next request that waits on the graph), which is the node's share of a token,
seen from the coordinator, at no extra round trip; and, for the coordinator's latest connection, its commands
in order (`SessionStats`). A malformed or oversized frame closes that connection
(the coordinator restarts as it would if the worker had gone) and is reported; it never raises.

asyncio protocols rather than streams: a chunk is handed from one transport to the other as the same bytes
object, with no task switch per chunk, and back-pressure pauses the side that reads. The worker side is a
TCP connection, or whatever ``connect`` opens (an SSH channel, so RPC to an SSH node takes one hop in
Python instead of a relay plus a port forward).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from core.errors import ConnectError
from core.listener import bound_socket
from core.rpc.wire import (
    CMD_COMPUTE_STATUS,
    CMD_COUNT,
    CMD_GRAPH_COMPUTE,
    CMD_GRAPH_RECOMPUTE,
    CMD_SET_TENSOR,
    COMMAND_NAMES,
    HEADER,
)
from core.status import SessionStatus

MAX_FRAME = 64 << 30   # no single tensor upload is larger; a size beyond it is a corrupt stream
# The worker gets requests up to this size whole, and small SET_TENSORs together with the request after them.
# llama.cpp's client sends a request as three send() calls (command, size, payload) and, per token and node,
# ~5 small SET_TENSORs (inputs, the previous node's activations) before the graph compute; none of them is
# answered, and the worker can do nothing useful with them before the compute arrives. Passing each piece on
# as it comes costs a write each and, to an SSH node, a sealed packet each (~22 per token on two nodes; now
# ~3). Larger requests (tensor uploads while loading) stream as they come.
WHOLE_FRAME = 64 << 10
SMOOTHING = 0.2        # weight of the newest compute time in the moving average
RECENT_COMPUTES = 256  # compute times kept one by one

T = TypeVar("T")


@dataclass
class SessionStats:
    """One coordinator connection's data path, command by command: what proves that two runs sent the worker the
    same requests in the same order (the digest) and got the same number of bytes back.

    ``commands`` and the digest leave out COMPUTE_STATUS, the one-way opt-in that only a patched client sends
    once after HELLO, so that a run with the compute status negotiated compares equal to one without; ``counts``
    has it. Kept on the relays' thread per chunk: a counter bump per command and one hash update per chunk.
    """

    commands: int = 0
    bytes_to: int = 0       # coordinator → worker
    bytes_from: int = 0     # worker → coordinator
    counts: list[int] = field(default_factory=lambda: [0] * 256)  # by command byte
    sequence: hashlib.blake2b = field(default_factory=lambda: hashlib.blake2b(digest_size=8))

    @property
    def digest(self) -> str:
        """The command bytes so far, in order, hashed (hex)."""
        return self.sequence.hexdigest()

    def status(self) -> SessionStatus:
        """As plain data, with the commands by name."""
        return SessionStatus(commands=self.commands, digest=self.digest,
                             counts={COMMAND_NAMES.get(command, str(command)): count
                                     for command, count in enumerate(self.counts) if count},
                             bytes_to=self.bytes_to, bytes_from=self.bytes_from)


@dataclass
class RelayStats:
    """What the relay has seen of one node's traffic since the controller started."""

    computes: int = 0
    recomputes: int = 0
    bytes_to: int = 0       # coordinator → worker
    bytes_from: int = 0     # worker → coordinator
    compute_ms: float | None = None  # moving average, GRAPH_COMPUTE → first answer after it
    # Their running sum and count: differences of two readings give the exact mean over that window
    # (a benchmark's decode), which the moving average only approximates.
    compute_ms_total: float = 0.0
    computes_timed: int = 0
    # The latest compute times, for medians over a window (the moving average follows a single slow one).
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_COMPUTES))
    connected: bool = False
    connections: int = 0
    session: SessionStats | None = None  # the latest coordinator connection (None before the first)


class Pipe(Protocol):
    """What a link needs of either side: an asyncio transport, or an SSH channel."""

    def write(self, data: bytes) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...


class FrameError(ValueError):
    """The byte stream is not ggml-rpc frames."""


class FrameReader:
    """Finds frame headers in the coordinator's byte stream, skipping payloads by count (pure).

    After each ``feed``, ``urgent_end`` and ``last_end`` say where in that chunk the last frame that must reach
    the worker now, and the last whole frame, end (-1: none did).
    """

    def __init__(self) -> None:
        self._header = bytearray()
        self._command = 0
        self._size = 0  # payload size of the current frame
        self._skip = 0  # payload bytes of the current frame still to come
        self.urgent_end = -1
        self.last_end = -1

    def feed(self, data: bytes) -> list[int]:
        """The commands whose headers complete in ``data``; raises FrameError on a bad header."""
        commands = []
        self.urgent_end = self.last_end = -1
        view, position, end = memoryview(data), 0, len(data)
        while position < end:
            if self._skip:
                step = min(self._skip, end - position)
                self._skip -= step
                position += step
                if not self._skip:
                    self._ended(position)
                continue
            take = min(HEADER.size - len(self._header), end - position)
            self._header += view[position:position + take]
            position += take
            if len(self._header) < HEADER.size:
                break
            command, size = HEADER.unpack(self._header)
            self._header.clear()
            if command >= CMD_COUNT and command != CMD_COMPUTE_STATUS:
                raise FrameError(f"unknown RPC command {command}")
            if size > MAX_FRAME:
                raise FrameError(f"RPC command {command} announces {size} bytes")
            self._command, self._size, self._skip = command, size, size
            commands.append(command)
            if not size:
                self._ended(position)
        return commands

    def _ended(self, position: int) -> None:
        self.last_end = position
        if self._command != CMD_SET_TENSOR or self._size > WHOLE_FRAME:
            self.urgent_end = position

    def streaming(self) -> bool:
        """Inside a frame too large to hold back."""
        return self._skip > 0 and self._size > WHOLE_FRAME


class Link:
    """One coordinator connection and its connection to the worker."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.frames = FrameReader()
        self.session = SessionStats()
        self.client: asyncio.Transport | None = None
        self.worker: Pipe | None = None
        self.compute_started: float | None = None
        self.pending: list[bytes] = []
        self.held = b""  # small requests not passed on yet (see WHOLE_FRAME)
        self.closed = False

    def from_client(self, data: bytes) -> None:
        """Bytes from the coordinator: counted, their frame headers read, then to the worker (see WHOLE_FRAME)."""
        stats, session = self.relay.stats, self.session
        stats.bytes_to += len(data)
        session.bytes_to += len(data)
        try:
            commands = self.frames.feed(data)
        except FrameError as exc:
            self.relay.report(f"closed the coordinator's connection: {exc}")
            self.close()
            return
        if commands:
            counts = session.counts
            for command in commands:
                counts[command] += 1
                if command == CMD_GRAPH_COMPUTE:
                    stats.computes += 1
                    self.compute_started = time.perf_counter()
                elif command == CMD_GRAPH_RECOMPUTE:
                    stats.recomputes += 1
                    self.compute_started = time.perf_counter()
            if CMD_COMPUTE_STATUS in commands:  # the opt-in stays out of the sequence (see SessionStats)
                commands = [command for command in commands if command != CMD_COMPUTE_STATUS]
            session.commands += len(commands)
            session.sequence.update(bytes(commands))
        held = len(self.held)
        if held:
            data = self.held + data
        frames = self.frames
        if frames.streaming():
            cut = len(data)
        else:
            cut = held + frames.urgent_end if frames.urgent_end >= 0 else 0
            if len(data) - cut > WHOLE_FRAME and frames.last_end >= 0:  # many small ones: enough waiting
                cut = max(cut, held + frames.last_end)
        data, self.held = data[:cut], data[cut:]
        if not data:
            return
        if self.worker is not None:
            self.worker.write(data)
        else:
            self.pending.append(data)  # reading is paused until the worker connects, but a loop may race

    def worker_connected(self, transport: Pipe) -> None:
        """The worker side is open: send what the coordinator has already written."""
        self.worker = transport
        for data in self.pending:
            transport.write(data)
        self.pending.clear()

    def from_worker(self, data: bytes) -> None:
        """Bytes from the worker, to the coordinator."""
        stats = self.relay.stats
        stats.bytes_from += len(data)
        self.session.bytes_from += len(data)
        if self.compute_started is not None:
            elapsed = (time.perf_counter() - self.compute_started) * 1000
            self.compute_started = None
            stats.compute_ms_total += elapsed
            stats.computes_timed += 1
            stats.recent.append(elapsed)
            stats.compute_ms = elapsed if stats.compute_ms is None else (
                SMOOTHING * elapsed + (1 - SMOOTHING) * stats.compute_ms)
        if self.client is not None:
            self.client.write(data)

    def pause_client(self, paused: bool) -> None:
        """Back-pressure from the worker side: stop (or resume) reading the coordinator."""
        if self.client is not None:
            if paused:
                self.client.pause_reading()
            else:
                self.client.resume_reading()

    def close(self) -> None:
        """Close both sides (once)."""
        if self.closed:
            return
        self.closed = True
        self.relay.stats.connected = False
        for transport in (self.client, self.worker):
            if transport is not None:
                transport.close()


class _Side(asyncio.Protocol):
    """One end of a link; ``client`` is the coordinator's side."""

    def __init__(self, link: Link, client: bool) -> None:
        self.link = link
        self.is_client = client

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # a stream transport (uvloop's is not a subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # ggml-rpc's own setting
        if self.is_client:
            self.link.client = transport
            transport.pause_reading()  # until the worker side is connected
            self.link.relay.spawn(self.link.relay.connect_worker(self.link))
        else:
            self.link.worker_connected(transport)

    def data_received(self, data: bytes) -> None:
        if self.is_client:
            self.link.from_client(data)
        else:
            self.link.from_worker(data)

    def eof_received(self) -> bool:
        self.link.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()

    def pause_writing(self) -> None:
        other = self.link.worker if self.is_client else self.link.client
        if other is not None:
            other.pause_reading()

    def resume_writing(self) -> None:
        other = self.link.worker if self.is_client else self.link.client
        if other is not None:
            other.resume_reading()


class Relay:
    """A loopback listener that forwards to one worker and keeps that node's ``RelayStats``."""

    def __init__(self, target: tuple[str, int], on_event: Callable[[str], None],
                 connect: Callable[[Link], Coroutine[Any, Any, None]] | None = None) -> None:
        """``connect`` opens a link's worker side and calls its ``worker_connected``; else TCP to ``target``."""
        self.target = target  # may change when the node's endpoint does
        self._connect = connect
        self.stats = RelayStats()
        self._on_event = on_event
        self._server: asyncio.Server | None = None
        self._links: set[Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a task that the relay keeps a reference to until it ends."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, reserved: Collection[int] = ()) -> tuple[str, int]:
        """Listen on an ephemeral 127.0.0.1 port, none of ``reserved`` (the workers'); returns the address the
        coordinator should use."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Side(self._new_link(), client=True),
                                                sock=bound_socket("127.0.0.1", reserved))
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    def _new_link(self) -> Link:
        link = Link(self)
        self._links = {known for known in self._links if not known.closed} | {link}
        self.stats.session = link.session
        return link

    async def connect_worker(self, link: Link) -> None:
        """Open the worker side of a new coordinator connection, then let the coordinator's bytes flow."""
        loop = asyncio.get_running_loop()
        try:
            if self._connect is not None:
                await self._connect(link)
            else:
                await loop.create_connection(lambda: _Side(link, client=False), *self.target)
        except (OSError, ConnectError) as exc:
            self.report(f"cannot reach the worker at {self.target[0]}:{self.target[1]}: {exc}")
            link.close()
            return
        self.stats.connected = True
        self.stats.connections += 1
        if link.client is not None and not link.closed:
            link.client.resume_reading()

    def report(self, message: str) -> None:
        """Tell the controller about a problem on this node's traffic."""
        self._on_event(message)

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        for link in list(self._links):
            link.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


class RelayHost:
    """The relays' own event loop (uvloop) on a thread of the controller: the data plane.

    uvloop moves a chunk in a fraction of asyncio's time, the relays are on the per-token path, and here they
    do not wait behind the controller's own work (a token to stream, a status, a sample). An SSH node's RPC
    rides a connection of its own that lives on this loop too. The controller's loop stays the standard
    one (it runs subprocesses and the nodes' control connections, where it behaves as tested). Counters are
    plain ints, read by the controller's thread as they are.
    """

    def __init__(self, reserved: Collection[int] = ()) -> None:
        """``reserved``: ports no relay may listen on (the workers')."""
        import uvloop

        self.reserved = frozenset(reserved)

        self.loop = uvloop.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="relays", daemon=True)
        self._thread.start()
        started.wait(10)

    async def relay(self, target: tuple[str, int], on_event: Callable[[str], None],
                    connect: Callable[[Link], Coroutine[Any, Any, None]] | None = None,
                    ) -> tuple[Relay, tuple[str, int]]:
        """A started relay to ``target`` (``connect``: as for Relay, run on this loop); ``on_event`` is called
        on the caller's loop."""
        caller = asyncio.get_running_loop()

        def report(message: str) -> None:
            caller.call_soon_threadsafe(on_event, message)

        relay = Relay(target, report, connect)
        return relay, await self.run(relay.start(self.reserved))

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the relays' loop and wait for its result from the caller's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    async def close(self, relays: list[Relay]) -> None:
        """Close ``relays`` and stop the loop."""
        for relay in relays:
            await self.run(relay.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 10)
