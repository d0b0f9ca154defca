"""The test harness's own promises, where breaking one shows up elsewhere only as a rare flake."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.harness import Cluster, ephemeral_ports, free_port


def test_free_ports_are_ones_the_kernel_never_hands_out_itself() -> None:
    """A port from the kernel's ephemeral range can be taken between the test choosing it and its worker binding
    it: by the controller's relays, metrics or API (all bound to port 0) or by any outgoing connection. The node
    then fails to start ("port ... already in use") and the cluster runs without it (a CI failure of
    test_api_auth)."""
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(port >= 1024 and port not in ephemeral for port in ports), ports
    for port in ports:  # and nobody listens there
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_node_left_out_fails_the_test_with_its_reason(tmp_path: Path) -> None:
    """`up` succeeds on the nodes that start; a test that then looks for the missing node's worker is told why it
    is missing (it used to end in a bare StopIteration)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        cluster = Cluster(tmp_path, nodes=2, ports=[holder.getsockname()[1], free_port()])
        try:
            assert "running on 1 of 2 nodes" in cluster.cli("up").stderr
            missing = r"node n0 has no worker folder: failed, node n0: port \d+ on localhost is already in use"
            with pytest.raises(AssertionError, match=missing):
                cluster.worker_dir("n0")
            assert cluster.worker_dir("n1").is_dir()
        finally:
            cluster.cli("down", check=False)
