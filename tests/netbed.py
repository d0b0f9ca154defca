"""A multi-host test bed on one machine: every node in a network namespace of its own, with its own sshd and its own
veth link to the head's namespace, where the controller and the coordinator run.

Links are shaped per profile: rate with tbf on both ends of each link (this kernel has tbf, not netem), delay with a
userspace proxy in the head's namespace that holds every chunk of the SSH connection (which carries the RPC
traffic) for the profile's one-way delay in each direction. Everything a bed creates (namespaces, links, sshd,
proxies, and any process left in its namespaces) is removed when it closes, also when setting it up failed half
way; a bed also removes what an earlier, killed test process left behind (namespaces named after a dead pid).
Needs root (ip netns, tc); CI runs as root.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.harness import needs
from tests.sshd import Sshd, keygen, listening_in


@dataclass(frozen=True)
class Profile:
    """A link: its rate (tbf, both ways; None: unshaped), the tbf bucket, and the one-way delay."""

    rate: str | None
    burst: str
    delay_ms: float


# The profiles: a gigabit LAN and a Wi-Fi link. A bucket must hold at least one timer tick's worth of bytes
# at the rate (tbf under-delivers otherwise) and little more (a large one lets a burst through at line speed).
PROFILES = {
    "unshaped": Profile(None, "", 0.0),
    "lan": Profile("1gbit", "1mb", 0.25),
    "wifi": Profile("100mbit", "64kb", 3.0),
    # A node much further away than the others (another site over a VPN): what the planner must plan around.
    "far": Profile("100mbit", "64kb", 10.0),
}
PREFIX = "gcb"  # namespaces: gcb<pid>-<bed>h (the head) and gcb<pid>-<bed>n<index>
PROXY_PORT = 2222
_beds = itertools.count()


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip() or result.returncode}")


def namespaces() -> list[str]:
    """The network namespaces there are."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    """Kill every process left in a namespace (a worker a failed test did not stop)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)


def sweep() -> list[str]:
    """Remove the namespaces of beds whose test process is gone; returns their names."""
    stale = []
    for namespace in namespaces():
        found = re.fullmatch(rf"{PREFIX}(\d+)-\d+[hn]\d*", namespace)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            _delete(namespace)
            stale.append(namespace)
    return stale


def available() -> str | None:
    """Why a bed cannot be made here (not root, no ip or tc), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, check=False).returncode:
            return f"{tool} (iproute2) is not installed"
    return None


def needs_bed() -> None:
    """Skip on a developer machine that cannot make a bed; fail in CI, which must."""
    needs(available())


class NetBed:
    """``nodes`` hosts on links of ``profile`` to a head (``links``: another profile for some, by index); `prefix`
    runs a command in the head's namespace."""

    def __init__(self, root: Path, nodes: int, profile: str = "unshaped", links: dict[int, str] | None = None) -> None:
        self.root = root
        self.links = [PROFILES[(links or {}).get(index, profile)] for index in range(nodes)]
        tag = f"{PREFIX}{os.getpid()}-{next(_beds)}"
        self.head = f"{tag}h"
        self.spaces = [f"{tag}n{index}" for index in range(nodes)]
        self.servers: list[Sshd] = []
        self.proxies: list[subprocess.Popen[bytes]] = []
        self.home = root / "home"
        self.identity = self.home / ".ssh" / "id_ed25519"
        try:
            sweep()
            self._build(nodes)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def head_address(index: int) -> str:
        return f"10.99.{index}.1"

    @staticmethod
    def node_address(index: int) -> str:
        return f"10.99.{index}.2"

    @property
    def prefix(self) -> list[str]:
        """Run a command in the head's namespace (the controller, and so the coordinator, live there)."""
        return ["ip", "netns", "exec", self.head]

    def _build(self, nodes: int) -> None:
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        authorized = self.root / "authorized_keys"
        authorized.write_text(keygen(self.identity) + "\n")
        _run("ip", "netns", "add", self.head)
        _run("ip", "-n", self.head, "link", "set", "lo", "up")
        known = []
        for index, space in enumerate(self.spaces):
            _run("ip", "netns", "add", space)
            link = f"n{index}"
            _run("ip", "link", "add", link, "netns", self.head, "type", "veth", "peer", "name", "eth0", "netns", space)
            for where, device, address in ((self.head, link, self.head_address(index)),
                                           (space, "eth0", self.node_address(index))):
                _run("ip", "-n", where, "addr", "add", f"{address}/24", "dev", device)
                _run("ip", "-n", where, "link", "set", device, "up")
                if self.links[index].rate:
                    _run("tc", "-n", where, "qdisc", "add", "dev", device, "root", "tbf", "rate",
                         self.links[index].rate, "burst", self.links[index].burst, "latency", "50ms")
            _run("ip", "-n", space, "link", "set", "lo", "up")
            server = Sshd(self.root / f"sshd{index}", authorized, address=self.node_address(index), namespace=space)
            self.servers.append(server)
            host, port = self.node_address(index), server.port
            if self.links[index].delay_ms:
                host, port = self.head_address(index), PROXY_PORT
                self._proxy(host, port, server, self.links[index].delay_ms)
            known.append(f"[{host}]:{port} {' '.join(server.host_public.split()[:2])}\n")
        (self.home / ".ssh" / "known_hosts").write_text("".join(known))

    def _proxy(self, host: str, port: int, server: Sshd, delay_ms: float) -> None:
        """The link's delay: a proxy in the head's namespace in front of the node's sshd."""
        self.proxies.append(subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "tests.delay", host, str(port), server.address, str(server.port),
             str(delay_ms)], cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while not listening_in(self.head, host, port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the delay proxy for {server.address} did not start")
            time.sleep(0.1)

    def node_lines(self, index: int) -> list[str]:
        """Node ``index``'s inventory fields: reached over SSH across its link (through its delay, if any)."""
        delayed = bool(self.links[index].delay_ms)
        host = self.head_address(index) if delayed else self.node_address(index)
        port = PROXY_PORT if delayed else self.servers[index].port
        return [f"host: {host}", f"port: {port}", "user: root", f"identity: {self.identity}"]

    def env(self) -> dict[str, str]:
        """The CLI's environment: the bed's HOME (its key, its known_hosts), the machine's build cache."""
        from core.nodes.build import cache_dir

        return {**os.environ, "HOME": str(self.home), "GGML_CLUSTER_CACHE_DIR": str(cache_dir())}

    def leftovers(self) -> list[str]:
        """This bed's namespaces that still exist."""
        return [space for space in namespaces() if space in (self.head, *self.spaces)]

    def close(self) -> None:
        """Remove all of it."""
        for proxy in self.proxies:
            proxy.kill()
            proxy.wait()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()
        for space in (self.head, *self.spaces):
            _delete(space)


@contextlib.contextmanager
def netbed(root: Path, nodes: int, profile: str = "unshaped", links: dict[int, str] | None = None
           ) -> Iterator[NetBed]:
    """A bed for the duration of a ``with``."""
    needs_bed()
    bed = NetBed(root, nodes, profile, links)
    try:
        yield bed
    finally:
        bed.close()
