"""Get a `ggml-rpc-server`: a cached cmake build of the llama.cpp vendored by the pinned llama-cpp-python.

One llama.cpp source everywhere means one RPC protocol everywhere. Builds are keyed by
(llama-cpp-python version, OS, arch, backend), made in a scratch folder and moved into place only when
complete, so a half-written build is never used.
"""

from __future__ import annotations

import asyncio
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
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import TextIO

from core.errors import DeployError
from core.inventory import BuildPath, Inventory, Node
from core.nodes.probe import NodeFacts, choose_backend, install_hint
from core.nodes.shell import PIDS, Remote, free_bytes, shell_command
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
WORKER_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(ggml-rpc-server C CXX)
add_subdirectory(ggml)
add_executable(ggml-rpc-server rpc-server.cpp)
target_link_libraries(ggml-rpc-server PRIVATE ggml)
target_compile_features(ggml-rpc-server PRIVATE cxx_std_17)
"""

Progress = Callable[[str, float | None], None]
# Less free space than this after a failed build means the build ran out of it (a CPU build needs ~15 MB).
LOW_SPACE = 32 << 20
OUTPUT_KEPT = 400  # lines of a build's output kept to find why it failed (a configure prints ~60)


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


def worker_source(version: str, progress: Progress) -> Path:
    """The worker's own CMake project (ggml + rpc-server.cpp), cut once from the vendored llama.cpp."""
    root = cache_dir() / "src"
    project = root / f"worker-{version}"
    if (project / "CMakeLists.txt").is_file():
        return project
    tree = source_tree(version, progress)
    with _locked(root / f"worker-{version}.lock"):
        if not (project / "CMakeLists.txt").is_file():
            with _scratch(root, ".worker-") as scratch:
                shutil.copytree(tree / "ggml", scratch / "ggml")
                shutil.copy2(tree / "tools" / "rpc" / "rpc-server.cpp", scratch / "rpc-server.cpp")
                (scratch / "CMakeLists.txt").write_text(WORKER_CMAKE)
                scratch.replace(project)
    return project


def worker_archive(version: str, progress: Progress) -> Path:
    """The worker project as a .tar.gz, to upload to nodes that build for themselves."""
    project = worker_source(version, progress)
    archive = project.with_name(f"worker-{version}.tar.gz")
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


def source_protocol(version: str, progress: Progress) -> Version:
    """The RPC protocol the pinned llama.cpp speaks."""
    return parse_protocol((worker_source(version, progress) / "ggml" / "include" / "ggml-rpc.h").read_text())


def cached_worker(backend: str = "cpu") -> WorkerBinary | None:
    """This machine's ggml-rpc-server for ``backend`` if it is already built, else None."""
    key = build_key(pinned_version(), backend)
    home = cache_dir() / "bin" / key
    if not ((home / TARGET).is_file() and (home / "manifest.json").is_file()):
        return None
    return WorkerBinary(home / TARGET, key, Version(**json.loads((home / "manifest.json").read_text())["protocol"]))


def worker_binary(backend: str = "cpu", progress: Progress | None = None) -> WorkerBinary:
    """This machine's ggml-rpc-server for ``backend``, built on first use and cached."""
    report: Progress = progress or (lambda _message, _fraction: None)
    if backend not in BACKEND_FLAGS:
        raise DeployError(f"unknown backend '{backend}'", f"fix: use one of {', '.join(BACKEND_FLAGS)}")
    found = cached_worker(backend)
    if found is not None:
        return found
    version = pinned_version()
    key = build_key(version, backend)
    try:
        with _locked(cache_dir() / "bin" / f"{key}.lock"):
            found = cached_worker(backend)
            if found is not None:
                return found
            home = cache_dir() / "bin" / key
            protocol = source_protocol(version, report)
            manifest = json.dumps({
                "key": key, "version": version, "backend": backend, "built_at": time.time(),
                "protocol": {"major": protocol.major, "minor": protocol.minor, "patch": protocol.patch},
            })
            _compile(worker_source(version, report), key, backend, home, manifest, report=report)
    except OSError as exc:
        reason = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        raise DeployError(f"cannot build the worker in {cache_dir()}: {reason}",
                          f"fix: free space there or set ${CACHE_ENV} to a folder on a larger disk") from None
    return WorkerBinary(home / TARGET, key, protocol)


