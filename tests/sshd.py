"""Real OpenSSH sshd servers on loopback, with throwaway keys, for ssh-node tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.emulated import OverlayRoot, arm64_root
from tests.harness import free_port, listening

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
# Skipped only on a developer machine without sshd; in CI (.ci/run installs it) a missing sshd fails instead.
NEEDS_SSHD = pytest.mark.skipif(not Path(SSHD).exists() and not os.environ.get("CI"),
                                reason="OpenSSH sshd is not installed here (.ci/run installs it)")


def listening_in(namespace: str | None, host: str, port: int) -> bool:
    """Whether something listens on host:port as seen from the network namespace ``namespace`` (None: ours)."""
    if namespace is None:
        return listening(port, host)
    probe = subprocess.run(["ip", "netns", "exec", namespace, "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"],
                           capture_output=True, check=False)
    return probe.returncode == 0


def keygen(path: Path) -> str:
    """A new passphrase-less ed25519 key pair; returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub").read_text().strip()


class Sshd:
    """One sshd on address:port that accepts ``authorized`` keys for the current user."""

    def __init__(self, root: Path, authorized: Path, without: tuple[str, ...] = (), address: str = "127.0.0.1",
                 namespace: str | None = None, chroot: OverlayRoot | None = None,
                 env: dict[str, str] | None = None, sftp: bool = True) -> None:
        """``without``: commands missing from the PATH that sessions on this "node" get; ``namespace``: the
        network namespace sshd (and so every process a session starts) runs in (a benchmark's shaped link);
        ``chroot``: the root file system sessions land in (another arch's, see tests.emulated), mounted in a mount
        namespace of this sshd's own; ``env``: variables every session gets (QEMU_CPU); ``sftp``: False leaves the
        SFTP subsystem out, as Dropbear and minimal sshds do."""
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.address = address
        self.port = free_port()
        self.host_key = root / "host_ed25519"
        self.host_public = keygen(self.host_key)
        config = root / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", f"ListenAddress {address}", f"HostKey {self.host_key}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {authorized}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "MaxSessions 64",
            "MaxStartups 64", *(["Subsystem sftp internal-sftp"] if sftp else []), "LogLevel ERROR",
            *([f"ChrootDirectory {chroot.merged}"] if chroot else []),
            *self._set_env({**({"PATH": str(self._path_without(root / "bin", without))} if without else {}),
                            **(env or {})}), "",
        ]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation folder
        self.log = (root / "sshd.log").open("a")
        inside = ["ip", "netns", "exec", namespace] if namespace else []  # `ip` execs sshd: same pid
        if chroot:  # unshare and sh exec too: still sshd's pid; its mounts end with its namespace
            inside += ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       f'{chroot.mount_script()} && exec "$0" "$@"']
        self.command = [*inside, SSHD, "-D", "-e", "-f", str(config)]
        self.overlay = chroot
        self.namespace = namespace
        self.start()

    def start(self) -> None:
        """Listen (again): the same port, host key and settings."""
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not listening_in(self.namespace, self.address, self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start: {(self.root / 'sshd.log').read_text()}")
            time.sleep(0.05)

    def connections(self) -> list[int]:
        """The sshd processes that serve this server's open connections, oldest first."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return sorted(map(int, children), key=lambda pid: int(Path(f"/proc/{pid}/stat").read_text()
                                                              .rsplit(")", 1)[1].split()[19]))

    def drop_connections(self) -> None:
        """Cut every open connection, as a network blip would (the processes they started live on)."""
        for pid in self.connections():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @staticmethod
    def _set_env(variables: dict[str, str]) -> list[str]:
        """One SetEnv line (sshd takes the first of several)."""
        return [f"SetEnv {' '.join(f'{name}={value}' for name, value in variables.items())}"] if variables else []

    @staticmethod
    def _path_without(folder: Path, without: tuple[str, ...]) -> Path:
        folder.mkdir()
        for directory in ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            for tool in Path(directory).iterdir() if Path(directory).is_dir() else ():
                if tool.name not in without and not (folder / tool.name).exists():
                    (folder / tool.name).symlink_to(tool)
        return folder

    def known_hosts_line(self) -> str:
        return f"[{self.address}]:{self.port} {' '.join(self.host_public.split()[:2])}"

    def stop_listening(self) -> None:
        """No new connections: the node is unreachable until `start` (open connections stay)."""
        self.process.terminate()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.log.close()
        if self.overlay is not None:
            self.overlay.remove()


class SshWorld:
    """A client HOME with a key and known_hosts, and several sshd 'nodes' that trust that key."""

    def __init__(self, root: Path, nodes: int, address: str = "127.0.0.1", namespace: str | None = None) -> None:
        """``address`` and ``namespace``: where the nodes' sshd listen and run (see `Sshd`)."""
        self.root = root
        self.home = root / "home"
        ssh = self.home / ".ssh"
        ssh.mkdir(parents=True, mode=0o700)
        self.identity = ssh / "id_ed25519"
        authorized = root / "authorized_keys"
        authorized.write_text(keygen(self.identity) + "\n")
        self.authorized = authorized
        self.servers = [Sshd(root / f"sshd{index}", authorized, address=address, namespace=namespace)
                        for index in range(nodes)]
        self.extra: list[Sshd] = []
        (ssh / "known_hosts").write_text("".join(s.known_hosts_line() + "\n" for s in self.servers))

    def extra_server(self, root: Path, without: tuple[str, ...] = (), trusted: bool = False,
                     sftp: bool = True) -> Sshd:
        """Another node that accepts our key; its host key is in known_hosts only when ``trusted``; ``sftp``:
        whether its sshd has the SFTP subsystem."""
        server = Sshd(root, self.authorized, without, sftp=sftp)
        self.extra.append(server)
        if trusted:
            with (self.home / ".ssh" / "known_hosts").open("a") as handle:
                handle.write(server.known_hosts_line() + "\n")
        return server

    def emulated_server(self, root: Path, qemu_cpu: str) -> Sshd:
        """An arm64 node (trusted): a session lands in its own overlay of the cached arm64 root, as root, on the
        CPU ``qemu_cpu`` (qemu-user's name: ``cortex-a72`` is a Raspberry Pi 4, ``cortex-a76`` a Pi 5)."""
        overlay = OverlayRoot(arm64_root(), root / "overlay")
        server = Sshd(root, self.authorized, chroot=overlay, env={"QEMU_CPU": qemu_cpu})
        self.extra.append(server)
        with (self.home / ".ssh" / "known_hosts").open("a") as handle:
            handle.write(server.known_hosts_line() + "\n")
        return server

    def env(self, **extra: str) -> dict[str, str]:
        """The CLI's environment: this HOME, but the real build cache (no rebuilds per test)."""
        from core.nodes.build import cache_dir

        return {**os.environ, "HOME": str(self.home), "GGML_CLUSTER_CACHE_DIR": str(cache_dir()), **extra}

    def stop(self) -> None:
        for server in [*self.servers, *self.extra]:
            server.stop()


def running_world(prefix: str, nodes: int) -> Iterator[SshWorld]:
    """A world of ``nodes`` sshd on loopback for as long as the generator runs (a fixture's body)."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    world = SshWorld(root, nodes=nodes)
    try:
        yield world
    finally:
        world.stop()
        shutil.rmtree(root, ignore_errors=True)
