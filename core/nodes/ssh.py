"""A node reached over SSH (asyncssh): commands, uploads, a forward for HELLO probes and channels for RPC, on
one connection; host keys checked against known_hosts (and recorded, once, on first use when asked)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shlex
from collections.abc import AsyncGenerator
from pathlib import Path

import asyncssh

from core.errors import ConnectError, DeployError
from core.inventory import Node
from core.nodes.shell import ChannelSink, CommandResult, free_bytes, shell_command, tied_to_reader

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
        """Copy a file to the node, then rename it into place (never half-written): over SFTP, or where the node's
        sshd has no SFTP subsystem (Dropbear and minimal sshds), through `cat` on a plain session."""
        partial = f"{destination}.partial"
        folder = str(Path(destination).parent)
        try:
            try:
                sftp = await self._connection().start_sftp_client()
            except asyncssh.Error:  # refused ("Session request failed"), or its server is missing and exits at once
                problem = await self._upload_over_session(source, destination, partial, mode)
            else:
                problem = ""
                async with sftp:
                    await sftp.makedirs(folder, exist_ok=True)
                    await sftp.put(str(source), partial)
                    await sftp.chmod(partial, mode)
                    await sftp.posix_rename(partial, destination)
        except (asyncssh.Error, OSError) as exc:
            problem = str(exc)
        if not problem:
            return
        # SFTP reports a full disk as a bare "Failure", cat as a write error: ask the node, and do not leave the
        # part behind.
        with contextlib.suppress(ConnectError):
            await self.run(f"rm -f {shell_command([partial])}")
        free = await free_bytes(self, folder)
        if free is not None and free < source.stat().st_size:
            raise DeployError(f"node {self.name}: the disk is full: {source.name} needs "
                              f"{source.stat().st_size >> 20} MiB, {folder} has {free >> 20} MiB free",
                              "fix: free space on the node, or set its workdir to a larger disk")
        raise ConnectError(f"node {self.name}: upload of {source.name} failed: {problem}")

    async def _upload_over_session(self, source: Path, destination: str, partial: str, mode: int) -> str:
        """`upload` without SFTP: the file on the stdin of `cat > partial`, its size checked before it is renamed
        into place (a connection lost midway ends cat as the file's end would). What went wrong, or ""."""
        size = source.stat().st_size
        command = (f"mkdir -p {shell_command([str(Path(destination).parent)])} && cat > {shell_command([partial])} "
                   f"&& got=$(wc -c < {shell_command([partial])}) && {{ [ $got -eq {size} ] || "
                   f"{{ echo \"received $got of {size} bytes\" >&2; false; }}; }} && "
                   f"chmod {mode:o} {shell_command([partial])} && mv -f {shell_command([partial, destination])}")
        result = await self._connection().run(command, stdin=source, encoding=None, check=False)
        if result.exit_status == 0:
            return ""
        raw = result.stderr or b""  # bytes: the session runs without an encoding, so the file goes as it is
        stderr = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).strip()
        if stderr:
            return stderr.splitlines()[-1]
        return "the session ended early" if result.exit_status is None else f"exit status {result.exit_status}"

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


