"""The RPC protocol version a worker or coordinator speaks, and ggml-rpc's rule for which ones work together."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Version:
    """An RPC protocol version."""

    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    def compatible_with(self, client: Version) -> bool:
        """The rule the client applies (ggml-rpc.cpp negotiate_hello): same major, server minor not newer."""
        return self.major == client.major and self.minor <= client.minor
