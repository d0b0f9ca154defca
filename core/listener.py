"""Listening on a port the kernel picks, never one of the cluster's worker ports.

A worker that has not started yet does not hold its port, and the kernel may hand that very port to any bind to
port 0 on the machine: the controller's relays, API or metrics endpoint. The worker then could not start ("port
in use by another process") until `down`. That happens only for ports in the kernel's ephemeral range, where
llama.cpp's customary 50052 lies.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Collection
from typing import TypeVar

ATTEMPTS = 32  # the kernel picks at random from thousands of ports: a few tries always find another
Listener = TypeVar("Listener")


def open_clear_of(reserved: Collection[int], open_listener: Callable[[], Listener],
                  port_of: Callable[[Listener], int], close: Callable[[Listener], None]) -> Listener:
    """A listener from ``open_listener`` (bound to port 0) whose port is none of ``reserved``: one that lands
    on such a port is closed and opened again. Raises OSError(EADDRINUSE) if every try lands on one."""
    for _ in range(ATTEMPTS):
        listener = open_listener()
        if port_of(listener) not in reserved:
            return listener
        close(listener)
    raise OSError(errno.EADDRINUSE, f"every port the kernel offered was a worker's ({ATTEMPTS} tries)")


def bound_socket(host: str, reserved: Collection[int]) -> socket.socket:
    """A TCP socket bound to ``host`` on a port the kernel picks, none of ``reserved``; the caller listens on
    it (asyncio's and aiohttp's servers take it as it is)."""
    family, kind, protocol, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                            flags=socket.AI_PASSIVE)[0]

    def bind() -> socket.socket:
        sock = socket.socket(family, kind, protocol)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        return sock

    return open_clear_of(reserved, bind, lambda sock: int(sock.getsockname()[1]), socket.socket.close)
