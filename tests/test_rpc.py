"""The ggml-rpc client: framing, hostile peers, and a real worker."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import subprocess
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ConnectError, WorkerDown, WorkerError
from core.nodes.build import worker_binary
from core.rpc import wire as rpc
from tests.harness import free_port, listening


def test_request_frame_layout() -> None:
    frame = rpc.encode_request(rpc.CMD_HELLO, bytes(24))
    assert frame[0] == 14 and struct.unpack("<Q", frame[1:9])[0] == 24 and len(frame) == 33


def test_hello_answer() -> None:
    stock = rpc.decode_hello(bytes([7, 0, 0, 0]) + bytes(24))
    assert stock == rpc.HelloAnswer(rpc.Version(7, 0, 0), 0) and not stock.compute_status
    with pytest.raises(WorkerError, match="another RPC protocol"):
        rpc.decode_hello(bytes([3, 0, 0]))


def test_hello_answer_of_a_worker_that_reports_failed_computes() -> None:
    """The padding byte (index 3) carries the feature bits; stock workers send 0 there, and conn_caps is RDMA's."""
    patched = rpc.decode_hello(bytes([7, 0, 0, 0x01]) + bytes(24))
    assert patched.version == rpc.Version(7, 0, 0) and patched.features == rpc.FEATURE_COMPUTE_STATUS
    assert patched.compute_status
    unknown_bits = rpc.decode_hello(bytes([7, 0, 0, 0xFE]) + bytes([0x01]) + bytes(23))
    assert unknown_bits.features == 0xFE and not unknown_bits.compute_status


def test_compute_status_command_is_outside_upstreams_range() -> None:
    assert rpc.CMD_COMPUTE_STATUS == 128 > rpc.CMD_COUNT
    assert rpc.COMMAND_NAMES[rpc.CMD_COMPUTE_STATUS] == "COMPUTE_STATUS"
    assert rpc.COMMAND_NAMES[rpc.CMD_HELLO] == "HELLO" and rpc.COMMAND_NAMES[rpc.CMD_GRAPH_COMPUTE] == "GRAPH_COMPUTE"
    assert sorted(rpc.COMMAND_NAMES) == [*range(rpc.CMD_COUNT), rpc.CMD_COMPUTE_STATUS]


def test_sizes_no_answer_can_have_are_refused() -> None:
    with pytest.raises(WorkerError, match="larger than any valid answer"):
        rpc.decode_size(struct.pack("<Q", 2**64 - 1))
    with pytest.raises(WorkerError, match="truncated"):
        rpc.decode_size(b"\x01\x02")


def test_device_answers() -> None:
    assert rpc.decode_device_count(struct.pack("<I", 2)) == 2
    assert rpc.decode_device_memory(struct.pack("<QQ", 5, 9)) == rpc.DeviceMemory(5, 9)
    with pytest.raises(WorkerError):
        rpc.decode_device_memory(b"\x00" * 8)


def test_version_rule_is_the_clients() -> None:
    client = rpc.Version(7, 0, 0)
    assert rpc.Version(7, 0, 3).compatible_with(client)
    assert not rpc.Version(7, 1, 0).compatible_with(client)
    assert not rpc.Version(6, 0, 0).compatible_with(client)


