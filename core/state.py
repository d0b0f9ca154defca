"""A cluster's state directory: where its controller keeps pid, socket, event log, plan and logs."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from core.errors import ClusterError, InventoryError

STATE_ENV = "GGML_CLUSTER_STATE_DIR"
# sun_path holds 108 bytes on Linux (104 on macOS), terminator included.
MAX_SOCKET_PATH = 103


def fingerprint(inventory_text: str, launch_text: str) -> str:
    """Identity of a cluster's configuration; equal fingerprints mean `up` has nothing to change."""
    digest = hashlib.sha256()
    digest.update(inventory_text.encode())
    digest.update(launch_text.encode())
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

    def fingerprint(self) -> str:
        """Identity of what the controller runs: inventory and launch files together."""
        texts = [path.read_text() if path.is_file() else "" for path in (self.inventory, self.launch)]
        return fingerprint(*texts)

    def controller_pid(self) -> int | None:
        """The pid in the pid file if that process is alive, else None."""
        try:
            pid = int(self.pid.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if process_alive(pid) else None


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
