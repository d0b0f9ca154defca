"""A small ggml-rpc client: HELLO (version check), DEVICE_COUNT, GET_DEVICE_MEMORY.

Wire format (ggml-rpc.cpp): request ``cmd:u8 | size:u64 | payload``, response ``size:u64 | payload``,
little-endian and packed. The server serves one client at a time, so only probe a worker that the
coordinator is not connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from dataclasses import dataclass, field

from core.errors import ConnectError, WorkerDown, WorkerError
from core.version import Version

# Command numbers of the pinned llama.cpp's ggml-rpc.cpp (enum rpc_cmd) that ggml-cluster reads or sends.
CMD_SET_TENSOR = 6
CMD_GRAPH_COMPUTE = 10
CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CMD_GRAPH_RECOMPUTE = 16
CMD_COUNT = 19  # RPC_CMD_COUNT: a command byte beyond it is not stock ggml-rpc
# ggml-cluster's in-protocol compute status (patched workers and coordinator): a worker that sets this bit in
# its HELLO answer's padding byte (stock ones send 0) reports a failed graph compute on its next answer instead
# of aborting; a client that sees it opts in with CMD_COMPUTE_STATUS right after HELLO (u32 flags, no answer).
FEATURE_COMPUTE_STATUS = 0x01
CMD_COMPUTE_STATUS = 128
# Every command by number (enum rpc_cmd, and ours), for what the relay counts.
COMMAND_NAMES = {number: name for number, name in enumerate((
    "ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
    "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
    "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR", "NONE"))}
COMMAND_NAMES[CMD_COMPUTE_STATUS] = "COMPUTE_STATUS"
CONN_CAPS_SIZE = 24
HELLO_RESPONSE_SIZE = 4 + CONN_CAPS_SIZE
# No answer this protocol sends is larger; a bigger size means the peer is not a ggml-rpc server.
MAX_RESPONSE_SIZE = 1 << 20
MAX_DEVICES = 256  # far more than one machine holds; a larger count is a broken or hostile peer

HEADER = struct.Struct("<BQ")  # a request's command and payload size
_SIZE = struct.Struct("<Q")


@dataclass(frozen=True)
class DeviceMemory:
    """Free and total bytes of one device on a worker."""

    free: int
    total: int


def encode_request(cmd: int, payload: bytes = b"") -> bytes:
    """One request frame."""
    return HEADER.pack(cmd, len(payload)) + payload


def decode_size(header: bytes) -> int:
    """The payload size from a response header, refusing sizes no valid answer has."""
    if len(header) != _SIZE.size:
        raise WorkerError(f"truncated RPC response header ({len(header)} of {_SIZE.size} bytes)")
    (size,) = _SIZE.unpack(header)
    if size > MAX_RESPONSE_SIZE:
        raise WorkerError(f"RPC response of {size} bytes is larger than any valid answer; "
                          "is this port a ggml-rpc-server?")
    return int(size)


@dataclass(frozen=True)
class HelloAnswer:
    """A HELLO answer: the server's protocol version and its feature bits (the padding byte; 0 from stock)."""

    version: Version
    features: int = 0

    @property
    def compute_status(self) -> bool:
        """Whether the server reports a failed graph compute on its next answer (patched workers)."""
        return bool(self.features & FEATURE_COMPUTE_STATUS)


def decode_hello(payload: bytes) -> HelloAnswer:
    """The server's protocol version and feature bits from a HELLO answer."""
    if len(payload) != HELLO_RESPONSE_SIZE:
        raise WorkerError(f"HELLO answer has {len(payload)} bytes, expected {HELLO_RESPONSE_SIZE}; "
                          "the worker speaks another RPC protocol")
    return HelloAnswer(Version(payload[0], payload[1], payload[2]), payload[3])


def decode_device_count(payload: bytes) -> int:
    """Number of devices from a DEVICE_COUNT answer."""
    if len(payload) != 4:
        raise WorkerError(f"DEVICE_COUNT answer has {len(payload)} bytes, expected 4")
    count = int(struct.unpack("<I", payload)[0])
    if count > MAX_DEVICES:
        raise WorkerError(f"the worker reports {count} devices; is this port a ggml-rpc-server?")
    return count


