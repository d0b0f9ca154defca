"""The observing relay: frame headers parsed across any chunking, bad streams closed, real worker traffic counted."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import struct
import subprocess
import time
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.nodes.build import worker_binary
from core.rpc.relay import MAX_FRAME, FrameError, FrameReader, Link, Relay
from core.rpc.wire import CMD_COMPUTE_STATUS as COMPUTE_STATUS
from core.rpc.wire import CMD_COUNT as COMMANDS
from core.rpc.wire import CMD_GRAPH_COMPUTE as GRAPH_COMPUTE
from core.rpc.wire import CMD_GRAPH_RECOMPUTE as GRAPH_RECOMPUTE
from core.rpc.wire import CMD_HELLO as HELLO
from core.rpc.wire import CMD_SET_TENSOR as SET_TENSOR
from core.rpc.wire import HEADER, probe_worker
from core.status import SessionStatus
from tests.harness import free_port, listening


def frame(command: int, payload: bytes) -> bytes:
    return struct.pack("<BQ", command, len(payload)) + payload


def test_frames_are_found_however_the_stream_is_cut() -> None:
    stream = frame(6, b"x" * 1000) + frame(GRAPH_COMPUTE, b"g" * 37) + frame(GRAPH_RECOMPUTE, b"r" * 8) + frame(8, b"")
    for size in (1, 2, 5, 9, 10, 64, 4096):
        reader = FrameReader()
        seen = []
        for start in range(0, len(stream), size):
            seen += reader.feed(stream[start:start + size])
        assert seen == [6, GRAPH_COMPUTE, GRAPH_RECOMPUTE, 8], size


def test_payload_bytes_that_look_like_headers_are_skipped() -> None:
    reader = FrameReader()
    assert reader.feed(frame(6, frame(99, b"not a header"))) == [6]


def test_unknown_command_and_oversized_frame_are_errors() -> None:
    with pytest.raises(FrameError, match="unknown RPC command 200"):
        FrameReader().feed(frame(200, b""))
    with pytest.raises(FrameError, match=f"unknown RPC command {COMMANDS}"):
        FrameReader().feed(frame(COMMANDS, b""))
    with pytest.raises(FrameError, match="announces"):
        FrameReader().feed(struct.pack("<BQ", 6, 1 << 60))


def test_the_compute_status_opt_in_is_the_one_command_beyond_upstreams() -> None:
    opt_in = frame(COMPUTE_STATUS, struct.pack("<I", 1))  # what a patched client sends right after HELLO
    assert FrameReader().feed(frame(HELLO, bytes(24)) + opt_in + frame(15, b"")) == [HELLO, COMPUTE_STATUS, 15]
    for command in (COMPUTE_STATUS - 1, COMPUTE_STATUS + 1, 255):
        with pytest.raises(FrameError, match=f"unknown RPC command {command}"):
            FrameReader().feed(frame(command, struct.pack("<I", 1)))


def parse_whole(stream: bytes) -> list[int] | None:
    """The commands of a stream read in one piece, or None when it is not ggml-rpc frames (the reference)."""
    commands, position = [], 0
    while position + HEADER.size <= len(stream):
        command, size = HEADER.unpack_from(stream, position)
        if (command >= COMMANDS and command != COMPUTE_STATUS) or size > MAX_FRAME:
            return None
        commands.append(command)
        position += HEADER.size + size
    return commands


frames = st.lists(st.tuples(st.integers(0, COMMANDS - 1) | st.just(COMPUTE_STATUS), st.binary(max_size=30))
                  .map(lambda pair: frame(*pair)), max_size=6)
garbage = st.binary(max_size=64) | st.tuples(st.integers(0, 255), st.sampled_from(
    [MAX_FRAME, MAX_FRAME + 1, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)).map(lambda pair: HEADER.pack(*pair))


@settings(max_examples=500, deadline=None)
@given(frames, garbage, st.lists(st.integers(1, 50), min_size=1, max_size=20))
def test_any_stream_in_any_chunks_reads_as_whole_or_is_a_frame_error(good: list[bytes], tail: bytes,
                                                                    cuts: list[int]) -> None:
    stream = b"".join(good) + tail
    expected = parse_whole(stream)
    reader, seen, position, index = FrameReader(), [], 0, 0
    try:
        while position < len(stream):
            step = cuts[index % len(cuts)]
            seen += reader.feed(stream[position:position + step])
            position, index = position + step, index + 1
            assert len(reader._header) < HEADER.size  # never holds more than a part of one header
    except FrameError:
        assert expected is None
    else:
        assert seen == expected


class Capture:
    """A worker side that keeps what it is given, write by write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


SMALL = 64  # WHOLE_FRAME for the property test, so that it runs through many frames quickly
sizes = st.sampled_from([0, 1, 8, 30, SMALL - 1, SMALL, SMALL + 1, 3 * SMALL])


