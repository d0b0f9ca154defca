"""The control socket: a Unix socket in the cluster's state dir, one request line and its answers as JSON lines.

The server half answers any Service; the client half is what the CLI's SDK (core.client) talks through. Every
error, whatever went wrong, has one shape: ``{"event": "error", "message", "exit_code"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from core.errors import ClusterError, ConnectError, PromptError
from core.service import GenerateRequest, Service
from core.state import StateDir
from core.status import CoordinatorState

# Stream lines can be long (a snapshot with many events); the default 64 KiB is too tight.
LINE_LIMIT = 16 << 20


def peer_uid(connection: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (Linux), or None where unknown."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


def error_answer(message: str, exit_code: int = 1) -> dict[str, Any]:
    """The one shape of every error the control socket answers (``exit_code``: what the CLI exits with)."""
    return {"event": "error", "message": " ".join(message.split()), "exit_code": exit_code}


WATCH_MIN_INTERVAL_S = 0.1  # a watcher asking for less would have the controller send snapshots flat out


async def serve_client(service: Service, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer one control connection: one request line, then its answers (JSON lines)."""
    async def send(message: dict[str, Any]) -> None:
        # A client gone is a ConnectionError on any loop (uvloop would raise RuntimeError on the write).
        if writer.is_closing():
            raise ConnectionResetError("the client went away")
        writer.write((json.dumps(message) + "\n").encode())
        await writer.drain()

    try:
        # The socket is 0600 in a 0700 folder; this also turns away a user who was let in by a chmod.
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid is not None and uid != os.getuid():
            service.record("refused", f"refused a control connection from uid {uid} (only uid {os.getuid()} "
                              f"may control this cluster)")
            await send(error_answer("this cluster belongs to another user"))
            return
        line = await reader.readline()
        if not line:
            return
        request = json.loads(line)
        op = request.get("op") if isinstance(request, dict) else None
        if op == "ping":
            await send({"ok": True, "pid": os.getpid(), "inventory": service.fingerprint()})
        elif op == "status":
            await send(service.snapshot().to_dict())
        elif op == "watch":
            interval = request.get("interval", 1.0)
            if isinstance(interval, bool) or not isinstance(interval, int | float) or not interval >= 0:
                raise ValueError("'interval' must be a number of seconds")
            interval = max(float(interval), WATCH_MIN_INTERVAL_S)
            while service.serving():
                await send(service.snapshot().to_dict())
                await service.wait_change(interval)
        elif op == "run":
            await service.generate(GenerateRequest.parse(request, service.context), send)
        elif op == "profile":
            await service.reprofile()
            coordinator = service.snapshot().coordinator
            if coordinator.state != CoordinatorState.READY:
                raise ClusterError(f"the coordinator did not come back: {coordinator.last_error}")
            await send({"ok": True})
        elif op == "down":
            left = await service.shutdown(stop_workers=not request.get("keep_workers", False))
            await send({"ok": True, "left_running": left})
        elif op == "retry":
            await service.retry()
            await send(service.snapshot().to_dict())
        else:
            await send(error_answer(f"bad request: unknown op {op!r}", 2))
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    except ClusterError as exc:
        with contextlib.suppress(ConnectionError):
            await send(error_answer(str(exc), exc.exit_code))
    except (ValueError, TypeError) as exc:  # not JSON, a line over the reader's limit, a field of the wrong type
        with contextlib.suppress(ConnectionError):
            await send(error_answer(f"bad request: {exc}", 2))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def serve_control(service: Service, path: Path) -> asyncio.Server:
    """Listen on ``path`` (0600: only this user; `serve_client` checks the peer too).

    The socket is bound and listening under another name first, then renamed into place: a socket file that
    exists before listen() refuses connections, and `up` takes the file for a controller that is ready to talk.
    The other name is no longer than ``path``'s (a socket path has a length limit).
    """
    staged = path.with_suffix(".new")
    staged.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(lambda r, w: serve_client(service, r, w), path=str(staged))
    staged.chmod(0o600)
    staged.replace(path)
    return server


# --- the client half -------------------------------------------------------------------------------


async def exchange(state: StateDir, message: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Send one request to the controller and yield its answers; an error answer raises it as ClusterError."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(state.socket), limit=LINE_LIMIT)
    except (FileNotFoundError, ConnectionRefusedError):
        raise ConnectError(f"the cluster at {state.root} is not running",
                           "fix: run `ggml-cluster up`") from None
    try:
        writer.write((json.dumps(message) + "\n").encode())
        await writer.drain()
        async for line in reader:
            answer = json.loads(line)
            if answer.get("event") == "error":
                error = PromptError if answer.get("exit_code") == PromptError.exit_code else ClusterError
                raise error(str(answer.get("message")))
            yield answer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def ask(state: StateDir, message: dict[str, Any]) -> dict[str, Any]:
    """One request, one answer."""
    async for answer in exchange(state, message):
        return answer
    raise ConnectError(f"the controller at {state.root} closed the connection without answering")
