"""The observing relay: frame headers parsed across any chunking, bad streams closed, real worker traffic counted."""

from __future__ import annotations

import asyncio
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
from core.rpc.wire import CMD_COUNT as COMMANDS
from core.rpc.wire import CMD_GRAPH_COMPUTE as GRAPH_COMPUTE
from core.rpc.wire import CMD_GRAPH_RECOMPUTE as GRAPH_RECOMPUTE
from core.rpc.wire import CMD_SET_TENSOR as SET_TENSOR
from core.rpc.wire import HEADER, probe_worker
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
    with pytest.raises(FrameError, match="announces"):
        FrameReader().feed(struct.pack("<BQ", 6, 1 << 60))


def parse_whole(stream: bytes) -> list[int] | None:
    """The commands of a stream read in one piece, or None when it is not ggml-rpc frames (the reference)."""
    commands, position = [], 0
    while position + HEADER.size <= len(stream):
        command, size = HEADER.unpack_from(stream, position)
        if command >= COMMANDS or size > MAX_FRAME:
            return None
        commands.append(command)
        position += HEADER.size + size
    return commands


frames = st.lists(st.tuples(st.integers(0, COMMANDS - 1), st.binary(max_size=30)).map(lambda pair: frame(*pair)),
                  max_size=6)
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
