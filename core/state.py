"""A cluster's state directory: where its controller keeps pid, socket, event log, plan and logs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ClusterError, InventoryError
from core.inventory import Inventory, parse_inventory
from core.version import Version

STATE_ENV = "GGML_CLUSTER_STATE_DIR"
# sun_path holds 108 bytes on Linux (104 on macOS), terminator included.
MAX_SOCKET_PATH = 103
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def fingerprint(inventory_text: str, launch_text: str, api_key: str | None) -> str:
    """Identity of a cluster's configuration; equal fingerprints mean `up` has nothing to change.

    The API key is part of it (`up` with a new key must restart the API) but is written to no file: the controller
    adds the key it read, `up` the key it reads now, and the digest travels only over the control socket."""
    digest = hashlib.sha256()
    digest.update(inventory_text.encode())
    digest.update(launch_text.encode())
    if api_key is not None:
        digest.update(b"\0api-key\0" + api_key.encode())
    return digest.hexdigest()[:16]


def state_path(cluster: str) -> Path:
    """$GGML_CLUSTER_STATE_DIR, else $XDG_STATE_HOME/ggml-cluster/<cluster>, else ~/.local/state/…"""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ggml-cluster" / cluster


@dataclass(frozen=True)
class StateDir:
    """Named paths inside one cluster's state directory."""

    root: Path

    def create(self) -> StateDir:
        """Make the directory and any missing parents, private to this user (mode 0700).

        A folder that already exists keeps its mode: $GGML_CLUSTER_STATE_DIR may name one the user shares
        (the control socket is 0600 and the controller checks every peer's uid either way).
        """
        missing = []
        folder = self.root
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:
                continue  # made at this moment by another process: its mode is that process's business
            except OSError as exc:
                raise ClusterError(f"cannot create the state dir {self.root}: {exc.strerror or exc}",
                                   f"fix: set ${STATE_ENV} to a folder you can write") from None
            folder.chmod(0o700)  # exact, whatever the umask took away
        if len(str(self.socket)) > MAX_SOCKET_PATH:
            raise InventoryError(f"state dir {self.root} is too long for a Unix socket path",
                                 f"fix: set ${STATE_ENV} to a shorter folder")
        return self

    @property
    def pid(self) -> Path:
        """The controller's pid."""
        return self.root / "controller.pid"

    @property
    def socket(self) -> Path:
        """The controller's control socket (mode 0600)."""
        return self.root / "control.sock"

    @property
    def events(self) -> Path:
        """Every event, one JSON object per line."""
        return self.root / "events.jsonl"

    @property
    def plan(self) -> Path:
        """The current layer plan."""
        return self.root / "plan.json"

    @property
    def inventory(self) -> Path:
        """The inventory the controller runs, as YAML-compatible JSON."""
        return self.root / "inventory.json"

    @property
    def launch(self) -> Path:
        """Binary, model and protocol the controller was started with."""
        return self.root / "launch.json"

    @property
    def controller_log(self) -> Path:
        """The controller's own log."""
        return self.root / "controller.log"

    @property
    def coordinator_log(self) -> Path:
        """llama.cpp's output from the coordinator."""
        return self.root / "coordinator.log"

    @property
    def profile_log(self) -> Path:
        """llama.cpp's output from the runs that measure the nodes."""
        return self.root / "profile.log"

    @property
    def worker_cache(self) -> Path:
        """LLAMA_CACHE for local workers (their -c tensor cache)."""
        return self.root / "tensor-cache"

    def node_dir(self, name: str) -> Path:
        """Work dir of a local node's worker."""
        return self.root / "nodes" / name

    def fingerprint(self, api_key: str | None) -> str:
        """Identity of what the controller runs: inventory and launch files together, and its API key."""
        inventory, launch = (path.read_text() if path.is_file() else "" for path in (self.inventory, self.launch))
        return fingerprint(inventory, launch, api_key)

    @property
    def controller_marker(self) -> str:
        """What the controller's command line holds (`python -m core.controller <this dir>`)."""
        return f" -m core.controller {self.root} "

    def write_pid(self) -> None:
        """Record this process as the controller: its pid and start time, written whole or not at all."""
        partial = self.pid.with_name(f".{self.pid.name}.{os.getpid()}")
        partial.write_text(PidRecord.of(os.getpid()).text())
        partial.replace(self.pid)

    def controller_pid(self) -> int | None:
        """The pid in the pid file if it still names this cluster's controller, else None (a stale file)."""
        record = PidRecord.read(self.pid)
        return record.pid if record is not None and record.running(self.controller_marker) else None

    def signal_controller(self, signum: int) -> bool:
        """Send ``signum`` to the controller if the pid file still names it; whether it was sent."""
        record = PidRecord.read(self.pid)
        return record is not None and record.signal(signum, self.controller_marker)


