"""How the controller reaches a node: run a shell command, follow a command's output, upload a file,
and get a local endpoint for the node's loopback RPC port.

`LocalRemote` is a node on this machine. Every command is a string for the node's POSIX shell; callers
build it with `quote`/`shell_command`, so nothing from the inventory is ever interpreted by a shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import asyncssh

from core.errors import ConnectError, DeployError
from core.inventory import Node


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


KNOWN_HOSTS = Path("~/.ssh/known_hosts")


class SshRemote:
    """A node reached over SSH (asyncssh): one connection carries commands, uploads and RPC forwards."""

    def __init__(self, node: Node, connect_timeout: float = 15.0) -> None:
        self.name = node.name
        self.node = node
        self.connect_timeout = connect_timeout
        self._conn: asyncssh.SSHClientConnection | None = None
        self._listeners: dict[int, asyncssh.SSHListener] = {}
        self._agent: asyncssh.SSHAgentClient | None = None
        self._home = ""
        self._reconnecting = asyncio.Lock()  # bound to the loop that first uses it (the relays', for RPC)

    @property
    def where(self) -> str:
        """``user@host:port`` as given in the inventory, for messages."""
        user = f"{self.node.user}@" if self.node.user else ""
        port = f":{self.node.port}" if self.node.port else ""
        return f"{user}{self.node.host}{port}"

    def _options(self) -> dict[str, object]:
        # AES-GCM first: `cryptography` seals a packet in one call (chacha20-poly1305 takes two in asyncssh),
        # and every RPC message to an SSH node is one or more packets on the token's critical path.
        options: dict[str, object] = {"connect_timeout": self.connect_timeout, "keepalive_interval": 15,
                                      "keepalive_count_max": 3,
                                      "encryption_algs": ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com",
                                                          "chacha20-poly1305@openssh.com", "aes128-ctr"]}
        if self.node.port:
            options["port"] = self.node.port
        if self.node.user:
            options["username"] = self.node.user
        return options

    async def _client_keys(self) -> list[object]:
        """The identity's key; an encrypted one is taken from ssh-agent, as ssh does (never a passphrase)."""
        identity = os.path.expanduser(self.node.identity or "")
        try:
            asyncssh.read_private_key(identity)
            return [identity]  # by path: asyncssh also picks up a certificate beside it
        except asyncssh.KeyImportError as exc:
            problem = str(exc)
        try:
            wanted = [asyncssh.read_public_key(f"{identity}.pub").public_data]
        except (OSError, asyncssh.KeyImportError):
            wanted = None  # no public half beside it: offer what the agent holds, and let the server pick
        keys: list[object] = []
        with contextlib.suppress(OSError, asyncssh.Error, ValueError):
            self._agent = await asyncssh.connect_agent()
            keys = list(await self._agent.get_keys(wanted))
        if not keys:
            raise ConnectError(f"node {self.name}: cannot use identity {self.node.identity}: {problem}",
                               f"fix: load it into ssh-agent (ssh-add {self.node.identity}) or point 'identity' "
                               "at an unencrypted key")
        return keys

    async def connect(self) -> None:
        """Open the connection (again: a previous one and its forwards are closed first); every failure becomes
        one ConnectError that says what to fix."""
        await self.close()
        name = self.name
        if self.node.identity and not Path(self.node.identity).expanduser().is_file():
            raise ConnectError(f"node {name}: identity file {self.node.identity} does not exist",
                               "fix: correct 'identity', or remove it to use ssh-agent and ~/.ssh/id_*")
        options = self._options()
        try:
            if self.node.identity:
                options["client_keys"] = await self._client_keys()
            if self.node.host_key == "accept-new":
                await self._accept_new_host_key()
            self._conn = await asyncssh.connect(self.node.host, **options)
        except asyncssh.HostKeyNotVerifiable as exc:
            port = self.node.port or 22
            if _known_host(KNOWN_HOSTS.expanduser(), self.node.host, port):
                raise ConnectError(
                    f"node {name}: the host key of {self.where} has changed since it was recorded in "
                    f"{KNOWN_HOSTS}: this may be an attack (someone between you and the node), or the node "
                    "was reinstalled", "fix: if you know why it changed, remove the old key with ssh-keygen -R "
                    f"{shlex.quote(_known_hosts_name(self.node.host, port))} and connect again") from None
            raise ConnectError(f"node {name}: the host key of {self.where} is not trusted ({exc.reason})",
                               "fix: connect once with ssh and check its fingerprint, or set host_key: accept-new"
                               ) from None
        except asyncssh.PermissionDenied:
            raise ConnectError(f"node {name}: authentication failed for {self.where}",
                               "fix: check 'user' and 'identity', or add the key to ssh-agent") from None
        except asyncssh.KeyImportError as exc:
            raise ConnectError(f"node {name}: cannot use identity {self.node.identity}: {exc}",
                               "fix: point 'identity' at an unencrypted key or load it into ssh-agent") from None
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
            raise ConnectError(f"node {name}: cannot reach {self.where}: {reason}",
                               "fix: check host and port, and that sshd runs there") from None
        finally:
            # Its keys only sign during authentication, which is over.
            if self._agent is not None:
                self._agent.close()
                self._agent = None
        # sshd leaves Nagle on for a connection until a session channel has run on it; RPC through a
        # forward would then cost ~6 ms a round trip instead of ~0.3 ms. This session also finds $HOME.
        self._home = (await self.run('printf %s "$HOME"')).stdout.strip()

    async def _accept_new_host_key(self) -> None:
        """Trust on first use: record an unknown host's key; a known host with another key still fails."""
        path = KNOWN_HOSTS.expanduser()
        port = self.node.port or 22
        if _known_host(path, self.node.host, port):
            return
        key = await asyncio.wait_for(asyncssh.get_server_host_key(self.node.host, port), self.connect_timeout)
        if key is None:
            return
        line = f"{_known_hosts_name(self.node.host, port)} {key.export_public_key().decode().strip()}\n"
        await asyncio.to_thread(_record_host_key, path, self.node.host, port, line)

    def _connection(self) -> asyncssh.SSHClientConnection:
        if self._conn is None:
            raise ConnectError(f"node {self.name}: not connected")
        return self._conn

    def home(self) -> str:
        """The login user's $HOME on the node."""
        return self._home

    async def run(self, command: str, timeout: float = 30.0, stdin: str | None = None) -> CommandResult:
        """Run a shell command on the node to completion, with ``stdin`` as its input."""
        try:
            result = await asyncio.wait_for(self._connection().run(command, check=False, input=stdin), timeout)
        except TimeoutError:
            raise ConnectError(f"node {self.name}: command timed out after {timeout:g}s") from None
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"node {self.name}: connection lost: {exc}") from None
        code = result.exit_status if result.exit_status is not None else 255
        return CommandResult(code, str(result.stdout or ""), str(result.stderr or ""))

    async def follow(self, command: str) -> AsyncGenerator[str, None]:
        """Run a long-lived command on the node and yield its lines; it ends when we stop reading."""
        try:
            process = await self._connection().create_process(tied_to_reader(command))
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"node {self.name}: connection lost: {exc}") from None
        try:
            async for line in process.stdout:
                yield str(line).rstrip("\n")
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"node {self.name}: connection lost: {exc}") from None
        finally:
            with contextlib.suppress(asyncssh.Error, OSError):
                process.stdin.write_eof()
            process.close()

    async def upload(self, source: Path, destination: str, mode: int = 0o644) -> None:
        """Copy a file to the node over SFTP, then rename it into place (never half-written)."""
        partial = f"{destination}.partial"
        folder = str(Path(destination).parent)
        try:
            async with self._connection().start_sftp_client() as sftp:
                await sftp.makedirs(folder, exist_ok=True)
                await sftp.put(str(source), partial)
                await sftp.chmod(partial, mode)
                await sftp.posix_rename(partial, destination)
        except (asyncssh.Error, OSError) as exc:
            # SFTP reports a full disk as a bare "Failure": ask the node, and do not leave the part behind.
            with contextlib.suppress(ConnectError):
                await self.run(f"rm -f {shell_command([partial])}")
            free = await free_bytes(self, folder)
            if free is not None and free < source.stat().st_size:
                raise DeployError(f"node {self.name}: the disk is full: {source.name} needs "
                                  f"{source.stat().st_size >> 20} MiB, {folder} has {free >> 20} MiB free",
                                  "fix: free space on the node, or set its workdir to a larger disk") from None
            raise ConnectError(f"node {self.name}: upload of {source.name} failed: {exc}") from None

    async def port_open(self, port: int, host: str = "127.0.0.1") -> bool:
        """Whether something listens on the node's host:port (asked from the node's side)."""
        try:
            _, writer = await asyncio.wait_for(self._connection().open_connection(host, port), 10.0)
        except (asyncssh.ChannelOpenError, TimeoutError):
            return False
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"node {self.name}: connection lost: {exc}") from None
        writer.close()
        return True

    async def endpoint(self, port: int) -> tuple[str, int]:
        """A local port forwarded through this connection to the node's 127.0.0.1:port."""
        listener = self._listeners.get(port)
        if listener is None:
            try:
                listener = await self._connection().forward_local_port("127.0.0.1", 0, "127.0.0.1", port)
            except (asyncssh.Error, OSError) as exc:
                raise ConnectError(f"node {self.name}: cannot forward port {port}: {exc}") from None
            self._listeners[port] = listener
        return ("127.0.0.1", listener.get_port())

    async def open_channel(self, port: int, sink: ChannelSink) -> None:
        """Open a channel to the node's 127.0.0.1:port on this connection, its bytes going to ``sink`` (a relay
        link's worker side).

        The coordinator's bytes then cross one Python hop (the relay writing into the channel) instead of
        two (the relay, then asyncssh's local port forward) and no extra loopback TCP connection. The
        connection is (re)opened first when it is not up: the relays keep one of their own per node, and a
        coordinator that reconnects after a network fault gets a fresh one.
        """
        async with self._reconnecting:
            if self._conn is None or self._conn.is_closed():
                await self.connect()
        try:
            channel, _ = await self._connection().create_connection(lambda: _ChannelSide(sink), "127.0.0.1", port)
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"node {self.name}: cannot open a channel to port {port}: {exc}") from None
        sink.worker_connected(channel)

    async def close(self) -> None:
        """Close the forwards and the connection."""
        for listener in self._listeners.values():
            listener.close()
        self._listeners.clear()
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(asyncssh.Error, OSError):
                await self._conn.wait_closed()
            self._conn = None