async def _serve(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                 check: Callable[[int], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        await check(port)


def test_peer_with_a_huge_size_is_refused_without_allocating() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(33)
        writer.write(struct.pack("<Q", 2**63))
        await writer.drain()

    async def check(port: int) -> None:
        with pytest.raises(WorkerError, match="larger than any valid answer"):
            await rpc.probe_worker("127.0.0.1", port, timeout=2)

    asyncio.run(_serve(handler, check))


@pytest.mark.parametrize("features", [0x00, 0x01])
def test_probe_says_whether_the_worker_reports_failed_computes(features: int) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answers = [bytes([7, 0, 0, features]) + bytes(24), struct.pack("<I", 1), struct.pack("<QQ", 5, 9)]
        for answer in answers:  # HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY
            _, size = struct.unpack("<BQ", await reader.readexactly(9))
            await reader.readexactly(size)
            writer.write(struct.pack("<Q", len(answer)) + answer)
            await writer.drain()
        await reader.read()  # the probe sends nothing else: no COMPUTE_STATUS opt-in
        writer.close()

    async def check(port: int) -> None:
        info = await rpc.probe_worker("127.0.0.1", port, timeout=2)
        assert info == rpc.WorkerInfo(rpc.Version(7, 0, 0), (rpc.DeviceMemory(5, 9),), compute_status=bool(features))
        assert info.rtt_s is not None  # DEVICE_COUNT's round trip, timed

    asyncio.run(_serve(handler, check))


def test_silent_peer_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def check(port: int) -> None:
        with pytest.raises(ConnectError, match="did not answer HELLO"):
            await rpc.probe_worker("127.0.0.1", port, timeout=0.3)

    asyncio.run(_serve(handler, check))


def test_peer_that_hangs_up_mid_answer() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(33)
        writer.write(struct.pack("<Q", 28) + b"\x07\x00")
        await writer.drain()
        writer.close()

    async def check(port: int) -> None:
        with pytest.raises(WorkerError, match="connection closed"):
            await rpc.probe_worker("127.0.0.1", port, timeout=2)

    asyncio.run(_serve(handler, check))


def test_nobody_listening_is_a_worker_that_is_down() -> None:
    with pytest.raises(WorkerDown, match="nothing listens on "):
        asyncio.run(rpc.probe_worker("127.0.0.1", free_port(), timeout=1))


def test_a_peer_that_hangs_up_before_answering_is_down_not_wrong() -> None:
    """What an SSH port forward to a port nobody listens on looks like from here."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def check(port: int) -> None:
        with pytest.raises(WorkerDown, match="closed before any answer"):
            await rpc.probe_worker("127.0.0.1", port, timeout=2)

    asyncio.run(_serve(handler, check))


@pytest.mark.integration
def test_real_worker_answers_hello_and_memory() -> None:
    binary = worker_binary("cpu")
    port = free_port()
    worker = subprocess.Popen([str(binary.path), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        info = asyncio.run(rpc.probe_worker("127.0.0.1", port))
    finally:
        worker.kill()
        worker.wait()
    assert info.version == binary.protocol == rpc.Version(7, 0, 0)
    assert len(info.devices) >= 1
    assert 0 < info.mem_free <= info.mem_total


# --- fuzz: whatever a peer answers, the probe ends in time with a result or a clean error, in bounded memory ---

SIZES = st.sampled_from([0, 4, 16, rpc.HELLO_RESPONSE_SIZE, rpc.MAX_RESPONSE_SIZE, rpc.MAX_RESPONSE_SIZE + 1,
                         2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)
HELLO = bytes([3, 0, 0]) + bytes(rpc.HELLO_RESPONSE_SIZE - 3)
answers = st.lists(st.one_of(
    st.tuples(SIZES, st.binary(max_size=40)).map(lambda pair: struct.pack("<Q", pair[0]) + pair[1]),
    st.just(struct.pack("<Q", len(HELLO)) + HELLO),
    st.integers(0, 2**32 - 1).map(lambda count: struct.pack("<QI", 4, count)),
    st.binary(max_size=24)), max_size=5)


@settings(max_examples=100, deadline=None)
@given(answers, st.booleans())
def test_any_answer_to_the_probe_is_a_result_or_a_clean_error(script: list[bytes], hang_up: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for answer in script:
                _, size = struct.unpack("<BQ", await reader.readexactly(9))
                await reader.readexactly(size)
                writer.write(answer)
                await writer.drain()
            if not hang_up:
                await asyncio.sleep(5)
        writer.close()

    async def check(port: int) -> None:
        tracemalloc.start()
        try:
            await rpc.probe_worker("127.0.0.1", port, timeout=0.2)
        except (WorkerError, ConnectError) as exc:
            assert "\n" not in str(exc)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 4 << 20

    asyncio.run(_serve(handler, check))


def test_a_peer_with_billions_of_devices_is_refused() -> None:
    with pytest.raises(WorkerError, match="reports 4294967295 devices"):
        rpc.decode_device_count(struct.pack("<I", 2**32 - 1))
