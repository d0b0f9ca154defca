"""The observing relay: frame headers parsed across any chunking, bad streams closed, real worker traffic counted."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import time

import pytest

from core.build import worker_binary
from core.relay import GRAPH_COMPUTE, GRAPH_RECOMPUTE, FrameError, FrameReader, Relay
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
