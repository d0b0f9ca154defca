"""The controller's own listeners (relays, API, metrics) never take a worker's port."""

from __future__ import annotations

import asyncio
import socket

import pytest

from core.endpoints.prometheus import serve_metrics
from core.listener import ATTEMPTS, bound_socket, open_clear_of
from core.rpc.relay import RelayHost
from core.status import ClusterStatus

EVERY_PORT = range(1, 65536)


class Offers:
    """Listeners on the ports a kernel offers in turn, with the ones closed."""

    def __init__(self, ports: list[int]) -> None:
        self.ports, self.closed = ports, []

    def open(self) -> int:
        return self.ports.pop(0)

    def close(self, port: int) -> None:
        self.closed.append(port)


def test_a_listener_that_lands_on_a_workers_port_is_closed_and_opened_again() -> None:
    offers = Offers([50052, 50053, 41234])
    assert open_clear_of({50052, 50053}, offers.open, int, offers.close) == 41234
    assert offers.closed == [50052, 50053]
    untouched = Offers([50052])
    assert open_clear_of((), untouched.open, int, untouched.close) == 50052 and untouched.closed == []


def test_when_every_offer_is_a_workers_port_the_listener_fails_as_a_port_in_use() -> None:
    offers = Offers([50052] * ATTEMPTS)
    with pytest.raises(OSError, match="every port the kernel offered was a worker's"):
        open_clear_of({50052}, offers.open, int, offers.close)
    assert offers.closed == [50052] * ATTEMPTS


def test_a_bound_socket_is_on_a_port_the_kernel_picked_outside_the_reserved() -> None:
    with bound_socket("127.0.0.1", {1, 2, 3}) as sock:
        assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] not in (0, 1, 2, 3)
        sock.listen()
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass
    with pytest.raises(OSError):
        bound_socket("127.0.0.1", EVERY_PORT)


def test_relays_and_metrics_keep_off_the_reserved_ports() -> None:
    """Reserving every port shows that each asks the kernel through the check (the API: tests/test_api_auth.py);
    their own tests serve as they do unreserved."""
    relays = RelayHost(EVERY_PORT)

    async def main() -> None:
        with pytest.raises(OSError):
            await relays.relay(("127.0.0.1", 1), print)
        with pytest.raises(OSError):
            serve_metrics("127.0.0.1", 0, ClusterStatus, asyncio.get_running_loop(), None, reserved=EVERY_PORT)
        await relays.close([])

    asyncio.run(main())