def deferrable(request: bytes) -> bool:
    return request[0] == SET_TENSOR and len(request) - HEADER.size <= SMALL


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([SET_TENSOR, SET_TENSOR, SET_TENSOR, GRAPH_RECOMPUTE, 8, 0]), sizes),
                max_size=12),
       st.lists(st.integers(1, 4 * SMALL), min_size=1, max_size=10), st.booleans())
def test_requests_reach_the_worker_whole_and_none_that_matters_waits(shapes: list[tuple[int, int]], cuts: list[int],
                                                                    sends: bool) -> None:
    requests = [frame(command, bytes([command]) * size) for command, size in shapes]
    stream = b"".join(requests)
    ends = list(itertools.accumulate(len(request) for request in requests))
    spans = [(end - len(request), end) for end, request in zip(ends, requests, strict=True)]
    large = [(start, end) for start, end in spans if end - start - HEADER.size > SMALL]
    urgent = [end for (_, end), request in zip(spans, requests, strict=True) if not deferrable(request)]
    if sends:  # as llama.cpp's client sends them: command byte, size, payload
        chunks = [piece for request in requests
                  for piece in (request[:1], request[1:HEADER.size], request[HEADER.size:]) if piece]
    else:
        chunks, position = [], 0
        for cut in itertools.cycle(cuts):
            if position >= len(stream):
                break
            chunks.append(stream[position:position + cut])
            position += cut
    link, worker = Link(Relay(("127.0.0.1", 1), print)), Capture()
    link.worker_connected(worker)
    fed = 0
    with patch("core.rpc.relay.WHOLE_FRAME", SMALL):
        for chunk in chunks:
            link.from_client(chunk)
            fed += len(chunk)
            assert b"".join(worker.writes) + link.held == stream[:fed]
            # A request the worker answers or computes is passed on (with all before it) once it is whole.
            assert fed - len(link.held) >= max([end for end in urgent if end <= fed], default=0)
            assert len(link.held) <= 2 * SMALL + HEADER.size
    # What is left waiting is only small SET_TENSORs after the last request that mattered.
    assert all(deferrable(request) for (start, _), request in zip(spans, requests, strict=True)
               if start >= len(stream) - len(link.held))
    position = 0
    for write in worker.writes:
        position += len(write)
        assert position in ends or any(start < position < end for start, end in large), "a small request was cut"
    assert len(worker.writes) <= len(urgent) + len(stream) // SMALL + 1 or not sends


def test_a_tokens_requests_reach_the_worker_in_two_writes() -> None:
    # What llama.cpp's client sends one node per token: inputs, the compute, then it waits for the output.
    requests = [frame(SET_TENSOR, bytes(size)) for size in (40, 40, 48, 4136, 1064)]
    requests += [frame(GRAPH_RECOMPUTE, bytes(16)), frame(8, bytes(24))]
    link, worker = Link(Relay(("127.0.0.1", 1), print)), Capture()
    link.worker_connected(worker)
    for request in requests:
        for piece in (request[:1], request[1:HEADER.size], request[HEADER.size:]):  # three send() calls each
            link.from_client(piece)
    assert worker.writes == [b"".join(requests[:6]), requests[6]]


def test_compute_times_are_summed_and_counted_besides_their_moving_average() -> None:
    link = Link(Relay(("127.0.0.1", 1), print))
    link.worker_connected(Capture())
    # Two tokens: a compute sent at 1.000 s answered at 1.004 s, a recompute at 2.000 s answered at 2.010 s.
    with patch("core.rpc.relay.time") as clock:
        clock.perf_counter.side_effect = [1.000, 1.004, 2.000, 2.010]
        for command in (GRAPH_COMPUTE, GRAPH_RECOMPUTE):
            link.from_client(frame(command, bytes(16)))
            link.from_worker(b"the next node's input")
        link.from_worker(b"an answer with no compute before it")  # not timed
    stats = link.relay.stats
    assert stats.computes_timed == 2
    assert stats.compute_ms_total == pytest.approx(14.0)
    assert stats.compute_ms == pytest.approx(0.2 * 10.0 + 0.8 * 4.0)


# A load's start and two decode steps, as llama.cpp's client sends them to one node (command, payload size).
LOAD = [(HELLO, 24), (15, 0), (11, 4), (1, 4), (2, 4), (0, 8), (3, 8), (12, 120), (6, 5000), (7, 56), (5, 9)]
STEP = [(SET_TENSOR, 40), (SET_TENSOR, 48), (SET_TENSOR, 4136), (GRAPH_RECOMPUTE, 16), (8, 24)]
OPT_IN = (COMPUTE_STATUS, 4)


