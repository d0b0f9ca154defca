"""Get a `ggml-rpc-server`: a cached cmake build of the llama.cpp vendored by the pinned llama-cpp-python.

One llama.cpp source everywhere means one RPC protocol everywhere. Builds are keyed by
(llama-cpp-python version, OS, arch, backend), made in a scratch folder and moved into place only when
complete, so a half-written build is never used.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TextIO

from core.errors import DeployError
from core.rpc import Version

PACKAGE = "llama-cpp-python"
TARGET = "ggml-rpc-server"
CACHE_ENV = "GGML_CLUSTER_CACHE_DIR"
BACKEND_FLAGS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "cuda": ("-DGGML_CUDA=ON",),
    "rocm": ("-DGGML_HIP=ON",),
    "vulkan": ("-DGGML_VULKAN=ON",),
    "metal": ("-DGGML_METAL=ON",),
}
# A static binary can be copied to another node of the same kind without its libraries.
BASE_FLAGS = ("-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF")

Progress = Callable[[str, float | None], None]


@dataclass(frozen=True)
class WorkerBinary:
    """A built worker and what it speaks."""

    path: Path
    key: str
    protocol: Version


def cache_dir() -> Path:
    """$GGML_CLUSTER_CACHE_DIR, else $XDG_CACHE_HOME/ggml-cluster, else ~/.cache/ggml-cluster."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-cluster"


def pinned_version() -> str:
    """The installed llama-cpp-python: the coordinator the workers must match."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise DeployError(f"{PACKAGE} is not installed in this Python ({sys.executable})",
                          "fix: run `make setup` (it builds it with -DGGML_RPC=ON)") from None


def build_key(version: str, backend: str, system: str | None = None, machine: str | None = None) -> str:
    """The cache key of one worker build."""
    system = (system or platform.system()).lower()
    machine = (machine or platform.machine()).lower()
    return f"{version}-{system}-{machine}-{backend}"


def parse_protocol(header_text: str) -> Version:
    """The RPC protocol version from ggml-rpc.h."""
    parts = {}
    for part in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+RPC_PROTO_{part}_VERSION\s+(\d+)", header_text)
        if not match:
            raise DeployError(f"ggml-rpc.h has no RPC_PROTO_{part}_VERSION; unexpected llama.cpp source")
        parts[part] = int(match.group(1))
    return Version(parts["MAJOR"], parts["MINOR"], parts["PATCH"])


def parse_progress(line: str) -> float | None:
    """Build progress from a ninja (``[12/197]``) or make (``[ 45%]``) output line."""
    match = re.match(r"\s*\[\s*(\d+)/(\d+)\]", line)
    if match and int(match.group(2)):
        return int(match.group(1)) / int(match.group(2))
    match = re.match(r"\s*\[\s*(\d+)%\]", line)
    return int(match.group(1)) / 100 if match else None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def source_tree(version: str, progress: Progress) -> Path:
    """The vendored llama.cpp of llama-cpp-python==version, downloaded and unpacked once."""
    root = cache_dir() / "src"
    tree = root / f"llama.cpp-{version}"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    with _locked(root / f"{version}.lock"):
        if (tree / "CMakeLists.txt").is_file():
            return tree
        archive = root / f"llama_cpp_python-{version}.tar.gz"
        if not archive.is_file():
            progress(f"downloading {PACKAGE}=={version} source", None)
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", PACKAGE,
                 f"{PACKAGE}=={version}", "-d", str(root)],
                capture_output=True, text=True, check=False)
            if result.returncode != 0 or not archive.is_file():
                last = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise DeployError(f"cannot download the {PACKAGE}=={version} source: {last}",
                                  f"fix: put llama_cpp_python-{version}.tar.gz into {root}")
        progress("unpacking llama.cpp source", None)
        scratch = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [member for member in tar.getmembers() if member.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            tar.extractall(scratch, members=[m for m in members if m.name], filter="data")
        scratch.replace(tree)
    return tree


def worker_binary(backend: str = "cpu", progress: Progress | None = None) -> WorkerBinary:
    """This machine's ggml-rpc-server for ``backend``, built on first use and cached."""
    report: Progress = progress or (lambda _message, _fraction: None)
    if backend not in BACKEND_FLAGS:
        raise DeployError(f"unknown backend '{backend}'", f"fix: use one of {', '.join(BACKEND_FLAGS)}")
    version = pinned_version()
    key = build_key(version, backend)
    home = cache_dir() / "bin" / key
    binary = home / TARGET
    manifest = home / "manifest.json"
    if binary.is_file() and manifest.is_file():
        return WorkerBinary(binary, key, Version(**json.loads(manifest.read_text())["protocol"]))
    with _locked(cache_dir() / "bin" / f"{key}.lock"):
        if binary.is_file() and manifest.is_file():
            return WorkerBinary(binary, key, Version(**json.loads(manifest.read_text())["protocol"]))
        tree = source_tree(version, report)
        protocol = parse_protocol((tree / "ggml" / "include" / "ggml-rpc.h").read_text())
        _compile(tree, key, backend, home, report)
        manifest.write_text(json.dumps({
            "key": key, "version": version, "backend": backend, "built_at": time.time(),
            "protocol": {"major": protocol.major, "minor": protocol.minor, "patch": protocol.patch},
        }))
    return WorkerBinary(binary, key, protocol)


def _compile(tree: Path, key: str, backend: str, home: Path, report: Progress) -> None:
    builds = cache_dir() / "build"
    builds.mkdir(parents=True, exist_ok=True)
    build = builds / key
    log_path = builds / f"{key}.log"
    if shutil.which("cmake") is None:
        raise DeployError("cmake is not installed on this machine",
                          "fix: apt-get install cmake g++ (or your OS's package of cmake and a C++ compiler)")
    generator = ("-G", "Ninja") if shutil.which("ninja") else ()
    configure = ["cmake", "-S", str(tree), "-B", str(build), *generator, *BASE_FLAGS, *BACKEND_FLAGS[backend]]
    compile_ = ["cmake", "--build", str(build), "--target", TARGET, "--parallel", str(os.cpu_count() or 1)]
    with log_path.open("w") as log:
        report(f"configuring {key}", 0.0)
        _run_logged(configure, log, log_path, lambda _line: None)
        report(f"building {TARGET} ({key})", 0.0)
        _run_logged(compile_, log, log_path, lambda line: _report_line(line, key, report))
    built = build / "bin" / TARGET
    if not built.is_file():
        raise DeployError(f"the build finished but {built} is missing", f"see the build log {log_path}")
    scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=home.parent))
    shutil.copy2(built, scratch / TARGET)
    if home.exists():
        shutil.rmtree(home)
    scratch.replace(home)
    report(f"built {TARGET} ({key})", 1.0)


def _report_line(line: str, key: str, report: Progress) -> None:
    fraction = parse_progress(line)
    if fraction is not None:
        report(f"building {TARGET} ({key})", fraction)


def _run_logged(command: list[str], log: TextIO, log_path: Path, on_line: Callable[[str], None]) -> None:
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if process.stdout is None:
        raise DeployError(f"cannot read the output of {command[0]}")
    tail: list[str] = []
    for line in process.stdout:
        log.write(line)
        on_line(line)
        if "error" in line.lower():
            tail.append(line.strip())
    code = process.wait()
    if code != 0:
        reason = tail[-1] if tail else f"exit status {code}"
        if "No space left on device" in "".join(tail):
            reason = "the disk is full"
        raise DeployError(f"building {TARGET} failed: {reason}", f"see the build log {log_path}")
