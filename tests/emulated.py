"""Nodes of another arch for the tests: an arm64 Debian root from Debian's archive, run under qemu-user (binfmt),
reached through a real OpenSSH sshd whose sessions land in that root.

The root is made once per machine with debootstrap (cached under the build cache) and never written to: each
node mounts it as the lower layer of an overlay, in a mount namespace of its own sshd, so what a test writes
(the worker, its folder) goes with the node, and no mount is ever left on this machine. Inside, `uname -m` and
every binary are aarch64; the CPU features qemu emulates are chosen per node with QEMU_CPU (a Raspberry Pi 4 is
``cortex-a72``), set by sshd for every session, so the worker and everything it starts run on that CPU.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from core.nodes.build import cache_dir

SUITE = "bookworm"
# procps: ps for the node's pid checks; the rest of a minimal Debian is what a board's image has.
PACKAGES = ("procps",)
ROOT_NAME = f"debian-{SUITE}-arm64"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
MOUNTS = Path("/run/ggml-cluster-tests")  # the nodes' mount points (empty folders outside their namespaces)
NEEDS = "qemu-user-static binfmt-support debootstrap (`make test-deps` installs them and enables binfmt)"


def emulation_missing() -> str | None:
    """Why an arm64 node cannot run here, or None when it can."""
    if shutil.which("debootstrap") is None:
        return f"debootstrap is not installed; needs {NEEDS}"
    if not BINFMT.is_file() or not BINFMT.read_text().startswith("enabled"):
        return f"binfmt for aarch64 is not enabled; needs {NEEDS}"
    # F: the interpreter is opened when registered, so it runs inside a root that does not contain it.
    if not re.search(r"^flags:.*F", BINFMT.read_text(), re.M):
        return "binfmt for aarch64 lacks the F flag (qemu-user-static registers it with F)"
    return None


def require_emulation() -> None:
    """Skip on a developer machine without qemu-user; in CI (.ci/run installs it) fail instead."""
    missing = emulation_missing()
    if missing is None:
        return
    if os.environ.get("CI"):
        raise RuntimeError(missing)
    pytest.skip(missing)


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (deb822 ``URIs:`` or a sources.list ``deb`` line)."""
    sources = [*sorted(Path("/etc/apt/sources.list.d").glob("*.sources")), Path("/etc/apt/sources.list")]
    for path in sources:
        text = path.read_text() if path.is_file() else ""
        for uri in re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+" + SUITE +
                                                                          r"\s", text, re.M):
            if "security" not in uri:
                return uri
    raise RuntimeError("no Debian archive in /etc/apt/sources.list(.d): debootstrap needs one")


def arm64_root() -> Path:
    """The cached arm64 Debian root (about 230 MB; 4-6 minutes the first time on 2 cores)."""
    require_emulation()
    roots = cache_dir() / "roots"
    root = roots / ROOT_NAME
    if (root / "etc" / "debian_version").is_file():
        return root
    roots.mkdir(parents=True, exist_ok=True)
    with (roots / f"{ROOT_NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test run waits for the first one's root
        if not (root / "etc" / "debian_version").is_file():
            scratch = Path(tempfile.mkdtemp(prefix=f".{ROOT_NAME}-", dir=roots))
            try:
                subprocess.run(["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                                SUITE, str(scratch), debian_mirror()], check=True, capture_output=True, timeout=1800)
                scratch.chmod(0o755)
                scratch.replace(root)
            except subprocess.CalledProcessError as exc:
                shutil.rmtree(scratch, ignore_errors=True)
                raise RuntimeError(f"debootstrap failed: {exc.stderr.decode(errors='replace')[-2000:]}") from None
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
    return root


class OverlayRoot:
    """A writable view of a cached root for one node: an overlay mounted by the node's sshd, in its own mount
    namespace, at a folder that sshd accepts as a ChrootDirectory (every component root-owned, none writable by
    others: so not under /tmp, wherever the build cache is)."""

    def __init__(self, lower: Path, scratch: Path) -> None:
        self.lower = lower
        self.upper = scratch / "upper"
        self.work = scratch / "work"
        for folder in (self.upper, self.work):
            folder.mkdir(parents=True)
        MOUNTS.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.merged = Path(tempfile.mkdtemp(prefix="node-", dir=MOUNTS))
        self.merged.chmod(0o755)

    def mount_script(self) -> str:
        """Shell commands, for the new mount namespace, that mount the overlay with /proc and /dev in it."""
        merged = str(self.merged)
        return (f"mount -t overlay overlay -o lowerdir={self.lower},upperdir={self.upper},workdir={self.work} "
                f"{merged} && mount -t proc proc {merged}/proc && mount --rbind /dev {merged}/dev")

    def remove(self) -> None:
        """The node's mount point (its mounts went with its namespace; upper and work are the scratch's)."""
        shutil.rmtree(self.merged, ignore_errors=True)
