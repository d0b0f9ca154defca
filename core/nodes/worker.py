"""Start, adopt and stop a supervised ggml-rpc-server on a node, and read its event stream.

The supervisor (supervise.sh) runs on the node, detached, so a worker outlives the controller and a
later `up` adopts it. It writes into the worker's work dir: supervisor.pid, worker.pid (``PID START``, see
pids.sh: a pid is signalled only while it still names that process), worker.log, events.jsonl, and
`command` (what it runs, for adoption).
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from core.errors import DeployError, MissingDevice
from core.inventory import Inventory, Node
from core.nodes.deploy import node_root
from core.nodes.devices import LIST_DEVICE, LISTING_ENV, Device, backend_devices, device_problem, parse_devices
from core.nodes.shell import PIDS, Remote, shell_command
from core.state import StateDir

# The supervisor writes its pid files with pids.sh's functions.
SUPERVISOR = PIDS + Path(__file__).with_name("supervise.sh").read_text()
# Five exits within a minute is a crash loop, not bad luck.
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW_S = 60
MAX_BACKOFF_S = 30


@dataclass(frozen=True)
class WorkerSpec:
    """One worker as its node should run it."""

    node: str
    workdir: str
    binary: str
    port: int
    threads: int | None = None
    bind: str = "127.0.0.1"
    cache: str | None = None  # LLAMA_CACHE for the worker's tensor cache (-c)
    env: tuple[tuple[str, str], ...] = ()  # the node's `env:`, sorted by name (see `environment`)
    max_exits: int = CRASH_LOOP_EXITS
    window_s: int = CRASH_LOOP_WINDOW_S
    max_backoff_s: int = MAX_BACKOFF_S

    def argv(self) -> list[str]:
        """The ggml-rpc-server command line."""
        argv = [self.binary, "-H", self.bind, "-p", str(self.port), "-c"]
        if self.threads:
            argv += ["-t", str(self.threads)]
        return argv

    def command(self) -> str:
        """The worker's command as the supervisor runs it; also its identity for adoption (so the same
        inventory always renders the same command)."""
        return shell_command([*self._env_prefix(), *self.argv()])

    def devices_command(self, backend: str) -> str:
        """The worker binary, in the worker's environment, listing its devices (it exits without serving); with
        what makes ``backend``'s loader say why it finds none (the node's ``env:`` still wins)."""
        extra = [(name, value) for name, value in LISTING_ENV.get(backend, {}).items()
                 if name not in dict(self.env)]
        return shell_command([*self._env_prefix(extra), self.binary, "-d", LIST_DEVICE])

    def _env_prefix(self, extra: list[tuple[str, str]] | None = None) -> list[str]:
        assignments = ([f"LLAMA_CACHE={self.cache}"] if self.cache else []) + [
            f"{name}={value}" for name, value in [*(extra or []), *self.env]]
        return ["env", *assignments] if assignments else []

    def supervisor_marker(self) -> str:
        """What the supervisor's command line holds (`sh <workdir>/supervise.sh <workdir> …`)."""
        return f" {self.workdir}/supervise.sh {self.workdir} "

    def worker_marker(self) -> str:
        """What the worker's command line holds, whichever binary it runs."""
        return f" -p {self.port} -c"

    def supervisor_command(self) -> str:
        """Detached supervisor start: survives the controller and the SSH session that started it."""
        script = f"{self.workdir}/supervise.sh"
        inner = shell_command(["sh", script, self.workdir, str(self.max_exits), str(self.window_s),
                               str(self.max_backoff_s)])
        detach = "if command -v setsid >/dev/null 2>&1; then exec setsid \"$@\"; else exec nohup \"$@\"; fi"
        # The subshell returns at once; only the background job holds files, none of them ours (an SSH
        # session stays open while any process holds its stdout).
        return (f"cd {shell_command([self.workdir])} && "
                f"(sh -c {shell_command([detach])} sh {inner} {self.command()} "
                "</dev/null >>supervisor.log 2>&1 &)")


