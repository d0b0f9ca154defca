"""Getting a worker onto a node: decide how (the one already there, this machine's build pushed, a build on the
node, an installed binary), and do it under a lease on the node that a dead owner cannot leave behind."""

from __future__ import annotations

import asyncio
import json
import platform
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from core.errors import DeployError
from core.inventory import BuildPath, Inventory, Node
from core.nodes.build import (
    BACKEND_FLAGS,
    BASE_FLAGS,
    LOW_SPACE,
    OUTPUT_KEPT,
    TARGET,
    Progress,
    build_key,
    cache_dir,
    cached_worker,
    failure_reason,
    parse_progress,
    pinned_version,
    worker_archive,
    worker_binary,
    worker_digest,
)
from core.nodes.probe import NodeFacts, install_hint, node_backend
from core.nodes.shell import PIDS, Remote, free_bytes, shell_command
from core.nodes.target import Target, cross_compiler, cross_target, native
from core.nodes.toolkit import check_rocm_on, remote_toolkit_script


@dataclass(frozen=True)
class Deployment:
    """The worker binary a node runs, and how it got there."""

    binary: str
    key: str
    backend: str
    how: str     # cached | pushed | cross-built | built | installed (planned: push | cross | remote)
    reason: str  # why this backend (and for a cross build, its -march)
    target: Target | None = None  # a cross build's target: the node's arch and -march


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
    (cached | push | cross | remote | installed, and for a local node: cached | build here); raises DeployError when
    no way works. A local node's ``build.path`` must be resolved already (against the inventory's folder)."""
    backend, reason = node_backend(node.backend, facts)
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
        if backend == "rocm":
            await check_rocm_on(remote, f"here for node {node.name}")
        return Deployment(str(cache_dir() / "bin" / key / TARGET), key, backend, "build here", reason)
    refusal = push_refusal(facts, backend, local_flags)
    compiler = cross_compiler(facts.os.system, facts.arch) if backend == "cpu" else None
    cross = compiler is not None and compiler.found() and facts.arch != native().arch
    mode = node.build if node.build != "auto" else "push" if refusal is None or cross else "remote"
    if mode == "push" and refusal is not None:
        if not cross:
            hint = f"apt-get install {compiler.package} here to cross-build, or " if compiler else ""
            raise DeployError(f"node {node.name}: cannot push this machine's build: {refusal}",
                              f"fix: {hint}use build: remote (or auto) to build on the node")
        target = cross_target(facts.os.system, facts.arch, facts.cpu.flags)
        key = build_key(pinned_version(), backend, facts.os.system, facts.arch, cpu_arch=target.cpu_arch)
        how = "cached" if await _present(remote, f"{root}/bin/{key}") else "cross"
        return Deployment(f"{root}/bin/{key}/{TARGET}", key, backend, how,
                          f"{reason}; cross-built here with -march={target.cpu_arch}", target)
    binary = f"{root}/bin/{key}/{TARGET}"
    if await _present(remote, f"{root}/bin/{key}"):
        return Deployment(binary, key, backend, "cached", reason)
    if mode == "remote":
        if compiler is not None and node.build == "auto":
            reason = f"{reason}; no cross compiler here ({compiler.package}), so built on the node (slow)"
        try:
            _check_toolchain(node, facts)
        except DeployError as exc:
            if compiler is None or node.build != "auto":
                raise
            raise DeployError(f"{exc.message}, and this machine has no cross compiler for {facts.arch}",
                              f"fix: apt-get install {compiler.package} here (it cross-builds the worker in about a "
                              f"minute), or on the node: {(exc.hint or '').removeprefix('fix: ')}") from None
        if backend == "rocm":  # said in one line now, not after the upload and a failed cmake
            await check_rocm_on(remote, f"on node {node.name}")
    return Deployment(binary, key, backend, mode, reason)


def _check_toolchain(node: Node, facts: NodeFacts) -> None:
    """Raise DeployError naming what the node lacks to build its worker, and how to install it."""
    missing = [tool for tool, found in (("cmake", facts.toolchain.cmake), ("c++", facts.toolchain.cxx)) if not found]
    if missing:
        raise DeployError(f"node {node.name}: {' and '.join(missing)} not found, needed to build the worker there",
                          f"fix: {install_hint(facts.os, *missing)}")


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
    async with node_lock(remote, f"{home}.lock", progress):
        if await _present(remote, home):
            return replace(plan, how="cached")
        if plan.how in ("push", "cross"):
            try:
                local = await asyncio.to_thread(worker_binary, "cpu", progress, target=plan.target)
            except DeployError as exc:
                raise DeployError(f"node {node.name}: {exc.message}", exc.hint) from None
            progress(f"pushing {TARGET} to {node.name}", None)
            await remote.upload(local.path, f"{home}.partial/{TARGET}", 0o755)
            how = "pushed" if plan.target is None else "cross-built"
        else:
            await _build_on_node(remote, node, root, key=plan.key, backend=plan.backend, progress=progress)
            how = "built"
        manifest = json.dumps({"key": plan.key, "version": pinned_version(), "backend": plan.backend, "how": how,
                               "patches": worker_digest(),
                               "cpu_arch": plan.target.cpu_arch if plan.target else "native"})
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


# Holds a node's build lock for as long as we hold this command (see `node_lock`); runs after pids.sh and
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
async def node_lock(remote: Remote, path: str, progress: Progress, timeout: float = 3600.0
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
    src = f"{root}/src/{archive.name.removesuffix('.tar.gz')}"  # keyed by the patches' digest, as the archive
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
        f"(({remote_toolkit_script(backend, root)}\ncmake -S {q([src])} -B {q([build])} $gen {flags} \"$@\" && "
        f"cmake --build {q([build])} --target {TARGET} --parallel \"$jobs\" && "
        f"mkdir -p {q([root + '/bin/' + key + '.partial'])} && "
        f"cp {q([build + '/' + TARGET, root + '/bin/' + key + '.partial/'])}); echo \"==exit $?\") 2>&1 | "
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


async def built_for(remote: Remote, deployment: Deployment) -> str | None:
    """The -march a node's worker was built with: a cross build's, else what the manifest beside the binary says
    (``native``: for the CPU it was built on); None when unknown (a binary installed by hand)."""
    if deployment.target is not None:
        return deployment.target.cpu_arch
    folder = deployment.binary.rsplit("/", 1)[0]
    found = await remote.run(f"cat {shell_command([folder + '/manifest.json'])} 2>/dev/null")
    try:
        manifest = json.loads(found.stdout) if found.code == 0 else {}
    except json.JSONDecodeError:
        return None
    value = manifest.get("cpu_arch") if isinstance(manifest, dict) else None
    return value if isinstance(value, str) else None


def deployable(inventory: Inventory, node: Node) -> Node:
    """The node as deployment sees it: a local node's ``build: {path: …}`` resolved like every other path of
    the inventory (an SSH node's path is the node's)."""
    if node.kind == "local" and isinstance(node.build, BuildPath):
        return node.model_copy(update={"build": BuildPath(path=str(inventory.resolve(node.build.path)))})
    return node
