"""The observing relay: frame headers parsed across any chunking, bad streams closed, real worker traffic counted."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.build import worker_binary
from core.relay import COMMANDS, GRAPH_COMPUTE, GRAPH_RECOMPUTE, HEADER, MAX_FRAME, FrameError, FrameReader, Relay
from core.rpc import probe_worker
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