def _compile(project: Path, key: str, backend: str, home: Path, manifest: str, *, report: Progress) -> None:
    builds = cache_dir() / "build"
    builds.mkdir(parents=True, exist_ok=True)
    build = builds / key
    log_path = builds / f"{key}.log"
    if shutil.which("cmake") is None:
        raise DeployError("cmake is not installed on this machine",
                          "fix: apt-get install cmake g++ (or your OS's package of cmake and a C++ compiler)")
    generator = ("-G", "Ninja") if shutil.which("ninja") else ()
    configure = ["cmake", "-S", str(project), "-B", str(build), *generator, *BASE_FLAGS, *BACKEND_FLAGS[backend]]
    compile_ = ["cmake", "--build", str(build), "--target", TARGET, "--parallel", str(os.cpu_count() or 1)]
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


def _report_line(line: str, key: str, report: Progress) -> None:
    fraction = parse_progress(line)
    if fraction is not None:
        report(f"building {TARGET} ({key})", fraction)


def failure_reason(output: Iterable[str]) -> str | None:
    """The line of a build's output that says why it failed: the message under CMake's first "CMake Error"
    (e.g. "Could NOT find Vulkan (missing: glslc)"; its last error line is "Configuring incomplete, errors
    occurred!"), else the last line that names an error (the compiler's)."""
    lines = list(output)
    for index, line in enumerate(lines):
        if line.lstrip().startswith("CMake Error"):
            return next((text.strip() for text in lines[index + 1:] if text.strip()), line.strip())
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


@dataclass(frozen=True)
class Deployment:
    """The worker binary a node runs, and how it got there."""

    binary: str
    key: str
    backend: str
    how: str     # cached | pushed | built | installed (planned: push | remote)
    reason: str  # why this backend


def push_refusal(facts: NodeFacts, backend: str, local_flags: frozenset[str]) -> str | None:
    """Why this machine's build cannot run on the node, or None when it can.

    Local builds use GGML_NATIVE, so they may use every instruction this CPU has: the node must have the
    same OS and arch and at least the same CPU features.
    """
    here_system, here_arch = platform.system().lower(), platform.machine().lower()
    if backend != "cpu":
        return f"this machine builds only the cpu backend, the node needs {backend}"
    if (facts.os.system, facts.arch) != (here_system, here_arch):
        return f"the node is {facts.os.system}/{facts.arch}, this machine {here_system}/{here_arch}"
    missing = sorted(local_flags - facts.cpu.flags)
    if missing:
        return f"the node's CPU lacks {', '.join(missing[:5])}{'…' if len(missing) > 5 else ''}"
    return None


def node_root(remote: Remote, workdir: str | None) -> str:
    """The node's ggml-cluster folder (``workdir`` or ~/.ggml-cluster), with ``~`` expanded."""
    path = workdir or "~/.ggml-cluster"
    return remote.home() + path[1:] if path.startswith("~") else path


async def decide_deployment(remote: Remote, node: Node, facts: NodeFacts, root: str,
                            local_flags: frozenset[str]) -> Deployment:
    """How the node gets its worker, without changing anything: ``how`` is the plan
    (cached | push | remote | installed, and for a local node: cached | build here); raises DeployError when
    no way works. A local node's ``build.path`` must be resolved already (against the inventory's folder)."""
    backend, reason = (node.backend, f"backend: {node.backend} in the inventory") if node.backend != "auto" \
        else choose_backend(facts)
    key = build_key(pinned_version(), backend, facts.os.system, facts.arch)
    if isinstance(node.build, BuildPath):
        path = node_root(remote, node.build.path) if node.build.path.startswith("~") else node.build.path
        quoted = shell_command([path])
        if (await remote.run(f"test -f {quoted} && test -x {quoted}")).code != 0:  # -x alone takes a folder
            raise DeployError(f"node {node.name}: build.path {path} is not an executable file on the node",
                              "fix: install ggml-rpc-server there or use build: auto")
        return Deployment(path, key, backend, "installed", reason)
    if node.kind == "local":  # this machine's own build for that backend, in its cache
        found = cached_worker(backend)
        if found is not None:
            return Deployment(str(found.path), key, backend, "cached", reason)
        _check_toolchain(node, facts)
        return Deployment(str(cache_dir() / "bin" / key / TARGET), key, backend, "build here", reason)
    binary = f"{root}/bin/{key}/{TARGET}"
    if await _present(remote, f"{root}/bin/{key}"):
        return Deployment(binary, key, backend, "cached", reason)
    refusal = push_refusal(facts, backend, local_flags)
    mode = node.build if node.build != "auto" else ("push" if refusal is None else "remote")
    if mode == "push" and refusal is not None:
        raise DeployError(f"node {node.name}: cannot push this machine's build: {refusal}",
                          "fix: use build: remote (or auto) to build on the node")
    if mode == "remote":
        _check_toolchain(node, facts)
    return Deployment(binary, key, backend, mode, reason)