def environment(node: Node, backend: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """A node's ``env:`` over what its backend needs (``backend``: core.nodes.devices.backend_environment), as a
    WorkerSpec holds it: sorted by name, whatever order the inventory wrote it in. The node's own values win."""
    return tuple(sorted({**(backend or {}), **node.env}.items()))


# Hints for a worker without its backend's device, by backend.
_DEVICE_FIXES = {
    "cuda": "fix: install an NVIDIA driver as new as the worker's CUDA (`nvidia-smi` lists the GPU), or set "
            "backend: cpu",
    "rocm": "fix: check the node's ROCm driver (`rocm-smi` lists the GPU), or set backend: cpu",
    "vulkan": "fix: install the node's Vulkan driver (`vulkaninfo --summary` lists a device), or set backend: cpu",
    "metal": "fix: Metal needs macOS on Apple silicon; or set backend: cpu",
}


async def backend_device(remote: Remote, spec: WorkerSpec, backend: str) -> Device | None:
    """The device of ``backend`` that the node's worker binary finds in the worker's environment (None for cpu).

    Raises MissingDevice, in one line naming the node, the backend and the worker's own explanation, when it has
    none: started anyway, it would serve the CPU alone and pass for a GPU worker."""
    if backend == "cpu":
        return None
    result = await remote.run(f"{spec.devices_command(backend)} 2>&1", timeout=120)
    problem = device_problem(backend, result.code, result.stdout)
    if problem is not None:
        raise MissingDevice(f"node {spec.node}: {problem}", _DEVICE_FIXES.get(backend))
    found = backend_devices(backend, parse_devices(result.stdout) or ())
    return found[0] if found else None


@dataclass(frozen=True)
class WorkerEvent:
    """One line of a supervisor's events.jsonl."""

    time: float
    kind: str  # started | exit | backoff | failed | stopped
    pid: int | None = None
    code: int | None = None
    log_offset: int | None = None
    ran_s: int | None = None
    seconds: int | None = None
    cause: str | None = None  # of a "failed": illegal-instruction (SIGILL), else a crash loop


def parse_event(line: str) -> WorkerEvent | None:
    """Parse one events.jsonl line; None for anything that is not a complete event."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return None
    fields = ("pid", "code", "log_offset", "ran_s", "seconds")
    values = {key: data[key] for key in fields if isinstance(data.get(key), int)}
    cause = data.get("cause") if isinstance(data.get("cause"), str) else None
    return WorkerEvent(time=float(data.get("time", 0)), kind=data["kind"], cause=cause, **values)


ILLEGAL_INSTRUCTION = "illegal-instruction"


def wrong_cpu(node: str, built_for: str | None, features: frozenset[str]) -> str:
    """Why a worker that died of SIGILL is not restarted, in one line: what it was built for, what the node's CPU
    has, and the way out."""
    built = f"built with -march={built_for}" if built_for else "built for another CPU"
    has = " ".join(sorted(features)) if features else "unknown features"
    return (f"node {node}: the worker died of SIGILL (illegal instruction): it was {built}, and this node's CPU "
            f"lacks an instruction it uses (the CPU has: {has}); not restarted: give the node a worker built for it "
            "(build: auto cross-builds for its own features), then run `ggml-cluster up`")


_ASSERT = re.compile(r"GGML_ASSERT\((?P<expr>.*)\) failed")
_ABORT = re.compile(r"\.(?:c|cpp|cu|m):\d+: (?P<message>.+)$")
_OOM = re.compile(r"out of memory|cudaMalloc failed|failed to allocate|unable to allocate|std::bad_alloc|"
                  r"hipMalloc failed|ErrorOutOfDeviceMemory", re.IGNORECASE)


def classify_exit(code: int, log_text: str) -> str:
    """A one-line cause for a worker exit, from its exit status and the log it wrote since it started."""
    how = _describe_code(code)
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    if any("Failed to create server socket" in line for line in lines):
        return f"{how}: port already in use or not bindable"
    for line in reversed(lines):
        if _OOM.search(line):
            return f"{how}: out of memory ({line[:120]})"
    for line in reversed(lines):
        match = _ASSERT.search(line)
        if match:
            expr = match.group("expr")
            if "GGML_STATUS_SUCCESS" in expr:
                return f"{how}: graph compute failed (GGML_ASSERT status == GGML_STATUS_SUCCESS)"
            return f"{how}: GGML_ASSERT({expr}) failed"
    for line in reversed(lines):
        match = _ABORT.search(line)
        if match and code in (134, -6):
            return f"{how}: {match.group('message')[:160]}"
    errors = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)]
    if errors and code not in (137, 143):
        return f"{how}: {errors[-1][:160]}"
    return how


def _describe_code(code: int) -> str:
    number = code - 128 if code > 128 else -code if code < 0 else 0
    if number:
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    return f"exit code {code}"


def event_path(spec: WorkerSpec) -> str:
    """Where the supervisor writes its events."""
    return f"{spec.workdir}/events.jsonl"


async def running_supervisor(remote: Remote, spec: WorkerSpec) -> tuple[int, str] | None:
    """The live supervisor's pid and the worker command it runs, or None (also when supervisor.pid is stale)."""
    workdir = shell_command([spec.workdir])
    result = await remote.run(
        f"{PIDS}\ncd {workdir} 2>/dev/null && sup=$(ours supervisor.pid {shell_command([spec.supervisor_marker()])})"
        " && echo \"${sup%% *}\" && cat command")
    lines = result.stdout.splitlines()
    if result.code != 0 or not lines or not lines[0].isdigit():
        return None
    return int(lines[0]), "\n".join(lines[1:])


async def running_worker(remote: Remote, spec: WorkerSpec) -> int | None:
    """The live worker's pid, or None (between an exit and its restart, or when worker.pid is stale)."""
    workdir = shell_command([spec.workdir])
    result = await remote.run(
        f"{PIDS}\ncd {workdir} 2>/dev/null && wrk=$(ours worker.pid {shell_command([spec.worker_marker()])})"
        " && echo \"${wrk%% *}\"")
    pid = result.stdout.strip()
    return int(pid) if result.code == 0 and pid.isdigit() else None


async def start(remote: Remote, spec: WorkerSpec) -> bool:
    """Start the worker under its supervisor, or adopt the one already running it.

    Returns True when an existing worker was adopted. A supervisor running another command is stopped.
    """
    current = await running_supervisor(remote, spec)
    if current is not None and current[1] == spec.command():
        return True
    if current is not None:
        await stop(remote, spec)
    workdir = shell_command([spec.workdir])
    # One round trip: make the folder, install the supervisor (sent on stdin), record the command, drop pid
    # files that name no process of ours (left by a reboot), start, and wait (up to 5 s) for the supervisor to
    # write its pid.
    write = await remote.run(
        f"mkdir -p {workdir} && cd {workdir} && cat > supervise.sh.partial && chmod 755 supervise.sh.partial && "
        f"mv supervise.sh.partial supervise.sh && printf '%s' {shell_command([spec.command()])} > command && "
        f"rm -f supervisor.pid worker.pid && {spec.supervisor_command()} && "
        "i=0; while [ ! -s supervisor.pid ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done",
        stdin=SUPERVISOR)
    if write.code != 0:
        raise DeployError(f"node {spec.node}: cannot start the worker in {spec.workdir}: "
                          f"{write.stderr.strip() or write.code}")
    if await running_supervisor(remote, spec) is not None:
        return False
    log = await remote.run(f"tail -n 5 {workdir}/supervisor.log")
    raise DeployError(f"node {spec.node}: the worker supervisor did not start: "
                      f"{log.stdout.strip() or 'no output'}")


async def stop(remote: Remote, spec: WorkerSpec, timeout: float = 10.0) -> None:
    """Stop the supervisor and its worker; kill them if they do not stop within ``timeout``. Only processes
    that the pid files still name are signalled; the pid files go either way."""
    workdir = shell_command([spec.workdir])
    script = (
        f"{PIDS}\ncd {workdir} 2>/dev/null || exit 0\n"
        f"sup=$(ours supervisor.pid {shell_command([spec.supervisor_marker()])}); "
        f"wrk=$(ours worker.pid {shell_command([spec.worker_marker()])}); "
        "send TERM \"$sup\"; "
        f"i=0; while [ $i -lt {int(timeout * 10)} ]; do "
        "  busy=0; for p in \"$sup\" \"$wrk\"; do [ -n \"$p\" ] && alive \"${p%% *}\" && busy=1; done; "
        "  [ $busy = 0 ] && break; sleep 0.1; i=$((i+1)); done; "
        "send KILL \"$sup\"; send KILL \"$wrk\"; "
        "rm -f supervisor.pid worker.pid; exit 0"
    )
    await remote.run(script, timeout=timeout + 5)


async def kill(remote: Remote, spec: WorkerSpec) -> None:
    """Kill the worker (SIGKILL), for its supervisor to restart, if worker.pid still names it."""
    workdir = shell_command([spec.workdir])
    await remote.run(f"{PIDS}\ncd {workdir} 2>/dev/null && "
                     f"send KILL \"$(ours worker.pid {shell_command([spec.worker_marker()])})\"; true")


async def last_event(remote: Remote, spec: WorkerSpec) -> WorkerEvent | None:
    """The supervisor's latest event (None when it has none)."""
    result = await remote.run(f"tail -n 1 {shell_command([event_path(spec)])} 2>/dev/null")
    return parse_event(result.stdout.strip())


async def events_size(remote: Remote, spec: WorkerSpec) -> int:
    """Bytes in the supervisor's events file so far (0 when it has none): where following it starts."""
    result = await remote.run(f"wc -c < {shell_command([event_path(spec)])} 2>/dev/null || echo 0")
    return parse_count(result.stdout)


def parse_count(text: str) -> int:
    """A count `wc -c` printed (with the spaces some systems pad it with), or 0."""
    text = text.strip()
    return int(text) if text.isdigit() else 0


def follow_command(spec: WorkerSpec, offset: int) -> str:
    """Print the supervisor's events from byte ``offset`` on, and every one appended later."""
    return f"tail -c +{int(offset) + 1} -F {shell_command([event_path(spec)])} 2>/dev/null"


async def stopped(remote: Remote, pid: int) -> bool:
    """Whether process ``pid`` on the node is stopped (SIGSTOP, a debugger): it holds a pipeline forever."""
    return parse_stopped((await remote.run(f"ps -o stat= -p {int(pid)}")).stdout)


def parse_stopped(text: str) -> bool:
    """`ps -o stat=` of a stopped process starts with T (procps and BSD alike)."""
    return text.strip().startswith("T")


async def read_log(remote: Remote, spec: WorkerSpec, offset: int, limit: int = 65536) -> str:
    """The worker's log from ``offset`` (at most the last ``limit`` bytes of it)."""
    path = shell_command([f"{spec.workdir}/worker.log"])
    result = await remote.run(f"tail -c +{int(offset) + 1} {path} 2>/dev/null | tail -c {int(limit)}")
    return result.stdout


def worker_dir(inventory: Inventory, node: Node, state: StateDir, remote: Remote) -> str:
    """Where a node's worker lives: a local node's ``workdir`` or <state>/nodes/<node>; an ssh node's
    <workdir or ~/.ggml-cluster>/<cluster>/<node> (``remote`` connected, to expand ``~``)."""
    if node.kind == "local":
        return str(inventory.workdir(node) or state.node_dir(node.name))
    return f"{node_root(remote, node.workdir)}/{inventory.cluster}/{node.name}"
