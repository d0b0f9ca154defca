"""SSH nodes against real OpenSSH sshd servers on loopback: deploy, run, fail clearly, stay on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import DeployError
from core.inventory import Node
from core.nodes.build import build_key, pinned_version, project_name, worker_digest
from core.nodes.ssh import SshRemote
from core.state import PidRecord, process_start
from tests.harness import Cluster, alive, free_port, run_with_fault, small_disk
from tests.sshd import NEEDS_SSHD, SshWorld, keygen, running_world
from tests.test_cluster import PROMPT, single_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900), NEEDS_SSHD]


@pytest.fixture(scope="module")
def world() -> Iterator[SshWorld]:
    yield from running_world("gcs-", 3)


def ssh_lines(world: SshWorld, index: int, **override: str) -> list[str]:
    server = world.servers[index]
    fields = {"host": "127.0.0.1", "port": str(server.port), "user": "root", "identity": str(world.identity),
              **override}
    return [f"{key}: {value}" for key, value in fields.items()]


def ssh_cluster(world: SshWorld, root: Path, nodes: int = 3, overrides: dict[int, dict[str, str]] | None = None,
                extra: dict[int, list[str]] | None = None) -> Cluster:
    lines = [ssh_lines(world, index, **(overrides or {}).get(index, {})) for index in range(nodes)]
    return Cluster(root, nodes=nodes, ssh=lines, extra=extra, base_env=world.env(),
                   defaults=[f"workdir: {root / 'node root'}"])


def listeners(port: int) -> set[str]:
    """Addresses with a listening TCP socket on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address)
    return found


@pytest.fixture
def short_root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gcn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_three_ssh_nodes_up_run_status_down(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root)
    try:
        cluster.cli("up")
        status = cluster.status()
        assert [node["state"] for node in status["nodes"]] == ["ready"] * 3
        for node in status["nodes"]:
            assert node["kind"] == "ssh" and node["backend"] == "cpu" and node["arch"]
            assert "worker" in node["detail"]
        assert [node["layers"] for node in status["nodes"]] == [[0, 2], [3, 5], [6, 7]]
        # RPC rides the SSH connections: every worker listens on the node's loopback only.
        for port in cluster.ports:
            assert listeners(port) == {"127.0.0.1"}
        result = json.loads(cluster.cli("run", PROMPT, "-n", "64", "--json").stdout)
        model = json.loads((cluster.state / "launch.json").read_text())["model"]
        assert result["text"] == single_process(model, PROMPT, 64)["text"]

        pids = [cluster.worker_pid(f"n{index}") for index in range(3)]
        started = time.monotonic()
        again = cluster.cli("up")
        elapsed = time.monotonic() - started
        assert "already up" in again.stderr
        assert [cluster.worker_pid(f"n{index}") for index in range(3)] == pids
        assert elapsed < 30
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []
    assert not any(listeners(port) for port in cluster.ports)


def test_controller_restart_adopts_ssh_workers_without_redeploying(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=2)
    try:
        cluster.cli("up")
        pids = [cluster.worker_pid(f"n{index}") for index in range(2)]
        os.kill(cluster.controller_pid(), signal.SIGKILL)
        cluster.cli("up")
        assert [cluster.worker_pid(f"n{index}") for index in range(2)] == pids
        events = [event["message"] for event in cluster.status()["events"]]
        assert sum("adopted" in message for message in events) == 2
        assert any("worker cached" in message for message in events)
        # The adopted workers are sampled on their nodes over SSH: memory at once, CPU from the second sample.
        deadline = time.monotonic() + 15
        nodes = cluster.status()["nodes"]
        while not all(node["rss"] and node["cpu_percent"] is not None for node in nodes):
            assert time.monotonic() < deadline, f"no metrics from the ssh nodes: {nodes}"
            time.sleep(0.5)
            nodes = cluster.status()["nodes"]
        assert all(1 << 20 < node["rss"] < node["mem_total"] for node in nodes)
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []


FAILURES = {
    "unreachable": ({"port": "PORT"}, "n1: node n1: cannot reach root@127.0.0.1:{port}"),
    "wrong key": ({"identity": "OTHER_KEY"}, "n1: node n1: authentication failed for root@127.0.0.1"),
    "unknown host key": ({"host_key": "strict", "port": "UNKNOWN_HOST"}, "n1: node n1: the host key of"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_bad_node_is_reported_and_the_rest_runs(world: SshWorld, short_root: Path, case: str) -> None:
    override, expected = FAILURES[case]
    override = dict(override)
    if override.get("port") == "PORT":
        override["port"] = str(free_port())
    if override.get("port") == "UNKNOWN_HOST":
        stranger = world.extra_server(short_root / "stranger")
        override["port"] = str(stranger.port)
    if override.get("identity") == "OTHER_KEY":
        other = short_root / "other_key"
        keygen(other)
        override["identity"] = str(other)
    cluster = ssh_cluster(world, short_root, nodes=2, overrides={1: override})
    message = expected.format(port=override.get("port"))
    try:
        result = cluster.cli("up")
        assert "running on 1 of 2 nodes" in result.stderr and message in result.stderr
        nodes = cluster.status()["nodes"]
        assert nodes[0]["state"] == "ready" and nodes[1]["failures"] >= 1 and nodes[1]["layers"] is None
        cluster.cli("down")
        strict = cluster.cli("up", "--require-all", check=False)
        assert strict.returncode == 1 and message in strict.stderr
    finally:
        cluster.cli("down", check=False)


def test_accept_new_records_an_unknown_host_key(world: SshWorld, short_root: Path) -> None:
    stranger = world.extra_server(short_root / "stranger")
    known_hosts = world.home / ".ssh" / "known_hosts"
    before = known_hosts.read_text()
    cluster = ssh_cluster(world, short_root, nodes=1,
                          overrides={0: {"port": str(stranger.port), "host_key": "accept-new"}})
    try:
        cluster.cli("up")
        assert f"[127.0.0.1]:{stranger.port} ssh-ed25519" in known_hosts.read_text()
    finally:
        cluster.cli("down", check=False)
        known_hosts.write_text(before)


@pytest.mark.parametrize("policy", ["accept-new", "strict"])
def test_a_changed_host_key_is_named_as_a_possible_attack_with_the_way_to_clear_it(
        world: SshWorld, short_root: Path, policy: str) -> None:
    server = world.extra_server(short_root / "reinstalled")
    known_hosts = world.home / ".ssh" / "known_hosts"
    before = known_hosts.read_text()
    old_key = " ".join(keygen(short_root / "old_host_key").split()[:2])  # what the host had before
    known_hosts.write_text(before + f"[127.0.0.1]:{server.port} {old_key}\n")
    cluster = ssh_cluster(world, short_root, nodes=1, overrides={0: {"port": str(server.port), "host_key": policy}})
    try:
        result = cluster.cli("up", check=False)
        recorded = known_hosts.read_text()
    finally:
        cluster.cli("down", check=False)
        known_hosts.write_text(before)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert f"node n0: the host key of root@127.0.0.1:{server.port} has changed" in errors[0]
    assert "may be an attack" in errors[0] and f"ssh-keygen -R '[127.0.0.1]:{server.port}'" in errors[0]
    assert recorded == before + f"[127.0.0.1]:{server.port} {old_key}\n"  # accept-new never replaces a key


def test_accept_new_records_a_host_once_for_two_nodes_on_it(world: SshWorld, short_root: Path) -> None:
    server = world.extra_server(short_root / "shared")
    known_hosts = world.home / ".ssh" / "known_hosts"
    before = known_hosts.read_text()
    on_it = {"port": str(server.port), "host_key": "accept-new"}
    cluster = ssh_cluster(world, short_root, nodes=2, overrides={0: on_it, 1: on_it})
    try:
        result = cluster.cli("check", check=False)
        recorded = known_hosts.read_text()
    finally:
        known_hosts.write_text(before)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line for line in recorded.splitlines() if line.startswith(f"[127.0.0.1]:{server.port} ")] == [
        server.known_hosts_line()]


def test_missing_cmake_on_the_node_names_the_fix(world: SshWorld, short_root: Path) -> None:
    bare = world.extra_server(short_root / "bare", without=("cmake",), trusted=True)
    cluster = ssh_cluster(world, short_root, nodes=1,
                          overrides={0: {"port": str(bare.port)}}, extra={0: ["build: remote"]})
    try:
        result = cluster.cli("up", check=False)
        assert result.returncode == 1
        assert "n0: cmake not found, needed to build the worker there" in result.stderr
        assert "apt-get install" in result.stderr
    finally:
        cluster.cli("down", check=False)


def test_port_in_use_on_the_node(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=2)
    squatter = socket.create_server(("127.0.0.1", cluster.ports[1]))
    try:
        result = cluster.cli("up", "--require-all", check=False)
        assert result.returncode == 1
        assert f"port {cluster.ports[1]} on 127.0.0.1 is already in use by another process" in result.stderr
    finally:
        squatter.close()
        cluster.cli("down", check=False)


def test_shell_metacharacters_in_every_field_execute_nothing_and_no_key_is_written(
        world: SshWorld, short_root: Path) -> None:
    """Paths and labels may hold anything and are quoted; users and hosts are refused by the inventory.
    Whatever --debug prints or the cluster writes holds no part of the private key."""
    canary = short_root / "PWNED"
    hostile = f"a b;touch {canary};$(touch {canary})`touch {canary}`|touch {canary}&"
    cluster = ssh_cluster(world, short_root, nodes=2)
    text = cluster.inventory.read_text().replace(f"workdir: {short_root / 'node root'}",
                                                 f"workdir: '{short_root}/{hostile}'")
    text = text.replace("  - name: n1\n", f"  - name: n1\n    build: {{path: '{short_root}/{hostile}/bin'}}\n")
    text = text.replace("  - name: n0\n", f"  - name: n0\n    labels: {{note: '{hostile}'}}\n")
    cluster.inventory.write_text(text)
    try:
        up = cluster.cli("--debug", "up")
        assert "n1: node n1: build.path" in up.stderr and "is not an executable file on the node" in up.stderr
        run = cluster.cli("--debug", "run", PROMPT, "-n", "4")
        assert Path(f"{short_root}/{hostile}").is_dir()
        for field, value in (("user", "root"), ("host", "127.0.0.1")):  # refused before anything runs
            cluster.inventory.write_text(text.replace(f"{field}: {value}", f"{field}: '{value};{hostile}'", 1))
            refused = cluster.cli("up", check=False)
            assert refused.returncode == 2 and f".{field}: " in refused.stderr
    finally:
        cluster.inventory.write_text(text)
        down = cluster.cli("--debug", "down", check=False)
    assert not canary.exists()
    key = [line for line in world.identity.read_text().splitlines() if "PRIVATE KEY" not in line]
    written = [up.stdout + up.stderr, run.stdout + run.stderr, down.stdout + down.stderr]
    written += [path.read_text(errors="replace") for path in short_root.rglob("*") if path.is_file()]
    assert not any(line in blob for line in key for blob in written)


def test_an_encrypted_identity_is_used_through_ssh_agent_and_its_passphrase_is_never_needed(
        world: SshWorld, short_root: Path) -> None:
    passphrase = "correct horse battery staple"
    key = short_root / "locked_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(key)], check=True)
    with world.authorized.open("a") as handle:
        handle.write(Path(f"{key}.pub").read_text())
    cluster = ssh_cluster(world, short_root, nodes=1, overrides={0: {"identity": str(key)}})
    locked = cluster.cli("--debug", "check", "--json", check=False)
    problem = json.loads(locked.stdout)[0]["problem"]
    assert locked.returncode == 1
    assert f"cannot use identity {key}: Passphrase must be specified" in problem and f"ssh-add {key}" in problem
    agent_socket = short_root / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(agent_socket)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not agent_socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        askpass = short_root / "askpass"
        askpass.write_text(f"#!/bin/sh\necho '{passphrase}'\n")
        askpass.chmod(0o700)
        subprocess.run(["ssh-add", str(key)], stdin=subprocess.DEVNULL, capture_output=True, check=True,
                       env={**os.environ, "SSH_AUTH_SOCK": str(agent_socket), "SSH_ASKPASS": str(askpass),
                            "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"})
        askpass.unlink()
        cluster.base_env["SSH_AUTH_SOCK"] = str(agent_socket)
        unlocked = cluster.cli("--debug", "check")
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    assert "ready to run a worker" in unlocked.stderr
    written = [locked.stdout + locked.stderr, unlocked.stdout + unlocked.stderr]
    written += [path.read_text(errors="replace") for path in short_root.rglob("*") if path.is_file()]
    assert not any(passphrase in blob for blob in written)


@pytest.fixture
def full_disk(short_root: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: less than the worker's source archive."""
    mount = short_root / "full"
    mount.mkdir()
    with small_disk(mount, "1m"):
        yield mount


def test_a_full_disk_on_the_node_is_named_and_leaves_no_partial_file(world: SshWorld, short_root: Path,
                                                                       full_disk: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=1, overrides={0: {"workdir": str(full_disk)}},
                          extra={0: ["build: remote"]})
    try:
        result = cluster.cli("up", check=False)
        assert result.returncode == 1
        assert "node n0: the disk is full" in result.stderr and "set its workdir to a larger disk" in result.stderr
        assert not [path for path in full_disk.rglob("*") if path.is_file()]
    finally:
        cluster.cli("down", check=False)


def upload_to(world: SshWorld, port: int, source: Path, destination: Path) -> None:
    """SshRemote.upload of ``source`` to ``destination`` on the sshd at ``port`` (this machine), mode 0755."""
    node = Node(name="n0", host="127.0.0.1", port=port, user="root", identity=str(world.identity))

    async def upload() -> None:
        remote = SshRemote(node)
        await remote.connect()
        try:
            await remote.upload(source, str(destination), 0o755)
        finally:
            await remote.close()

    asyncio.run(upload())


def test_a_node_without_sftp_gets_the_file_over_a_plain_session_whole_or_not_at_all(
        world: SshWorld, short_root: Path, full_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropbear and minimal sshds have no SFTP subsystem: the file goes through `cat` on an exec channel, to a
    folder made for it, under a path that holds anything; on a full disk the disk is named and no part is left."""
    server = world.extra_server(world.root / f"no-sftp-{short_root.name}", trusted=True, sftp=False)
    monkeypatch.setenv("HOME", str(world.home))  # its known_hosts
    source = short_root / "ggml-rpc-server"
    source.write_bytes(os.urandom(3 << 20))
    canary = short_root / "PWNED"
    destination = short_root / f"a b;touch {canary};$(touch {canary})'" / "bin" / "ggml-rpc-server"
    upload_to(world, server.port, source, destination)
    assert destination.read_bytes() == source.read_bytes()
    assert stat.S_IMODE(destination.stat().st_mode) == 0o755
    assert [path.name for path in destination.parent.iterdir()] == ["ggml-rpc-server"] and not canary.exists()
    with pytest.raises(DeployError, match=r"node n0: the disk is full: ggml-rpc-server needs 3 MiB, .* has 1 MiB free"):
        upload_to(world, server.port, source, full_disk / "bin" / "ggml-rpc-server")
    assert not [path for path in full_disk.rglob("*") if path.is_file()]


def test_up_and_run_on_a_node_without_sftp(world: SshWorld, short_root: Path) -> None:
    server = world.extra_server(world.root / f"no-sftp-{short_root.name}", trusted=True, sftp=False)
    cluster = ssh_cluster(world, short_root, nodes=2,
                          overrides={1: {"port": str(server.port), "workdir": str(short_root / "no-sftp root")}})
    try:
        cluster.cli("up")
        status = cluster.status()
        assert [node["state"] for node in status["nodes"]] == ["ready"] * 2
        assert "worker pushed" in status["nodes"][1]["detail"]  # its own workdir: not the other node's copy
        result = json.loads(cluster.cli("run", PROMPT, "-n", "16", "--json").stdout)
        model = json.loads((cluster.state / "launch.json").read_text())["model"]
        assert result["text"] == single_process(model, PROMPT, 16)["text"]
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []


def test_check_reports_every_node_without_starting_anything(world: SshWorld, short_root: Path) -> None:
    bare = world.extra_server(world.root / f"bare-{short_root.name}", without=("cmake",), trusted=True)
    cluster = ssh_cluster(world, short_root, nodes=3, overrides={1: {"port": str(bare.port)}},
                          extra={1: ["build: remote"], 2: ["identity: /nonexistent/key"]})
    squatter = socket.create_server(("127.0.0.1", cluster.ports[0]))
    try:
        result = cluster.cli("check", "--json", check=False)
    finally:
        squatter.close()
    assert result.returncode == 1
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["n0"]["system"].startswith("linux/") and rows["n0"]["backend"] == "cpu"
    assert rows["n0"]["problem"] == f"port {cluster.ports[0]} is in use by another process"
    assert "cmake not found" in rows["n1"]["problem"] and "apt-get install" in rows["n1"]["problem"]
    assert "identity file /nonexistent/key does not exist" in rows["n2"]["problem"]
    assert "3 of 3 nodes have problems" in result.stderr
    assert cluster.processes() == [] and not (cluster.state / "controller.pid").exists()
    table = cluster.cli("check", check=False).stdout
    assert "n0" in table and "cmake not found" in table


def test_a_build_path_that_is_a_folder_is_refused_before_anything_runs(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=1, extra={0: [f"build: {{path: {short_root}}}"]})
    result = cluster.cli("check", "--json", check=False)
    assert result.returncode == 1
    assert f"build.path {short_root} is not an executable file" in json.loads(result.stdout)[0]["problem"]


def test_ssh_config_alias_is_honoured(world: SshWorld, short_root: Path) -> None:
    server = world.servers[0]
    config = world.home / ".ssh" / "config"
    config.write_text(f"Host node-alias\n  HostName 127.0.0.1\n  Port {server.port}\n  User root\n"
                      f"  IdentityFile {world.identity}\n")
    cluster = Cluster(short_root, nodes=1, ssh=[["host: node-alias"]], base_env=world.env(),
                      defaults=[f"workdir: {short_root / 'node root'}"])
    try:
        result = cluster.cli("check")
        assert "ready to run a worker" in result.stderr
    finally:
        config.unlink()


def test_direct_transport_is_opt_in_and_warns(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=1, extra={0: ["transport: direct"]})
    try:
        result = cluster.cli("up")
        assert f"transport: direct exposes the worker's unauthenticated RPC port on 127.0.0.1:{cluster.ports[0]}" \
            in result.stderr
        # No tunnel and no relay: the coordinator connects to the worker's own port.
        worker_port = f"127.0.0.1:{cluster.ports[0]}"
        status = cluster.status()
        assert status["nodes"][0]["endpoint"] == worker_port and status["nodes"][0]["link"] == "direct"
        expected = json.loads(cluster.cli("run", PROMPT, "-n", "240", "--json").stdout)["text"]
        config = json.loads(Path(f"/proc/{cluster.status()['coordinator']['pid']}/cmdline").read_text()
                            .split("\0")[3])
        assert config["endpoints"] == [worker_port]
        # Without a relay, a worker's death still reaches the coordinator, and the request resumes.
        result, text, _ = run_with_fault(cluster, PROMPT, "240",
                                         lambda: os.kill(cluster.worker_pid("n0"), signal.SIGKILL))
        assert result.returncode == 0, result.stderr
        assert text == expected + "\n" and "recovering:" in result.stderr
    finally:
        cluster.cli("down", check=False)


def test_a_dropped_rpc_connection_is_reopened_and_the_request_resumes(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=1)
    try:
        cluster.cli("up")
        expected = json.loads(cluster.cli("run", PROMPT, "-n", "240", "--json").stdout)["text"]
        # The controller's connection (commands, sampling) came first; the relays' own one for RPC after it.
        control, rpc = world.servers[0].connections()[-2:]
        result, text, _ = run_with_fault(cluster, PROMPT, "240", lambda: os.kill(rpc, signal.SIGKILL))
        assert result.returncode == 0, result.stderr
        assert text == expected + "\n" and "recovering:" in result.stderr
        now = world.servers[0].connections()
        assert control in now and rpc not in now and now[-1] != control  # reopened; the other one untouched
        node = cluster.status()["nodes"][0]
        assert node["restarts"] == 0 and node["state"] == "ready"  # the worker itself was never down
    finally:
        cluster.cli("down", check=False)


def test_killed_worker_on_an_ssh_node_resumes_with_identical_text(world: SshWorld, short_root: Path) -> None:
    cluster = ssh_cluster(world, short_root, nodes=2)
    try:
        cluster.cli("up")
        expected = json.loads(cluster.cli("run", PROMPT, "-n", "480", "--json").stdout)["text"]
        victim = cluster.worker_pid("n1")
        result, text, _ = run_with_fault(cluster, PROMPT, "480", lambda: os.kill(victim, signal.SIGKILL))
        assert result.returncode == 0, result.stderr
        assert text == expected + "\n"
        assert "recovering:" in result.stderr
        events = [event["kind"] for event in cluster.status()["events"]]
        assert "worker-exit" in events and "recovered" in events
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []


def wait_for_node(cluster: Cluster, name: str, state: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        node = next(node for node in cluster.status()["nodes"] if node["name"] == name)
        if node["state"] == state:
            return node
        assert time.monotonic() < deadline, f"{name} is {node['state']}, not {state}: {node['last_error']}"
        time.sleep(0.2)


def test_a_dropped_ssh_connection_is_reopened_and_the_running_worker_adopted(world: SshWorld,
                                                                             short_root: Path) -> None:
    node = world.extra_server(world.root / f"blip-{short_root.name}", trusted=True)
    cluster = ssh_cluster(world, short_root, nodes=2, overrides={1: {"port": str(node.port)}})
    try:
        cluster.cli("up")
        expected = json.loads(cluster.cli("run", PROMPT, "-n", "480", "--json").stdout)["text"]
        worker = cluster.worker_pid("n1")
        result, text, _ = run_with_fault(cluster, PROMPT, "480", node.drop_connections)  # every one of them
        assert result.returncode == 0, result.stderr
        assert text == expected + "\n"
        status = wait_for_node(cluster, "n1", "ready")
        assert status["restarts"] == 0 and cluster.worker_pid("n1") == worker  # the worker was never touched
        events = [event["kind"] for event in cluster.status()["events"]]
        assert "node-reconnecting" in events and "node-reconnected" in events
        assert json.loads(cluster.cli("run", PROMPT, "-n", "480", "--json").stdout)["text"] == expected
    finally:
        cluster.cli("down", check=False)
    assert cluster.processes() == []


def test_down_names_a_node_it_cannot_reach_and_the_worker_it_left_running(world: SshWorld,
                                                                          short_root: Path) -> None:
    node = world.extra_server(world.root / f"gone-{short_root.name}", trusted=True)
    cluster = ssh_cluster(world, short_root, nodes=2, overrides={1: {"port": str(node.port)}})
    try:
        cluster.cli("up")
        worker = cluster.worker_pid("n1")
        connections = node.connections()
        node.stop_listening()
        for pid in connections:  # and every connection cut: the machine is gone
            os.kill(pid, signal.SIGKILL)
        wait_for_node(cluster, "n1", "reconnecting")
        down = cluster.cli("down", check=False)
        assert down.returncode == 1, down.stderr
        assert "n1" in down.stderr and "could not reach" in down.stderr
        assert f"its worker (pid {worker}) may still be running" in down.stderr
        assert alive(worker)
        node.start()  # the node is back: the next `down` finishes the job
        again = cluster.cli("down")
        assert "stopped leftover workers: n1" in again.stderr
    finally:
        if node.process.poll() is not None:
            node.start()
        cluster.cli("down", check=False)
    assert cluster.processes() == []


def leftovers(root: Path) -> list[str]:
    """Processes of this machine that work under ``root``: their command line names it, or their folder is
    in it (ninja runs in the build folder with a command line that does not say so)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            folder = os.readlink(proc / "cwd")
        except OSError:
            continue
        if command and (str(root) in command or folder.startswith(str(root))):
            found.append(f"{proc.name}: {command}")
    return found


def test_ctrl_c_during_a_remote_build_stops_the_compilers_and_the_next_up_builds(
        world: SshWorld, short_root: Path) -> None:
    """A node that builds its own worker: Ctrl-C stops the compilers, and the next `up` finishes the build from the
    patched source and serves. (One test for both: a remote build is a minute of this machine's two cores.)"""
    cluster = ssh_cluster(world, short_root, nodes=1, extra={0: ["build: remote"]})
    try:
        up = cluster.popen("up")
        deadline = time.monotonic() + 300
        while not any(" -c " in line and "ggml" in line for line in leftovers(short_root / "node root" / "src")):
            assert up.poll() is None and time.monotonic() < deadline, "the remote build did not start compiling"
            time.sleep(0.2)
        up.send_signal(signal.SIGINT)
        _, stderr = Cluster.finish(up, timeout=120)
        assert up.returncode == 130, stderr
        deadline = time.monotonic() + 5
        while leftovers(short_root) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leftovers(short_root) == [], "the interrupted build goes on"
        try:
            again = cluster.cli("up", timeout=400)  # the build again, from where it stopped
        except subprocess.TimeoutExpired:
            pytest.fail("the next up still waits on the interrupted build's lock after 400 s")
        assert "waiting" not in again.stderr
        node = cluster.status()["nodes"][0]
        assert node["state"] == "ready" and "worker built" in node["detail"], node
        logs = list(short_root.glob("node root/bin/*.build.log"))
        assert logs and "ggml-rpc-server" in logs[0].read_text()
        # Built from the patched source, both keyed by the patches' digest.
        key = build_key(pinned_version(), "cpu")
        assert json.loads((short_root / "node root" / "bin" / key / "manifest.json").read_text())["patches"] == \
            worker_digest()
        assert (short_root / "node root" / "src" / project_name(pinned_version()) / "CMakeLists.txt").is_file()
        assert cluster.cli("run", PROMPT, "-n", "8").returncode == 0
    finally:
        cluster.cli("down", check=False)
    assert leftovers(short_root) == []


@pytest.mark.parametrize("owner", ["dead", "not ours", "none, 2 minutes old"])
def test_a_build_lock_whose_owner_is_gone_is_taken_over_at_once(world: SshWorld, short_root: Path,
                                                                owner: str) -> None:
    """A node's build lock as an interrupted `up` leaves it: its owner (the process that held it) is dead, or
    its pid is somebody else's by now, or it has no owner (the previous version's locks)."""
    cluster = ssh_cluster(world, short_root, nodes=1, extra={0: ["build: push"]})
    lock = short_root / "node root" / "bin" / f"{build_key(pinned_version(), 'cpu')}.lock"
    lock.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        if owner == "dead":
            gone = subprocess.Popen(["true"])
            gone.wait()
            (lock / "owner").write_text(f"{gone.pid} {process_start(sleeper.pid)}\n")
        elif owner == "not ours":
            (lock / "owner").write_text(PidRecord.of(sleeper.pid).text())
        else:
            os.utime(lock, (time.time() - 120, time.time() - 120))
        started = time.monotonic()
        try:
            cluster.cli("up", timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"up still waits on the lock {lock} after 90 s")
        assert time.monotonic() - started < 60
        assert "worker pushed" in cluster.status()["nodes"][0]["detail"]
        assert sleeper.poll() is None and not lock.exists()
    finally:
        cluster.cli("down", check=False)
        sleeper.kill()
        sleeper.wait()