def _check_toolchain(node: Node, facts: NodeFacts) -> None:
    """Raise DeployError naming what the node lacks to build its worker, and how to install it."""
    missing = [tool for tool, found in (("cmake", facts.toolchain.cmake), ("c++", facts.toolchain.cxx)) if not found]
    if missing:
        raise DeployError(f"node {node.name}: {' and '.join(missing)} not found, needed to build the worker there",
                          f"fix: {install_hint(facts.os, missing[0])}")


async def deploy_worker(remote: Remote, node: Node, facts: NodeFacts, root: str, *, local_flags: frozenset[str],
                        progress: Progress) -> Deployment:
    """Put a ggml-rpc-server for this node's backend on it: cached, pushed, built there, or installed."""
    plan = await decide_deployment(remote, node, facts, root, local_flags)
    if plan.how in ("cached", "installed"):
        return plan
    if node.kind == "local":
        try:
            built = await asyncio.to_thread(worker_binary, plan.backend, progress)
        except DeployError as exc:
            raise DeployError(f"node {node.name}: {exc.message}", exc.hint) from None
        return replace(plan, binary=str(built.path), how="built")
    home = f"{root}/bin/{plan.key}"
    async with _node_lock(remote, f"{home}.lock", progress):
        if await _present(remote, home):
            return replace(plan, how="cached")
        if plan.how == "push":
            local = await asyncio.to_thread(worker_binary, "cpu", progress)
            progress(f"pushing {TARGET} to {node.name}", None)
            await remote.upload(local.path, f"{home}.partial/{TARGET}", 0o755)
            how = "pushed"
        else:
            await _build_on_node(remote, node, root, key=plan.key, backend=plan.backend, progress=progress)
            how = "built"
        manifest = json.dumps({"key": plan.key, "version": pinned_version(), "backend": plan.backend, "how": how})
        installed = await remote.run(
            f"cd {shell_command([root + '/bin'])} && printf '%s' {shell_command([manifest])} > "
            f"{shell_command([plan.key + '.partial/manifest.json'])} && rm -rf {shell_command([plan.key])} && "
            f"mv {shell_command([plan.key + '.partial', plan.key])}")
        if installed.code != 0:
            raise DeployError(f"node {node.name}: cannot install the worker: {installed.stderr.strip()}")
    return replace(plan, how=how)


async def _present(remote: Remote, home: str) -> bool:
    found = await remote.run(f"test -x {shell_command([home + '/' + TARGET])} && "
                             f"test -f {shell_command([home + '/manifest.json'])}")
    return found.code == 0


# Holds a node's build lock for as long as we hold this command (see `_node_lock`); runs after pids.sh and
# `lock=<path>`. It prints "held" once it holds the lock, "waiting PID" once while another process does, and
# anything else is why it cannot take the lock.
_LEASE = """
held=
# TERM from the follow's watcher; PIPE and HUP, which can come first, when the connection goes.
trap '[ -z "$held" ] || rm -rf "$lock"; exit 0' TERM INT HUP PIPE
stale() {  # the owner is gone, or its pid is another process by now; no owner (older versions): a minute old
    if [ -f "$lock/owner" ]; then ! ours "$lock/owner" LEASE_MARKER >/dev/null
    else [ -n "$(find "$lock" -maxdepth 0 -mmin +1 2>/dev/null)" ]; fi
}
mkdir -p "$(dirname "$lock")" 2>&1 || exit 1
said=
until problem=$(LC_ALL=C mkdir "$lock" 2>&1); do
    case "$problem" in *"File exists"*) ;; *) echo "$problem"; exit 1;; esac
    # Taken over by one process at a time, and only if still stale then: a lock taken anew is never removed.
    if stale && mkdir "$lock.takeover" 2>/dev/null; then
        if stale; then rm -rf "$lock"; fi
        rmdir "$lock.takeover"
        continue
    fi
    # A taker that died between those two lines leaves its folder behind.
    [ -z "$(find "$lock.takeover" -maxdepth 0 -mmin +1 2>/dev/null)" ] || rmdir "$lock.takeover" 2>/dev/null
    [ -n "$said" ] || { said=1; read -r owner _ < "$lock/owner" 2>/dev/null; echo "waiting ${owner:-}"; }
    sleep 1
done
held=1
record $$ > "$lock/owner.new" && mv "$lock/owner.new" "$lock/owner"
echo held
while :; do sleep 3600 & wait $!; done
"""
LEASE_MARKER = "ggml-cluster-build-lease"  # in the lease's own command line: what its owner file must name


