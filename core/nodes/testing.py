"""Nodes that are not there, for tests of what drives nodes: shipped with the library, as httpx ships its
MockTransport, so that a test of the controller needs no machine, no SSH and no worker.

`FakeRemote` answers commands from a script (the first rule whose fragment the command holds) and keeps a few
files (appended to by the test, read with `wc -c` and followed with `tail -c +N -F` as a real node's would be).
`FakeWorker` scripts a remote as a node whose supervised worker starts, exits, is killed, stops (SIGSTOP) or
crash-loops on cue, writing the supervisor's events as supervise.sh does.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from core.errors import ConnectError
from core.nodes.probe import PROBE_COMMAND
from core.nodes.shell import CommandResult

Reply = str | CommandResult | Callable[[str], CommandResult]
Match = str | re.Pattern[str]  # a fragment the command holds, or a pattern it matches

# What a small Linux x86-64 node without GPUs answers the probe (a shortened real capture).
LINUX_NODE = """==uname==
Linux x86_64
==os-release==
ID=debian
VERSION_ID="12"
PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
==cpuinfo==
processor\t: 0
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu sse sse2 avx avx2 fma
==meminfo==
MemTotal:       16384000 kB
MemAvailable:   15000000 kB
==df==
Filesystem 1024-blocks Used Available Capacity Mounted on
/dev/vda1 100000000 1000000 99000000 1% /
==cmake==
cmake version 3.25.1
==cxx==
c++ (Debian 12.2.0-14) 12.2.0
"""


class FakeRemote:
    """A node's shell, scripted. ``reachable = False`` makes it fail as a lost connection does: commands raise,
    followed commands end, `connect` raises until it is reachable again."""

    def __init__(self, name: str, home: str = "/home/fake") -> None:
        self.name = name
        self.reachable = True
        self.commands: list[str] = []  # every command run, in order
        self.files: dict[str, str] = {}
        self.open_ports: set[int] = set()
        self._home = home
        self._rules: list[tuple[Match, Reply]] = [(PROBE_COMMAND, LINUX_NODE)]
        self._changed = asyncio.Event()

    def on(self, match: Match, reply: Reply) -> None:
        """Answer commands that hold ``match`` (or match it, a pattern) with ``reply``: text on stdout, a result,
        or a function of the command. Later rules are tried first."""
        self._rules.insert(0, (match, reply))

    def append(self, path: str, text: str) -> None:
        """Append to a file of the node (wakes whoever follows it)."""
        self.files[path] = self.files.get(path, "") + text
        self._wake()

    def drop(self) -> None:
        """The connection goes away (a network blip): followers end, commands fail until `reachable` again."""
        self.reachable = False
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self, command: str, timeout: float = 30.0, stdin: str | None = None) -> CommandResult:
        """The first matching rule's answer (empty, exit 0, when none matches)."""
        self._check()
        self.commands.append(command)
        counted = re.match(r"wc -c < (\S+)", command)
        if counted:
            return CommandResult(0, str(len(self.files.get(shlex.split(counted.group(1))[0], "").encode())), "")
        for match, reply in self._rules:
            if match in command if isinstance(match, str) else match.search(command):
                if callable(reply):
                    return reply(command)
                return reply if isinstance(reply, CommandResult) else CommandResult(0, reply, "")
        return CommandResult(0, "", "")

    async def follow(self, command: str) -> AsyncIterator[str]:
        """`tail -c +N -F PATH`: the file's lines from byte N-1 on, then each line appended, until the connection
        drops."""
        self._check()
        self.commands.append(command)
        tail = re.search(r"tail -c \+(\d+) -F (\S+)", command)
        if tail is None:
            return
        path, position = shlex.split(tail.group(2))[0], int(tail.group(1)) - 1
        while self.reachable:
            data = self.files.get(path, "").encode()
            end = data.rfind(b"\n") + 1
            if end > position:
                for line in data[position:end].decode().splitlines():
                    yield line
                position = end
                continue
            await self._changed.wait()

    async def upload(self, source: Path, destination: str, mode: int = 0o644) -> None:
        """Keep the file's text as the node's."""
        self._check()
        self.files[destination] = source.read_text(errors="replace")

    async def endpoint(self, port: int) -> tuple[str, int]:
        """Where this machine would reach the node's port."""
        self._check()
        return ("127.0.0.1", port)

    def home(self) -> str:
        """The node user's home."""
        return self._home

    async def connect(self) -> None:
        """Fails while the node is unreachable."""
        if not self.reachable:
            raise ConnectError(f"node {self.name}: cannot reach it (the test says so)")

    async def port_open(self, port: int, host: str = "127.0.0.1") -> bool:
        """Whether the script says something listens there."""
        self._check()
        return port in self.open_ports

    async def close(self) -> None:
        """Nothing to release."""

    def _check(self) -> None:
        if not self.reachable:
            raise ConnectError(f"node {self.name}: connection lost (the test dropped it)")


