"""Test helpers: free ports, process checks, and a real cluster driven through the real CLI."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

CLI = str(Path(sys.executable).with_name("ggml-cluster"))
FIXTURES = Path(__file__).parent / "fixtures"
# What `status`, `run` and `down` never need: SSH, numpy, the model reader, the planner, the node-side code (about
# half a second of imports, every time one of them starts; core.lifecycle loads them for up, check, plan, profile,
# and for a `down` that must find the workers of a controller that is gone).
HEAVY = ("asyncssh", "numpy", "core.nodes", "core.model", "core.planner", "core.plan_explained",
         "core.lifecycle")


_HANDED_OUT: set[int] = set()


def ephemeral_ports() -> range:
    """The ports the kernel hands out to a bind to port 0 and to outgoing connections."""
    low, high = (int(field) for field in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def free_port() -> int:
    """A TCP port nobody listens on right now, below the kernel's ephemeral range, and never one this test run
    handed out before.

    A port from the ephemeral range could be taken between the test choosing it and its worker binding it: by a
    bind to port 0 (the controller's relays, metrics and API) or by any outgoing connection; the node would then
    fail to start with its port "already in use". Below the range only a listener with that very port can take
    it. Random, so that two test runs side by side rarely try the same ones.
    """
    ephemeral = ephemeral_ports()
    low = ephemeral.start
    candidates = range(max(1024, low - 16384), low) if low > 2048 else range(ephemeral.stop, 65536)
    while True:
        port = random.choice(candidates)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # a listener, or a connection of its own still in TIME_WAIT
        _HANDED_OUT.add(port)
        return port


def needs(reason: str | None) -> None:
    """Skip the test for ``reason`` (what this machine lacks) on a developer's machine; fail it in CI, which
    installs everything: a skip there would hide a broken install. None: nothing is missing."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def alive(pid: int) -> bool:
    """Whether a process exists (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def pid_in(path: Path) -> int:
    """The pid a pid file names (its line is "PID START")."""
    return int(path.read_text().split()[0])


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on host:port."""
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


class Cluster:
    """A real cluster driven through the `ggml-cluster` command."""

    def __init__(self, root: Path, nodes: int, context: int = 512, extra: dict[int, list[str]] | None = None,
                 ssh: list[list[str]] | None = None, base_env: dict[str, str] | None = None,
                 defaults: list[str] | None = None, top: list[str] | None = None,
                 strategy: str | None = "memory", ports: list[int] | None = None, api: str = "{port: 0}",
                 prefix: list[str] | None = None) -> None:
        """``nodes`` local workers; with ``ssh``, node i is reached over ssh with those inventory lines; ``api``:
        the inventory's ``api:`` (a key, a queue bound); ``prefix``: what every command runs under (a network
        namespace's ``ip netns exec``).

        ``strategy`` is memory unless asked: identical workers would otherwise get every layer on one node
        (the fastest plan), and the fault tests need every worker in the pipeline. None: the default.
        """
        self.root = root
        self.prefix = prefix or []
        self.state = root / "state"
        self.ports = ports or [free_port() for _ in range(nodes)]
        self.inventory = root / "inventory.yaml"
        # Without the developer's own API key, if any: the inventory's ``api`` decides.
        self.base_env = base_env or {name: value for name, value in os.environ.items()
                                     if name != "GGML_CLUSTER_API_KEY"}
        self.up_output = ""  # what the fixture's `up` printed on stderr
        # Any free ports for the metrics endpoint and the API: test clusters run side by side.
        lines = [f"cluster: test{os.getpid()}", f"context: {context}", "metrics: {port: 0}", f"api: {api}",
                 *(top or [])]
        lines += [f"strategy: {strategy}"] if strategy else []
        if defaults:
            lines += ["defaults:", *(f"  {line}" for line in defaults)]
        lines.append("nodes:")
        for index, port in enumerate(self.ports):
            where = [f"    {line}" for line in ssh[index]] if ssh else ["    kind: local"]
            lines += [f"  - name: n{index}", *where, f"    rpc_port: {port}", "    threads: 1"]
            lines += [f"    {line}" for line in (extra or {}).get(index, [])]
        self.inventory.write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        return {**self.base_env, "GGML_CLUSTER_STATE_DIR": str(self.state)}

    def cli(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*self.prefix, CLI, "-i", str(self.inventory), *args], capture_output=True, text=True,
                                env=self.env(), timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"ggml-cluster {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def heavy_loaded(self, *args: str) -> list[str]:
        """Run a command as `cli` does, in an interpreter that says which of HEAVY it loaded; it must succeed."""
        probe = ("import atexit, json, sys\n"
                 f"atexit.register(lambda: print(json.dumps([name for name in {HEAVY!r} if name in sys.modules])))\n"
                 "sys.argv[0] = 'ggml-cluster'\nimport cli\ncli.main()")
        result = subprocess.run([*self.prefix, sys.executable, "-c", probe, "-i", str(self.inventory), *args],
                                capture_output=True, text=True, env=self.env(), timeout=600, check=False)
        assert result.returncode == 0, f"ggml-cluster {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
        return [str(name) for name in json.loads(result.stdout.strip().splitlines()[-1])]

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.prefix, CLI, "-i", str(self.inventory), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env())

    @staticmethod
    def finish(process: subprocess.Popen[str], timeout: float = 240) -> tuple[str, str]:
        """The rest of a process's stdout, and its stderr, once it exits.

        Read through the same file objects as an earlier ``stdout.read(n)``: communicate() reads the raw
        pipes, and would drop what that earlier read pulled into the text buffer beyond its n characters.
        """
        assert process.stdout is not None and process.stderr is not None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stderr = pool.submit(process.stderr.read)
            rest = process.stdout.read()
            process.wait(timeout)
            return rest, stderr.result(timeout)

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def worker_dir(self, node: str) -> Path:
        """A local node's folder, or an ssh node's under the inventory's ``workdir`` default; a node whose worker
        never started (`up` left it out) fails the test with what its status says."""
        local = self.state / "nodes" / node
        if local.exists():
            return local
        found = next(self.root.glob(f"**/test{os.getpid()}/{node}"), None)
        if found is None:
            seen = next((row for row in self.status()["nodes"] if row["name"] == node), {})
            raise AssertionError(f"node {node} has no worker folder: {seen.get('state')}, {seen.get('last_error')}")
        return found

    def worker_pid(self, node: str) -> int:
        return pid_in(self.worker_dir(node) / "worker.pid")

    def supervisor_pid(self, node: str) -> int:
        return pid_in(self.worker_dir(node) / "supervisor.pid")

    def controller_pid(self) -> int:
        return pid_in(self.state / "controller.pid")

    def processes(self) -> list[int]:
        """Every live process that belongs to this cluster (controller, coordinator, supervisors, workers)."""
        result = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True)
        table = []
        for line in result.stdout.splitlines():
            parts = line.split(None, 2)
            table.append((int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else ""))
        mine = {pid for pid, _, args in table if str(self.root) in args or any(
            f"-p {port} " in args + " " or f"127.0.0.1:{port}" in args for port in self.ports)}
        grown = True
        while grown:  # and their children: the coordinator reaches the workers through relays, not their ports
            children = {pid for pid, ppid, _ in table if ppid in mine} - mine
            mine |= children
            grown = bool(children)
        return [pid for pid in mine if pid != os.getpid() and alive(pid)]