@asynccontextmanager
async def _node_lock(remote: Remote, path: str, progress: Progress, timeout: float = 3600.0
                     ) -> AsyncIterator[None]:
    """One build per key per node at a time (nodes may share a machine), as a lease: a process on the node,
    tied to our connection, holds the lock folder and records itself in it as its owner (pid and start). It
    removes the lock when we let go, and when we are interrupted or die (the connection closes). A lock whose
    owner is dead, or whose pid names another process by now, is taken over at once."""
    script = f"{PIDS}\n: {LEASE_MARKER}\nlock={shell_command([path])}\n" + _LEASE.replace(
        "LEASE_MARKER", shell_command([LEASE_MARKER]))
    lease = remote.follow(script)
    try:
        try:
            async with asyncio.timeout(timeout):
                await _take(lease, remote.name, path, progress)
        except TimeoutError:
            raise DeployError(f"node {remote.name}: another build has held {path} for {timeout / 60:.0f} "
                              "minutes", "let it finish, or stop it") from None
        yield
    finally:
        await lease.aclose()


async def _take(lease: AsyncIterator[str], node: str, path: str, progress: Progress) -> None:
    """Read the lease's lines until it holds the lock."""
    problems: list[str] = []
    async for line in lease:
        if line == "held":
            return
        if line.startswith("waiting"):
            owner = line.removeprefix("waiting").strip()
            progress(f"waiting for another build on {node}" + (f" (pid {owner})" if owner else ""), None)
        else:
            problems.append(line)
    raise DeployError(f"node {node}: cannot take the build lock {path}: {'; '.join(problems) or 'no answer'}")


async def _build_on_node(remote: Remote, node: Node, root: str, *, key: str, backend: str,
                         progress: Progress) -> None:
    version = pinned_version()
    archive = await asyncio.to_thread(worker_archive, version, progress)
    progress(f"uploading llama.cpp worker source to {node.name}", None)
    await remote.upload(archive, f"{root}/src/{archive.name}")
    src = f"{root}/src/worker-{version}"
    build = f"{root}/build/{key}"
    log = f"{root}/bin/{key}.build.log"
    flags = " ".join([*BASE_FLAGS, *BACKEND_FLAGS[backend]])
    q = shell_command
    script = (
        f"if [ ! -f {q([src + '/CMakeLists.txt'])} ]; then rm -rf {q([src + '.partial'])} && "
        f"mkdir -p {q([src + '.partial'])} && tar xzf {q([root + '/src/' + archive.name])} -C {q([src + '.partial'])}"
        f" && mv {q([src + '.partial', src])}; fi; "
        "gen=; command -v ninja >/dev/null 2>&1 && gen='-G Ninja'; "
        "jobs=$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2); "
        f"(cmake -S {q([src])} -B {q([build])} $gen {flags} && "
        f"cmake --build {q([build])} --target {TARGET} --parallel \"$jobs\" && "
        f"mkdir -p {q([root + '/bin/' + key + '.partial'])} && "
        f"cp {q([build + '/' + TARGET, root + '/bin/' + key + '.partial/'])}; echo \"==exit $?\") 2>&1 | "
        f"tee {q([log])}"
    )
    progress(f"building {TARGET} on {node.name}", 0.0)
    code, tail = None, deque[str](maxlen=OUTPUT_KEPT)
    async for line in remote.follow(f"sh -c {q([script])}"):
        if line.startswith("==exit "):
            code = int(line.split()[1])
        else:
            tail.append(line)
        fraction = parse_progress(line)
        if fraction is not None:
            progress(f"building {TARGET} on {node.name}", fraction)
    if code != 0:
        full = any("No space left" in line for line in tail) or \
            (await free_bytes(remote, root) or LOW_SPACE) < LOW_SPACE
        reason = "the disk is full" if full else (failure_reason(tail) or f"exit status {code}")
        raise DeployError(f"node {node.name}: building {TARGET} ({backend}) failed: {reason}",
                          f"fix: free space on the node or set its workdir to a larger disk; see {log} there"
                          if full else f"see {log} on the node")


def deployable(inventory: Inventory, node: Node) -> Node:
    """The node as deployment sees it: a local node's ``build: {path: …}`` resolved like every other path of
    the inventory (an SSH node's path is the node's)."""
    if node.kind == "local" and isinstance(node.build, BuildPath):
        return node.model_copy(update={"build": BuildPath(path=str(inventory.resolve(node.build.path)))})
    return node