class FakeWorker:
    """The supervised worker of one fake node: answers the supervisor's commands (start, adopt, stop, kill,
    stopped?) and writes its events; the test says when it exits, stops or vanishes."""

    def __init__(self, remote: FakeRemote, workdir: str) -> None:
        self.remote = remote
        self.events = f"{workdir}/events.jsonl"
        self.command = ""           # the worker command the supervisor runs (empty: no supervisor)
        self.pid: int | None = None  # the worker process, None between an exit and its restart
        self.stopped = False
        self.kills = 0
        self._pids = iter(range(1000, 1_000_000, 7))
        remote.on("cat > supervise.sh.partial", self._start)
        remote.on("ours supervisor.pid", self._supervisor)
        remote.on('send TERM "$sup"', self._stop)
        remote.on('send KILL "$(ours worker.pid', self._kill)
        remote.on('echo "${wrk%% *}"', lambda command: CommandResult(
            0, f"{self.pid}\n", "") if self.pid is not None else CommandResult(1, "", ""))
        remote.on(re.compile(r"^ps -o stat= -p \d+$"),
                  lambda command: CommandResult(0, "T\n" if self.stopped else "S\n", ""))

    @property
    def answering(self) -> bool:
        """Whether HELLO would be answered now."""
        return self.pid is not None and not self.stopped

    def emit(self, kind: str, **fields: object) -> None:
        """One supervisor event."""
        self.remote.append(self.events, json.dumps({"time": int(time.time()), "kind": kind, **fields}) + "\n")

    def exit(self, code: int, *, restart: bool = True) -> None:
        """The worker exits (a crash); its supervisor restarts it at once unless told not to."""
        self.pid, self.stopped = None, False
        self.emit("exit", code=code, ran_s=1, log_offset=0)
        if restart:
            self.emit("backoff", seconds=1)
            self._run()

    def crash_loop(self, code: int = 134) -> None:
        """The worker keeps exiting until its supervisor gives up (and is gone)."""
        self.exit(code, restart=False)
        self.emit("failed", exits=5, window_s=60)
        self.command = ""

    def vanish(self) -> None:
        """Worker and supervisor are gone without a word (the node's machine was lost)."""
        self.pid, self.command = None, ""

    def _run(self) -> None:
        self.pid = next(self._pids)
        self.emit("started", pid=self.pid, log_offset=0)

    def _start(self, command: str) -> CommandResult:
        self.command = shlex.split(command.split("printf '%s' ", 1)[1])[0]
        self._run()
        return CommandResult(0, "", "")

    def _supervisor(self, command: str) -> CommandResult:
        if not self.command:
            return CommandResult(1, "", "")
        return CommandResult(0, f"4242\n{self.command}", "")

    def _stop(self, command: str) -> CommandResult:
        if self.command:
            self.pid, self.command, self.stopped = None, "", False
            self.emit("stopped", code=143)
        return CommandResult(0, "", "")

    def _kill(self, command: str) -> CommandResult:
        self.kills += 1
        if self.pid is not None:
            self.exit(137)
        return CommandResult(0, "", "")
