"""Get a `ggml-rpc-server`: a cached cmake build of the llama.cpp vendored by the pinned llama-cpp-python.

One llama.cpp source everywhere means one RPC protocol everywhere: the vendored source with our patches
(core.nodes.patches), or for compatibility tests and benchmarks only, stock. Builds are keyed by
(llama-cpp-python version, flavour: the patches' digest or ``stock``, OS, arch, backend), made in a scratch
folder and moved into place only when complete, so a half-written build is never used.
"""

from __future__ import annotations

import errno
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TextIO

from core.errors import DeployError
from core.nodes.patches import STOCK, apply_patches, flavour, patches_digest, patches_within
from core.nodes.target import Target, cross_compiler, cross_flags, native, toolchain_file
from core.nodes.toolkit import backend_cmake_args, key_suffix
from core.version import Version

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
BASE_FLAGS = ("-DGGML_RPC=ON", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF")
# ggml-rpc-server links only ggml: this small project is all a node needs (a few MB instead of llama.cpp).
# Its folders (a trailing /) and files keep their llama.cpp paths, so the patches apply to it unchanged.
WORKER_TREE = ("ggml/", "tools/rpc/rpc-server.cpp")
# ggml alone leaves GGML_LLAMAFILE off, which llama.cpp's own CMakeLists turns on, and it stays off on purpose: with
# llamafile's CPU kernels a row's result depends on how many rows share its step (they take over from two rows,
# "only for prompt processing" in sgemm.cpp, so a one-row decode takes another path), and a request's greedy text
# would change with the requests and drafts beside it (tests/test_parallel.py fails). Without them a prompt of
# llamafile's types (F16, Q8_0, Q5_0, Q4_0) runs at 0.4-0.5x of one process's rate (README: bench/parity.py).
WORKER_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(ggml-rpc-server C CXX)
add_subdirectory(ggml)
add_executable(ggml-rpc-server tools/rpc/rpc-server.cpp)
target_link_libraries(ggml-rpc-server PRIVATE ggml)
target_compile_features(ggml-rpc-server PRIVATE cxx_std_17)
"""

Progress = Callable[[str, float | None], None]
# Less free space than this after a failed build means the build ran out of it (a CPU build needs ~15 MB).
LOW_SPACE = 32 << 20
OUTPUT_KEPT = 400  # lines of a build's output kept to find why it failed (a configure prints ~60)
# A compiler's or linker's error diagnostic (gcc, clang, nvcc: "file:line:col: error: ...", "fatal error: ...",
# "collect2: error: ..."), not a command line that merely holds -Werror.
COMPILER_ERROR = re.compile(r"\berror:")


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


def build_key(version: str, backend: str, system: str | None = None, machine: str | None = None, *,
              stock: bool = False, cpu_arch: str | None = None) -> str:
    """The cache key of one worker build: ``0.3.36-p<digest>-linux-x86_64-cpu``, or ``0.3.36-stock-…``; a cross
    build's ends in the -march it was built with (``…-linux-aarch64-cpu-armv8.2-a+dotprod+fp16``)."""
    system = (system or platform.system()).lower()
    machine = (machine or platform.machine()).lower()
    return f"{version}-{flavour(stock=stock, tree=WORKER_TREE)}-{system}-{machine}-{backend}{key_suffix(backend)}" + (
        f"-{cpu_arch}" if cpu_arch else "")


def project_name(version: str, *, stock: bool = False) -> str:
    """The worker project's name, for its folder and archive: ``worker-0.3.36-p<digest>`` or ``…-stock``."""
    return f"worker-{version}-{flavour(stock=stock, tree=WORKER_TREE)}"


def worker_patches() -> tuple[Path, ...]:
    """The patches that change the worker's files (ggml, rpc-server); the others are the coordinator's alone."""
    return patches_within(WORKER_TREE)


def worker_digest() -> str:
    """The digest of the worker's patches: what its cache keys and manifests name."""
    return patches_digest(worker_patches())


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
def _scratch(parent: Path, prefix: str) -> Iterator[Path]:
    """A folder to fill and then move into place; removed if filling it fails (a full disk, say)."""
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


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
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with _scratch(root, ".unpack-") as scratch, tarfile.open(archive) as tar:
            members = [member for member in tar.getmembers() if member.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            tar.extractall(scratch, members=[m for m in members if m.name], filter="data")
            scratch.replace(tree)
    return tree


def worker_source(version: str, progress: Progress, *, stock: bool = False) -> Path:
    """The worker's own CMake project (ggml + rpc-server.cpp), cut once from the vendored llama.cpp and patched
    (unless ``stock``)."""
    root = cache_dir() / "src"
    name = project_name(version, stock=stock)
    project = root / name
    if (project / "CMakeLists.txt").is_file():
        return project
    tree = source_tree(version, progress)
    with _locked(root / f"{name}.lock"):
        if not (project / "CMakeLists.txt").is_file():
            with _scratch(root, ".worker-") as scratch:
                for path in WORKER_TREE:
                    (scratch / path).parent.mkdir(parents=True, exist_ok=True)
                    copy = shutil.copytree if path.endswith("/") else shutil.copy2
                    copy(tree / path, scratch / path)
                if not stock:
                    # The cut keeps llama.cpp's paths, so each patch applies unchanged (no path rewriting), limited
                    # to the files the worker has: what a patch changes elsewhere (llama's own sources) only the
                    # coordinator's wheel builds.
                    progress("patching llama.cpp", None)
                    apply_patches(scratch, version, worker_patches(),
                                  include=[path + "*" if path.endswith("/") else path for path in WORKER_TREE])
                (scratch / "CMakeLists.txt").write_text(WORKER_CMAKE)
                scratch.replace(project)
    return project


def worker_archive(version: str, progress: Progress, *, stock: bool = False) -> Path:
    """The worker project as a .tar.gz, to upload to nodes that build for themselves."""
    project = worker_source(version, progress, stock=stock)
    archive = project.with_name(f"{project.name}.tar.gz")
    if not archive.is_file():
        partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
        try:
            with tarfile.open(partial, "w:gz") as tar:
                tar.add(project, arcname=".")
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise DeployError(f"cannot pack the worker source into {archive.parent}: {exc.strerror or exc}",
                              f"fix: free space there or set ${CACHE_ENV} to a larger disk") from None
        partial.replace(archive)
    return archive


def source_protocol(version: str, progress: Progress, *, stock: bool = False) -> Version:
    """The RPC protocol the pinned llama.cpp speaks (with the patches, unless ``stock``)."""
    header = worker_source(version, progress, stock=stock) / "ggml" / "include" / "ggml-rpc.h"
    return parse_protocol(header.read_text())


def _target_key(version: str, backend: str, target: Target | None, *, stock: bool = False) -> str:
    if target is None:
        return build_key(version, backend, stock=stock)
    return build_key(version, backend, target.system, target.arch, stock=stock, cpu_arch=target.cpu_arch)


def cached_worker(backend: str = "cpu", *, stock: bool = False, target: Target | None = None) -> WorkerBinary | None:
    """The ggml-rpc-server for ``backend`` (this machine's, or a cross build for ``target``) if it is already built,
    else None."""
    key = _target_key(pinned_version(), backend, target, stock=stock)
    home = cache_dir() / "bin" / key
    if not ((home / TARGET).is_file() and (home / "manifest.json").is_file()):
        return None
    return WorkerBinary(home / TARGET, key, Version(**json.loads((home / "manifest.json").read_text())["protocol"]))


def worker_binary(backend: str = "cpu", progress: Progress | None = None, *, stock: bool = False,
                  target: Target | None = None) -> WorkerBinary:
    """This machine's ggml-rpc-server for ``backend``, built on first use and cached; with a cross ``target``, one
    cross-built here for that node (see core.nodes.target).

    ``stock``: from llama.cpp as shipped, without the patches, for compatibility tests and benchmarks (never
    what `up` deploys)."""
    report: Progress = progress or (lambda _message, _fraction: None)
    if backend not in BACKEND_FLAGS:
        raise DeployError(f"unknown backend '{backend}'", f"fix: use one of {', '.join(BACKEND_FLAGS)}")
    if target is not None and not target.cross:
        target = None  # this machine's own build
    found = cached_worker(backend, stock=stock, target=target)
    if found is not None:
        return found
    version = pinned_version()
    key = _target_key(version, backend, target, stock=stock)
    try:
        with _locked(cache_dir() / "bin" / f"{key}.lock"):
            found = cached_worker(backend, stock=stock, target=target)
            if found is not None:
                return found
            home = cache_dir() / "bin" / key
            protocol = source_protocol(version, report, stock=stock)
            toolkit_args, toolkit_facts = backend_cmake_args(backend, cache_dir(), report)
            manifest = json.dumps({
                "key": key, "version": version, "backend": backend, "built_at": time.time(),
                "patches": STOCK if stock else worker_digest(),
                "protocol": {"major": protocol.major, "minor": protocol.minor, "patch": protocol.patch},
                "target": (target or native()).key_part(), "cpu_arch": target.cpu_arch if target else "native",
                **toolkit_facts,
            })
            _compile(worker_source(version, report, stock=stock), key, backend, home, manifest, report=report,
                     target=target, toolkit_args=toolkit_args)
    except OSError as exc:
        reason = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        raise DeployError(f"cannot build the worker in {cache_dir()}: {reason}",
                          f"fix: free space there or set ${CACHE_ENV} to a folder on a larger disk") from None
    return WorkerBinary(home / TARGET, key, protocol)


def _compile(project: Path, key: str, backend: str, home: Path, manifest: str, *, report: Progress,
             target: Target | None = None, toolkit_args: tuple[str, ...] = ()) -> None:
    builds = cache_dir() / "build"
    builds.mkdir(parents=True, exist_ok=True)
    build = builds / key
    log_path = builds / f"{key}.log"
    if shutil.which("cmake") is None:
        raise DeployError("cmake is not installed on this machine",
                          "fix: apt-get install cmake g++ (or your OS's package of cmake and a C++ compiler)")
    generator = ("-G", "Ninja") if shutil.which("ninja") else ()
    configure = ["cmake", "-S", str(project), "-B", str(build), *generator, *BASE_FLAGS, *BACKEND_FLAGS[backend],
                 *toolkit_args, *_cross_configure(target, builds / f"{key}.toolchain.cmake")]
    # CMake's own variable, when set, caps the jobs: a CUDA build at one job leaves a small machine usable.
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    compile_ = ["cmake", "--build", str(build), "--target", TARGET, "--parallel", jobs]
    with log_path.open("w") as log:
        report(f"configuring {key}", 0.0)
        _run_logged(configure, log, log_path, lambda _line: None, backend)
        report(f"building {TARGET} ({key})", 0.0)
        _run_logged(compile_, log, log_path, lambda line: _report_line(line, key, report), backend)
    built = build / TARGET
    if not built.is_file():
        raise DeployError(f"the build finished but {built} is missing", f"see the build log {log_path}")
    with _scratch(home.parent, f".{key}-") as scratch:
        shutil.copy2(built, scratch / TARGET)
        (scratch / "manifest.json").write_text(manifest)  # last: a folder without it is never used
        if home.exists():
            shutil.rmtree(home)
        scratch.replace(home)
    report(f"built {TARGET} ({key})", 1.0)


def _cross_configure(target: Target | None, toolchain: Path) -> tuple[str, ...]:
    """A cross build's extra CMake arguments (none for a native one); writes its toolchain file."""
    if target is None or not target.cross:
        return ()
    compiler = cross_compiler(target.system, target.arch)
    if compiler is None or not compiler.found():
        package = compiler.package if compiler else f"a cross compiler for {target.arch}"
        raise DeployError(f"no cross compiler here for {target.system}/{target.arch}",
                          f"fix: apt-get install {package}")
    toolchain.write_text(toolchain_file(compiler, target.arch))
    return (f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", *cross_flags(target))


def _report_line(line: str, key: str, report: Progress) -> None:
    fraction = parse_progress(line)
    if fraction is not None:
        report(f"building {TARGET} ({key})", fraction)


def failure_reason(output: Iterable[str]) -> str | None:
    """The line of a build's output that says why it failed: the message under CMake's first "CMake Error"
    (e.g. "Could NOT find Vulkan (missing: glslc)"; its last error line is "Configuring incomplete, errors
    occurred!"), else the compiler's first error (the cause: the errors after it are mostly its consequences,
    e.g. "'LayerSettingEXT' is not a member of 'vk'", then "'layer_setting_info' was not declared"), else the
    last line that names an error (a tool's own, e.g. make's "Error 2")."""
    lines = list(output)
    for index, line in enumerate(lines):
        if line.lstrip().startswith("CMake Error"):
            return next((text.strip() for text in lines[index + 1:] if text.strip()), line.strip())
    diagnostic = next((line.strip() for line in lines if COMPILER_ERROR.search(line)), None)
    if diagnostic is not None:
        return diagnostic
    errors = [line.strip() for line in lines if "error" in line.lower()]
    return errors[-1] if errors else None



def _run_logged(command: list[str], log: TextIO, log_path: Path, on_line: Callable[[str], None],
                backend: str) -> None:
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if process.stdout is None:
        raise DeployError(f"cannot read the output of {command[0]}")
    tail: deque[str] = deque(maxlen=OUTPUT_KEPT)
    for line in process.stdout:
        log.write(line)
        on_line(line)
        tail.append(line)
    code = process.wait()
    if code != 0:
        reason = failure_reason(tail) or f"exit status {code}"
        # Not every tool says so (ar: "unable to copy file; reason: Success"): look at the disk too.
        if "No space left on device" in "".join(tail) or shutil.disk_usage(log_path.parent).free < LOW_SPACE:
            reason = "the disk is full"
        hint = f"fix: free space or set ${CACHE_ENV} to a larger disk; see {log_path}" \
            if reason == "the disk is full" else f"see the build log {log_path}"
        raise DeployError(f"building {TARGET} ({backend}) failed: {reason}", hint)