class _ChannelSide(asyncssh.SSHTCPSession[bytes]):
    """An SSH channel's events, passed to its sink."""

    def __init__(self, sink: ChannelSink) -> None:
        self.sink = sink

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        """Bytes from the node."""
        self.sink.from_worker(data)

    def eof_received(self) -> bool:
        """The node closed its side."""
        self.sink.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """The channel is gone."""
        self.sink.close()

    def pause_writing(self) -> None:
        """The channel's window is full."""
        self.sink.pause_client(True)

    def resume_writing(self) -> None:
        """Room again."""
        self.sink.pause_client(False)


def _known_hosts_name(host: str, port: int) -> str:
    """How known_hosts (and ssh-keygen -R) names a host and port."""
    return host if port == 22 else f"[{host}]:{port}"


def _known_host(path: Path, host: str, port: int) -> bool:
    """Whether known_hosts holds any key, CA or revocation for host:port."""
    if not path.is_file():
        return False
    trusted, ca_keys, revoked, *_ = asyncssh.read_known_hosts(str(path)).match(host, "", port)
    return bool(trusted or ca_keys or revoked)


def _record_host_key(path: Path, host: str, port: int, line: str) -> None:
    """Append a host's known_hosts line unless the host is known by now.

    Nodes on one host connect at once, in this process and in another (`check` beside `up`): the check and
    the append are one step under a lock on a file beside known_hosts (flock: each open excludes the others).
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(os.open(path.with_name(f"{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o600)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _known_host(path, host, port):
            with path.open("a") as handle:
                handle.write(line)


def remote_for(node: Node) -> Remote:
    """The way to reach ``node``: this machine for ``kind: local``, else SSH (connect before use)."""
    return LocalRemote(node.name) if node.kind == "local" else SshRemote(node)
