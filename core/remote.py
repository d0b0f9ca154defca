"""How the controller reaches a node: run a shell command, follow a command's output, upload a file,
and get a local endpoint for the node's loopback RPC port.

`LocalRemote` is a node on this machine. Every command is a string for the node's POSIX shell; callers
build it with `quote`/`shell_command`, so nothing from the inventory is ever interpreted by a shell.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from core.errors import ConnectError


def shell_command(argv: Sequence[str | Path]) -> str:
    """One shell-safe command line from an argument vector."""
    return " ".join(shlex.quote(str(arg)) for arg in argv)


@dataclass(frozen=True)
class CommandResult:
    """Exit status and output of a finished command."""

    code: int
    stdout: str
    stderr: str


class Remote(Protocol):
    """A node's shell, files and loopback ports."""

    name: str

    async def run(self, command: str, timeout: float = 30.0) -> CommandResult:
        """Run a shell command to completion."""
        ...

    def follow(self, command: str) -> AsyncIterator[str]:
        """Run a long-lived shell command and yield its output lines until it ends."""
        ...

    async def upload(self, source: Path, destination: str, mode: int = 0o644) -> None:
        """Copy a local file to the node."""
        ...

    async def endpoint(self, port: int) -> tuple[str, int]:
        """A host and port on this machine that reach the node's 127.0.0.1:port."""
        ...

    async def close(self) -> None:
        """Release connections and forwards."""
        ...


class LocalRemote:
    """A node that is this machine: commands run under /bin/sh, the RPC port is reached directly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._followers: set[asyncio.subprocess.Process] = set()

    async def run(self, command: str, timeout: float = 30.0) -> CommandResult:
        """Run a shell command to completion."""
        process = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ConnectError(f"node {self.name}: command timed out after {timeout:g}s") from None
        return CommandResult(process.returncode or 0, stdout.decode(errors="replace"),
                             stderr.decode(errors="replace"))

    async def follow(self, command: str) -> AsyncIterator[str]:
        """Run a long-lived shell command and yield its output lines until it ends."""
        process = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", f"exec {command}", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        self._followers.add(process)
        if process.stdout is None:
            raise ConnectError(f"node {self.name}: cannot read the output of {command}")
        try:
            async for raw in process.stdout:
                yield raw.decode(errors="replace").rstrip("\n")
        finally:
            self._followers.discard(process)
            if process.returncode is None:
                process.kill()
                await process.wait()

    async def upload(self, source: Path, destination: str, mode: int = 0o644) -> None:
        """Copy a local file into place atomically."""
        target = Path(destination)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(source, partial)
        partial.chmod(mode)
        partial.replace(target)

    async def endpoint(self, port: int) -> tuple[str, int]:
        """The worker listens on this machine's loopback."""
        return ("127.0.0.1", port)

    async def close(self) -> None:
        """Stop any command still being followed."""
        for process in list(self._followers):
            if process.returncode is None:
                process.kill()
                await process.wait()