def decode_device_memory(payload: bytes) -> DeviceMemory:
    """Free and total memory from a GET_DEVICE_MEMORY answer."""
    if len(payload) != 16:
        raise WorkerError(f"GET_DEVICE_MEMORY answer has {len(payload)} bytes, expected 16")
    free, total = struct.unpack("<QQ", payload)
    return DeviceMemory(int(free), int(total))


@dataclass(frozen=True)
class WorkerInfo:
    """What a HELLO probe learned about a worker."""

    version: Version
    devices: tuple[DeviceMemory, ...]
    compute_status: bool = False  # it reports failed graph computes instead of aborting (FEATURE_COMPUTE_STATUS)
    # DEVICE_COUNT's round trip: the link's latency, with the worker's least work (a measurement, not identity)
    rtt_s: float | None = field(default=None, compare=False)

    @property
    def mem_free(self) -> int:
        """Free bytes over all devices."""
        return sum(device.free for device in self.devices)

    @property
    def mem_total(self) -> int:
        """Total bytes over all devices."""
        return sum(device.total for device in self.devices)


async def _call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cmd: int, payload: bytes,
                first: bool = False) -> bytes:
    writer.write(encode_request(cmd, payload))
    await writer.drain()
    try:
        header = await reader.readexactly(_SIZE.size)
    except asyncio.IncompleteReadError as exc:
        if first and not exc.partial:
            # Closed before a byte: an SSH forward whose far end has no listener looks like this.
            raise WorkerDown("the connection was closed before any answer (nothing listens there)") from None
        raise WorkerError(f"connection closed after {len(exc.partial)} bytes of an RPC answer") from None
    except ConnectionResetError:
        if first:
            raise WorkerDown("the connection was reset before any answer") from None
        raise
    try:
        return await reader.readexactly(decode_size(header))
    except asyncio.IncompleteReadError as exc:
        raise WorkerError(f"connection closed after {_SIZE.size + len(exc.partial)} bytes of an RPC answer") from None


async def probe_worker(host: str, port: int, timeout: float = 5.0, client: Version | None = None) -> WorkerInfo:
    """Connect, HELLO, and read every device's memory.

    Raises WorkerDown when nothing listens (refused, or closed before answering), ConnectError when
    nothing answers in time, WorkerError when the answer is wrong, including a protocol that ``client``
    cannot speak (checked before anything else is sent).
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        raise WorkerDown(f"nothing listens on {host}:{port}") from None
    except (OSError, TimeoutError) as exc:
        raise ConnectError(f"cannot connect to {host}:{port}: {exc or 'timed out'}") from None
    try:
        async with asyncio.timeout(timeout):
            hello = decode_hello(await _call(reader, writer, CMD_HELLO, bytes(CONN_CAPS_SIZE), first=True))
            if client is not None and not hello.version.compatible_with(client):
                raise WorkerError(f"worker speaks RPC protocol {hello.version}, the coordinator speaks {client}",
                                  "fix: rebuild the worker from the coordinator's llama.cpp (ggml-cluster does "
                                  "this unless the node sets build: {path: …})")
            # Timed after HELLO, on an open connection: one request and its answer, nothing else on the way.
            asked = time.perf_counter()
            count = decode_device_count(await _call(reader, writer, CMD_DEVICE_COUNT, b""))
            rtt = time.perf_counter() - asked
            devices = []
            for index in range(count):
                answer = await _call(reader, writer, CMD_GET_DEVICE_MEMORY, struct.pack("<I", index))
                devices.append(decode_device_memory(answer))
    except TimeoutError:
        raise ConnectError(f"{host}:{port} did not answer HELLO within {timeout:g}s "
                           "(busy with another client, or not a ggml-rpc-server)") from None
    except WorkerDown as exc:
        raise WorkerDown(f"{host}:{port}: {exc}") from None
    except OSError as exc:
        raise ConnectError(f"{host}:{port}: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return WorkerInfo(hello.version, tuple(devices), hello.compute_status, rtt)
