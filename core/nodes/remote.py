"""How the controller reaches a node: `LocalRemote` for a worker on this machine, `SshRemote` (core.nodes.ssh)
for the others. Every command is a string for the node's POSIX shell; callers build it with `shell_command`, so
nothing from the inventory is ever interpreted by a shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.errors import ConnectError
from core.inventory import Node
from core.nodes.shell import CommandResult, Remote, tied_to_reader
from core.nodes.ssh import SshRemote

# Threads that wait for local commands: one per command in flight (the default pool has cores + 4, and a
# few nodes' samples, starts and stops at once would queue behind each other).
_COMMANDS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="local-command")


class LocalRemote:
    """A node that is this machine: commands run under /bin/sh, the RPC port is reached directly.

    Commands are started by the standard library's subprocess, not by the event loop: uvloop (the
    controller's loop) leaves copies of a child's pipe ends open in the child, so a command that starts a
    daemon (the worker's supervisor) would hand them on and its output would never end.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._followers: set[subprocess.Popen[bytes]] = set()

    async def run(self, command: str, timeout: float = 30.0, stdin: str | None = None) -> CommandResult:
        """Run a shell command to completion, with ``stdin`` as its input."""
        def start() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(["/bin/sh", "-c", command], input=(stdin or "").encode(), capture_output=True,
                                  timeout=timeout, check=False)

        try:
            done = await asyncio.get_running_loop().run_in_executor(_COMMANDS, start)
        except subprocess.TimeoutExpired:
            raise ConnectError(f"node {self.name}: command timed out after {timeout:g}s") from None
        return CommandResult(done.returncode, done.stdout.decode(errors="replace"),
                             done.stderr.decode(errors="replace"))

    async def follow(self, command: str) -> AsyncGenerator[str, None]:
        """Run a long-lived shell command and yield its output lines until it ends."""
        process = subprocess.Popen(["/bin/sh", "-c", tied_to_reader(command)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._followers.add(process)
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), process.stdout)
        try:
            async for raw in reader:
                yield raw.decode(errors="replace").rstrip("\n")
        finally:
            transport.close()
            self._followers.discard(process)
            await _end_follower(process)

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

    def home(self) -> str:
        """This user's home directory."""
        return str(Path.home())

    async def connect(self) -> None:
        """Nothing to connect to."""

    async def port_open(self, port: int, host: str = "127.0.0.1") -> bool:
        """Whether something listens on host:port."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def close(self) -> None:
        """Stop any command still being followed."""
        for process in list(self._followers):
            await _end_follower(process)


async def _end_follower(process: subprocess.Popen[bytes]) -> None:
    """Close its stdin (its watcher then stops the command); kill it if that takes too long."""
    if process.stdin is not None and not process.stdin.closed:
        with contextlib.suppress(OSError):
            process.stdin.close()
    deadline = time.monotonic() + 2
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if process.poll() is None:
        process.kill()
        await asyncio.get_running_loop().run_in_executor(_COMMANDS, process.wait)


def remote_for(node: Node) -> Remote:
    """The way to reach ``node``: this machine for ``kind: local``, else SSH (connect before use)."""
    return LocalRemote(node.name) if node.kind == "local" else SshRemote(node)
