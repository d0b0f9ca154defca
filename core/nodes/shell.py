"""Talking to a node's shell: the Remote protocol every way of reaching a node implements, and the quoting
and wrapping that keep anything from the inventory from being interpreted by a shell."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.errors import ConnectError


def shell_command(argv: Sequence[str | Path]) -> str:
    """One shell-safe command line from an argument vector."""
    return " ".join(shlex.quote(str(arg)) for arg in argv)


async def free_bytes(remote: Remote, folder: str) -> int | None:
    """Bytes free to the node's user in ``folder`` (POSIX df), or None when unknown."""
    with contextlib.suppress(ConnectError):
        lines = (await remote.run(f"df -Pk {shell_command([folder])}")).stdout.splitlines()
        fields = lines[-1].split() if len(lines) > 1 else []
        if len(fields) >= 4 and fields[3].isdigit():
            return int(fields[3]) * 1024
    return None


# Shell functions that check a pid file before anything is signalled (process identity on a node).
PIDS = Path(__file__).with_name("pids.sh").read_text()


def tied_to_reader(command: str) -> str:
    """Run ``command`` until it ends or our end of its stdin closes (we stopped reading, or died).

    The command runs in a process group of its own (setsid; where there is none, job control), and a
    watcher reading stdin (saved on fd 3: background jobs get /dev/null) kills that whole group at EOF, so
    neither a `tail -F` nor a build's compilers outlive the controller that followed them.
    """
    inner = shell_command(["sh", "-c", command])
    return ("exec 3<&0; if command -v setsid >/dev/null 2>&1; then "
            f"setsid {inner} </dev/null & else set -m 2>/dev/null; {inner} </dev/null & fi; follower=$!; "
            '(cat <&3 >/dev/null 2>&1; kill -TERM -"$follower" 2>/dev/null || kill -TERM "$follower" 2>/dev/null) '
            '>/dev/null 2>&1 & wait "$follower"')


@dataclass(frozen=True)
class CommandResult:
    """Exit status and output of a finished command."""

    code: int
    stdout: str
    stderr: str


class ChannelSink(Protocol):
    """Where the bytes of a channel to a node's port go, and what tells it the channel's state (the relay's
    link implements it): a node's transport carries bytes without knowing what they mean."""

    def worker_connected(self, transport: Any) -> None:
        """The channel is open; ``transport`` writes to the node (``write``, ``close``)."""
        ...

    def from_worker(self, data: bytes) -> None:
        """Bytes from the node."""
        ...

    def pause_client(self, paused: bool) -> None:
        """The channel's window is full (True) or has room again (False)."""
        ...

    def close(self) -> None:
        """The channel is gone."""
        ...


class Remote(Protocol):
    """A node's shell, files and loopback ports."""

    name: str

    async def run(self, command: str, timeout: float = 30.0, stdin: str | None = None) -> CommandResult:
        """Run a shell command to completion, with ``stdin`` as its input."""
        ...

    def follow(self, command: str) -> AsyncGenerator[str, None]:
        """Run a long-lived shell command and yield its output lines until it ends (or we close it)."""
        ...

    async def upload(self, source: Path, destination: str, mode: int = 0o644) -> None:
        """Copy a local file to the node."""
        ...

    async def endpoint(self, port: int) -> tuple[str, int]:
        """A host and port on this machine that reach the node's 127.0.0.1:port."""
        ...

    def home(self) -> str:
        """The node user's home directory (to expand ``~`` in paths we quote)."""
        ...

    async def connect(self) -> None:
        """Reach the node (raises ConnectError with what to fix)."""
        ...

    async def port_open(self, port: int, host: str = "127.0.0.1") -> bool:
        """Whether something listens on the node's host:port (its loopback by default)."""
        ...

    async def close(self) -> None:
        """Release connections and forwards."""
        ...


