"""Worker build bookkeeping: keys, protocol version, progress parsing, the cached binary."""

from __future__ import annotations

import pytest

from core.build import build_key, parse_progress, parse_protocol, pinned_version, worker_binary
from core.errors import DeployError
from core.rpc import Version

HEADER = """#pragma once
#define RPC_PROTO_MAJOR_VERSION    7
#define RPC_PROTO_MINOR_VERSION    0
#define RPC_PROTO_PATCH_VERSION    0
"""


def test_protocol_from_header() -> None:
    assert parse_protocol(HEADER) == Version(7, 0, 0)
    with pytest.raises(DeployError, match="RPC_PROTO_MINOR_VERSION"):
        parse_protocol("#define RPC_PROTO_MAJOR_VERSION 7\n")


def test_progress_lines() -> None:
    assert parse_progress("[12/200] /usr/bin/g++ -c x.cpp") == 0.06
    assert parse_progress("[ 45%] Building CXX object") == 0.45
    assert parse_progress("-- Configuring done") is None


def test_key_names_version_os_arch_backend() -> None:
    assert build_key("0.3.36", "cuda", "Linux", "x86_64") == "0.3.36-linux-x86_64-cuda"
    assert build_key("0.3.36", "metal", "Darwin", "arm64") == "0.3.36-darwin-arm64-metal"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(DeployError, match="unknown backend"):
        worker_binary("quantum")


@pytest.mark.integration
def test_cached_worker_matches_the_pinned_coordinator() -> None:
    binary = worker_binary("cpu")
    assert binary.path.is_file() and binary.key.startswith(pinned_version() + "-")
    assert binary.protocol == Version(7, 0, 0)
    assert worker_binary("cpu") == binary  # second call: from the cache
