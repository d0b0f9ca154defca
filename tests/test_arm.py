"""ARM nodes end to end: an arm64 Debian root under qemu-user, reached through a real sshd, gets a worker
cross-built here for its own CPU features, serves the cluster, and a worker built for a richer CPU is reported
once and not restarted forever."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.nodes.build import worker_binary
from core.nodes.target import Target
from tests.emulated import require_emulation
from tests.harness import Cluster
from tests.sshd import NEEDS_SSHD, Sshd, SshWorld, running_world
from tests.test_hardening import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900), NEEDS_SSHD]

PI4 = "cortex-a72"  # a Raspberry Pi 4: armv8-a, no dotprod, no fp16 arithmetic
RICH_MARCH = "armv8.2-a+dotprod+fp16+i8mm"  # what a build for a newer board (or the wrong -march) uses
ELF_MACHINE_AARCH64 = 0xB7


@pytest.fixture(scope="module")
def world() -> Iterator[SshWorld]:
    require_emulation()
    yield from running_world("gca-", 0)


def arm_lines(world: SshWorld, server: Sshd, **override: str) -> list[str]:
    fields = {"host": "127.0.0.1", "port": str(server.port), "user": "root", "identity": str(world.identity),
              **override}
    return [f"{key}: {value}" for key, value in fields.items()]


def mixed(world: SshWorld, root: Path, server: Sshd, arm: dict[str, str] | None = None,
          strategy: str | None = "equal") -> Cluster:
    """One local x86 worker (n0) and the arm64 node (n1)."""
    return Cluster(root, nodes=2, ssh=[["kind: local"], arm_lines(world, server, **(arm or {}))],
                   base_env=world.env(), strategy=strategy)


def elf_machine(data: bytes) -> int:
    return int.from_bytes(data[18:20], "little")


def on_node(world: SshWorld, server: Sshd, command: str, stdin: bytes | None = None) -> bytes:
    """Run a command on the node as a user would (ssh, landing in its root); its output."""
    return subprocess.run(["ssh", "-o", "BatchMode=yes", "-p", str(server.port), "-i", str(world.identity),
                           "-o", f"UserKnownHostsFile={world.home / '.ssh' / 'known_hosts'}", "root@127.0.0.1",
                           command], input=stdin, capture_output=True, check=True, timeout=60).stdout


def test_a_pi_4_gets_a_worker_cross_built_for_its_cpu_and_serves(world: SshWorld, short_tmp: Path) -> None:
    server = world.emulated_server(Path(tempfile.mkdtemp(prefix="pi4-", dir=world.root)), PI4)
    cluster = mixed(world, short_tmp, server)
    rows = {row["name"]: row for row in json.loads(cluster.cli("check", "--json").stdout)}
    arm = rows["n1"]
    assert arm["system"] == "linux/aarch64" and arm["backend"] == "cpu" and not arm["problem"]
    assert arm["worker"] in ("cross", "cached") and "-march=armv8-a" in arm["reason"], arm
    try:
        started = time.monotonic()
        cluster.cli("up")
        first_up = time.monotonic() - started
        status = cluster.status()
        nodes = {node["name"]: node for node in status["nodes"]}
        assert nodes["n1"]["state"] == "ready" and nodes["n1"]["arch"] == "aarch64" and nodes["n1"]["backend"] == "cpu"
        assert nodes["n0"]["arch"] == "x86_64" and nodes["n1"]["layers"], status["tensor_split"]
        deploy = [event["message"] for event in status["events"] if event["kind"] == "deploy" and event["node"] == "n1"]
        assert deploy and "cross-built" in deploy[0] and "-march=armv8-a" in deploy[0], deploy
        result = json.loads(cluster.cli("run", "Once upon a time", "-n", "12", "--json").stdout)
        assert result["completion_tokens"] == 12 and result["text"]
        listing = on_node(world, server, "ls -d ~/.ggml-cluster/bin/*/ && uname -m").decode()
        assert "-linux-aarch64-cpu-armv8-a/" in listing and listing.strip().endswith("aarch64"), listing
        folder = listing.split()[0].rstrip("/")
        assert elf_machine(on_node(world, server, f"head -c 20 {folder}/ggml-rpc-server")) == ELF_MACHINE_AARCH64
        manifest = json.loads(on_node(world, server, f"cat {folder}/manifest.json"))
        assert manifest["how"] == "cross-built" and manifest["cpu_arch"] == "armv8-a"
        print(f"\nfirst up with a cross-built aarch64 worker: {first_up:.1f}s")
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)


def test_a_worker_built_for_a_richer_cpu_dies_of_sigill_once_and_is_not_restarted(
        world: SshWorld, short_tmp: Path) -> None:
    """A binary built with a Pi 5 / newer -march on a Pi 4: the most common ARM failure in llama.cpp's issues."""
    wrong = worker_binary("cpu", target=Target("linux", "aarch64", RICH_MARCH))
    server = world.emulated_server(Path(tempfile.mkdtemp(prefix="pi4-", dir=world.root)), PI4)
    for name in ("ggml-rpc-server", "manifest.json"):  # as a user would copy a build from another board
        on_node(world, server, f"mkdir -p /opt/llama && cat > /opt/llama/{name} && chmod 755 /opt/llama/{name}",
                (wrong.path.parent / name).read_bytes())
    cluster = mixed(world, short_tmp, server, arm={"build": "{path: /opt/llama/ggml-rpc-server}"}, strategy=None)
    try:
        up = cluster.cli("up", check=False)
        assert up.returncode == 0, up.stderr  # the x86 worker holds the model alone
        deadline = time.monotonic() + 60
        while (node := cluster.status()["nodes"][1])["state"] != "failed":
            assert time.monotonic() < deadline, node
            time.sleep(0.5)
        assert "SIGILL" in node["last_error"] and f"-march={RICH_MARCH}" in node["last_error"], node
        assert "not restarted" in node["last_error"] and "asimddp" not in node["last_error"].split("has:")[1]
        assert node["retry_at"] is None
        time.sleep(12)  # a crash loop's backoff would have restarted it three times by now
        status = cluster.status()
        node = status["nodes"][1]
        # One exit, seen as an exit event or found with the supervisor gone when the worker was next checked.
        exits = [event for event in status["events"] if event["kind"] == "worker-exit" and event["node"] == "n1"]
        starts = [event for event in status["events"] if event["kind"] == "worker" and event["node"] == "n1"]
        assert node["state"] == "failed" and node["restarts"] <= 1 and len(exits) <= 1 and len(starts) == 1, status
        assert all("killed by SIGILL" in event["message"] for event in exits)
        result = json.loads(cluster.cli("run", "Once upon a time", "-n", "4", "--json").stdout)
        assert result["completion_tokens"] == 4
    finally:
        cluster.cli("down", check=False)
    assert gone(cluster)


def test_check_names_the_cross_compiler_to_install_when_this_machine_lacks_it(
        world: SshWorld, short_tmp: Path) -> None:
    """Without it the node would have to build for itself, and this one has no compiler either: one line says both
    ways out, the cross compiler first."""
    server = world.emulated_server(Path(tempfile.mkdtemp(prefix="pi4-", dir=world.root)), PI4)
    cluster = mixed(world, short_tmp, server)
    path = Sshd._path_without(short_tmp / "bin", ("aarch64-linux-gnu-g++", "aarch64-linux-gnu-gcc"))
    cluster.base_env = {**cluster.base_env, "PATH": str(path)}
    check = cluster.cli("check", "--json", check=False)
    assert check.returncode == 1
    arm = {row["name"]: row for row in json.loads(check.stdout)}["n1"]
    assert arm["system"] == "linux/aarch64"
    assert "this machine has no cross compiler for aarch64" in arm["problem"], arm
    assert "apt-get install g++-aarch64-linux-gnu here" in arm["problem"], arm