def big_model(path: Path | None = None) -> Path:
    """~180 MB of f16 llama weights: 8 layers, n_embd 1024 (the shape DESIGN.md measured), written once into
    the cache. A token takes tens of ms on two 1-thread workers, and a 512-token batch of prompt over a second."""
    from core.model import write_demo_model
    from core.nodes.build import cache_dir

    path = path or cache_dir() / "models" / "bench-8x1024.gguf"
    if not path.exists():
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        write_demo_model(partial, n_layers=8, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4)
        partial.replace(path)
    return path


def learned(cluster: Cluster) -> dict[str, Any]:
    """A snapshot in which a node has a live time under the running plan: requests until one has (under the compute
    strategy a node's first 64 computes may correct its profile, which starts the count again)."""
    for _ in range(4):
        cluster.cli("run", "The cluster", "-n", "80")  # 80 computes on each node that holds layers
        time.sleep(2.5)  # past the controller's next drift check (every second), so the numbers stand still
        status: dict[str, Any] = cluster.status()
        if any(node["live_ms"] is not None for node in status["nodes"]):
            return status
    raise AssertionError(f"no node got a live time under the plan in four requests: {status['nodes']}")


def running_cluster(prefix: str, nodes: int, **options: Any) -> Iterator[Cluster]:
    """A local cluster of ``nodes`` workers on the demo model (``options``: Cluster's), up for as long as the
    generator runs."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cluster = Cluster(root, nodes=nodes, **options)
    cluster.cli("up")
    yield cluster
    cluster.cli("down", check=False)
    shutil.rmtree(root, ignore_errors=True)


def output_node(status: dict[str, Any]) -> dict[str, Any]:
    """The node of a `status --json` that holds the model's last layers, and so its output layer."""
    return max((node for node in status["nodes"] if node["layers"]), key=lambda node: node["layers"][1])


def metrics_text(status: dict[str, Any]) -> str:
    """The cluster's Prometheus /metrics page (no key: beyond loopback it needs one)."""
    with urllib.request.urlopen(f"http://{status['metrics_endpoint']}/metrics", timeout=30) as answer:
        return str(answer.read().decode())


def api_client(cluster: Cluster) -> openai.OpenAI:
    """An OpenAI client of the cluster's API (no key, no retries: a test sees every failure)."""
    return openai.OpenAI(base_url=f"http://{cluster.status()['api_endpoint']}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@contextlib.contextmanager
def small_disk(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's -o size=) mounted on the empty folder ``mount``, to fill a disk.

    Mounting needs root: a developer's machine skips the test, CI (root) must run it and fails if it cannot.
    """
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        needs(f"needs root and tmpfs mounts to fill a disk: {result.stderr.strip() or result.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def run_with_fault(cluster: Cluster, prompt: str, tokens: str, fault: Callable[[], object],
                   *options: str) -> tuple[subprocess.CompletedProcess[str], str, float]:
    """Start a streamed run (with `run`'s ``options``), inject ``fault`` once tokens flow, return (result, full
    stdout, seconds)."""
    run = cluster.popen("run", prompt, "-n", tokens, *options)
    assert run.stdout is not None
    head = run.stdout.read(40)  # tokens are streaming: the fault lands mid-generation
    started = time.monotonic()
    fault()
    rest, stderr = cluster.finish(run)
    return subprocess.CompletedProcess(run.args, run.returncode, head + rest, stderr), head + rest, \
        time.monotonic() - started