@dataclass(frozen=True)
class PidRecord:
    """A pid file's line, ``PID START``: a pid alone is not an identity, as a pid is reused (after a reboot,
    by anybody's process). The same format and checks on the nodes: pids.sh."""

    pid: int
    start: str | None  # None: a file of the previous version, which recorded the pid alone

    @classmethod
    def of(cls, pid: int) -> PidRecord:
        """The record of a running process."""
        return cls(pid, process_start(pid))

    @classmethod
    def read(cls, path: Path) -> PidRecord | None:
        """The record in a pid file; None when there is none or it is garbage."""
        try:
            fields = path.read_text().split()
        except OSError:
            return None
        if not fields or not fields[0].isdigit():
            return None
        return cls(int(fields[0]), fields[1] if len(fields) > 1 else None)

    def text(self) -> str:
        """The pid file's content."""
        return f"{self.pid} {self.start or ''}\n"

    def running(self, marker: str) -> bool:
        """Whether the pid still names this process: alive, started when recorded (when recorded), and its
        command line, spaces around it, holds ``marker``."""
        if not process_alive(self.pid):
            return False
        if self.start is not None and process_start(self.pid) != self.start:
            return False
        command = process_command(self.pid)
        return command is not None and marker in f" {command} "

    def signal(self, signum: int, marker: str) -> bool:
        """Send ``signum`` if the pid still names this process; whether it was sent."""
        if not self.running(marker):
            return False
        try:
            os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def process_start(pid: int) -> str | None:
    """When ``pid`` started, as one word (pids.sh's `started`): on Linux the boot id and the start time in
    clock ticks since boot, elsewhere ps's lstart; None when it is not running."""
    if BOOT_ID.exists():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return f"{BOOT_ID.read_text().strip()}:{fields[19]}"
        except (OSError, IndexError):
            return None
    text = _ps(pid, "lstart=").replace(" ", "")
    return text or None


def process_command(pid: int) -> str | None:
    """``pid``'s command line, arguments joined by spaces; None when it is not running."""
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    if Path("/proc/self/cmdline").exists():
        return None
    return _ps(pid, "args=") or None


def _ps(pid: int, column: str) -> str:
    """One column of ps for ``pid`` (macOS and the BSDs have no /proc); empty when it is not running."""
    result = subprocess.run(["ps", "-ww", "-o", column, "-p", str(pid)], capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else ""


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True  # no procfs (macOS): kill(0) is all we have


@dataclass(frozen=True)
class Launch:
    """What `up` hands the controller besides the inventory."""

    binary: str
    protocol: Version
    model: str

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for launch.json."""
        return {"binary": self.binary, "model": self.model,
                "protocol": [self.protocol.major, self.protocol.minor, self.protocol.patch]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Launch:
        """Parse launch.json."""
        return cls(binary=data["binary"], model=data["model"], protocol=Version(*data["protocol"]))


def read_launch(state: StateDir) -> tuple[Inventory, Launch]:
    """The inventory and launch settings `up` wrote into the state dir."""
    data = json.loads(state.launch.read_text())
    # Read as from its own file: relative paths in it (chat_template, checked as it is read) resolve from there.
    return parse_inventory(state.inventory.read_text(), data["source"]), Launch.from_dict(data)