def session_after(requests: list[tuple[int, int]], pieces: str = "sends") -> tuple[Relay, Link, Capture]:
    """A relay's latest link after ``requests`` went through it, each answered by 100 bytes; ``pieces``: as
    llama.cpp sends them (command, size, payload), or all of them in one chunk."""
    relay, worker = Relay(("127.0.0.1", 1), print), Capture()
    link = relay._new_link()
    link.worker_connected(worker)
    stream = [frame(command, bytes(size)) for command, size in requests]
    if pieces == "sends":
        for request in stream:
            for piece in (request[:1], request[1:HEADER.size], request[HEADER.size:]):
                if piece:
                    link.from_client(piece)
            link.from_worker(bytes(100))
    else:
        link.from_client(b"".join(stream))
        link.from_worker(bytes(100 * len(stream)))
    return relay, link, worker


def test_a_connections_commands_are_counted_and_their_order_hashed() -> None:
    requests = LOAD + STEP + STEP
    relay, link, _ = session_after(requests)
    session = relay.stats.session
    assert session is link.session and session is not None
    assert session.commands == len(requests)
    assert session.digest == hashlib.blake2b(bytes(command for command, _ in requests), digest_size=8).hexdigest()
    assert session.bytes_to == sum(HEADER.size + size for _, size in requests) == relay.stats.bytes_to
    assert session.bytes_from == 100 * len(requests)
    status = session.status()
    assert status == SessionStatus(commands=len(requests), digest=session.digest, counts={
        "ALLOC_BUFFER": 1, "GET_ALIGNMENT": 1, "GET_MAX_SIZE": 1, "BUFFER_GET_BASE": 1, "BUFFER_CLEAR": 1,
        "SET_TENSOR": 7, "SET_TENSOR_HASH": 1, "GET_TENSOR": 2, "GET_DEVICE_MEMORY": 1, "INIT_TENSOR": 1,
        "HELLO": 1, "DEVICE_COUNT": 1, "GRAPH_RECOMPUTE": 2}, bytes_to=session.bytes_to, bytes_from=session.bytes_from)


def test_the_same_requests_give_the_same_digest_however_they_arrive_and_with_the_opt_in() -> None:
    stock = session_after(LOAD + STEP + STEP)[0].stats.session
    whole = session_after(LOAD + STEP + STEP, pieces="whole")[0].stats.session
    negotiated = session_after([*LOAD[:1], OPT_IN, *LOAD[1:], *STEP, *STEP])[0].stats.session
    other = session_after(LOAD + STEP + STEP[::-1])[0].stats.session
    assert stock is not None and whole is not None and negotiated is not None and other is not None
    assert stock.digest == whole.digest == negotiated.digest != other.digest
    assert stock.commands == whole.commands == negotiated.commands
    assert negotiated.status().counts["COMPUTE_STATUS"] == 1 and "COMPUTE_STATUS" not in stock.status().counts
    assert negotiated.bytes_to == stock.bytes_to + HEADER.size + 4  # the opt-in is all that differs
    assert stock.bytes_from == whole.bytes_from  # answers are counted, not parsed


def test_each_connection_has_its_own_session_and_the_latest_is_shown() -> None:
    relay, first, _ = session_after(LOAD)
    first.close()
    second = relay._new_link()
    second.worker_connected(Capture())
    assert relay.stats.session is second.session and second.session.commands == 0
    first.from_worker(bytes(10))  # a late answer on the old connection stays on its session
    second.from_client(frame(HELLO, bytes(24)))
    assert (first.session.commands, second.session.commands) == (len(LOAD), 1)
    assert second.session.bytes_from == 0 and relay.stats.bytes_to == first.session.bytes_to + second.session.bytes_to


@pytest.mark.integration
def test_relay_in_front_of_a_real_worker() -> None:
    port = free_port()
    worker = subprocess.Popen([str(worker_binary("cpu").path), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events: list[str] = []

    async def scenario() -> None:
        relay = Relay(("127.0.0.1", port), events.append)
        host, relay_port = await relay.start()
        info = await probe_worker(host, relay_port, timeout=5.0)  # HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY
        assert info.mem_total > 0
        assert relay.stats.connections == 1 and relay.stats.bytes_to > 0 and relay.stats.bytes_from > 0
        session = relay.stats.session
        assert session is not None and session.status().counts == {
            "HELLO": 1, "DEVICE_COUNT": 1, "GET_DEVICE_MEMORY": len(info.devices)}
        assert session.bytes_from == relay.stats.bytes_from
        # A corrupt stream closes that connection and is reported; the relay serves the next one.
        reader, writer = await asyncio.open_connection(host, relay_port)
        writer.write(frame(250, b""))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert events == ["closed the coordinator's connection: unknown RPC command 250"]
        assert (await probe_worker(host, relay_port, timeout=5.0)).mem_total == info.mem_total
        # The worker goes away: the coordinator's side is closed too, as without a relay.
        reader, writer = await asyncio.open_connection(host, relay_port)
        await asyncio.sleep(0.2)
        worker.kill()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await relay.close()

    try:
        while not listening(port):
            time.sleep(0.05)
        asyncio.run(scenario())
    finally:
        worker.kill()
        worker.wait()
