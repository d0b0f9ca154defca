"""Worker build bookkeeping: keys, protocol version, progress parsing, the cached binary."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.engine.rpc_client import LIB_PATH_ENV
from core.errors import DeployError
from core.inventory import Node
from core.nodes.build import (
    CACHE_ENV,
    WorkerBinary,
    build_key,
    cached_worker,
    failure_reason,
    parse_progress,
    parse_protocol,
    pinned_version,
    worker_binary,
    worker_digest,
    worker_source,
)
from core.nodes.deploy import LEASE_MARKER, decide_deployment, node_lock
from core.nodes.probe import parse_node
from core.nodes.remote import LocalRemote
from core.state import PidRecord
from core.version import Version
from tests.harness import FIXTURES, alive, free_port, listening, small_disk
from tests.stock import installed_libdir, stock_client_libdir, stock_worker

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


def test_key_names_version_flavour_os_arch_backend() -> None:
    digest = worker_digest()
    # A CUDA build's key ends in its GPU architectures (tests/test_toolkit.py): 90 unless told otherwise.
    assert build_key("0.3.36", "cuda", "Linux", "x86_64") == f"0.3.36-p{digest}-linux-x86_64-cuda-sm90"
    assert build_key("0.3.36", "metal", "Darwin", "arm64") == f"0.3.36-p{digest}-darwin-arm64-metal"
    assert build_key("0.3.36", "cpu", "Linux", "x86_64", stock=True) == "0.3.36-stock-linux-x86_64-cpu"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(DeployError, match="unknown backend"):
        worker_binary("quantum")


@pytest.mark.integration
def test_cached_worker_matches_the_pinned_coordinator() -> None:
    binary = worker_binary("cpu")
    assert binary.path.is_file() and binary.key.startswith(f"{pinned_version()}-p{worker_digest()}-")
    assert binary.protocol == Version(7, 0, 0)
    assert manifest(binary)["patches"] == worker_digest()
    assert worker_binary("cpu") == binary  # second call: from the cache


def manifest(binary: WorkerBinary) -> dict[str, object]:
    return json.loads((binary.path.parent / "manifest.json").read_text())


@pytest.mark.integration
def test_a_stock_worker_builds_apart_from_the_patched_one() -> None:
    stock, patched = stock_worker(), worker_binary("cpu")
    assert stock.key == build_key(pinned_version(), "cpu", stock=True) != patched.key
    assert stock.path != patched.path and stock.path.is_file()
    assert manifest(stock)["patches"] == "stock" and stock.protocol == Version(7, 0, 0)
    assert cached_worker("cpu", stock=True) == stock


# Registers a worker as the coordinator does, then prints the files of every libggml-rpc mapped in the process.
MAPPED_RPC = """import pathlib, sys
from core.engine.coordinator import register_rpc_servers
register_rpc_servers((sys.argv[1],))
maps = pathlib.Path("/proc/self/maps").read_text().splitlines()
print("\\n".join(sorted({line.split()[-1] for line in maps if "libggml-rpc" in line})))
"""


@pytest.mark.integration
def test_a_stock_rpc_client_library_folder_for_llama_cpp_python() -> None:
    """The installed libraries with a stock libggml-rpc: it loads and exports the client's entry point; with
    LLAMA_CPP_LIB_PATH naming the folder, llama-cpp-python and the coordinator load it (and not the installed
    one) and register a stock worker with it."""
    libdir = stock_client_libdir()
    assert sorted(path.name for path in libdir.iterdir()) == sorted(path.name for path in installed_libdir().iterdir())
    assert ctypes.CDLL(str(libdir / "libggml-rpc.so.0")).ggml_backend_rpc_add_server
    port = free_port()
    worker = subprocess.Popen([str(stock_worker().path), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not listening(port):
            assert time.monotonic() < deadline, "the stock worker did not listen"
            time.sleep(0.05)
        mapped = subprocess.run([sys.executable, "-c", MAPPED_RPC, f"127.0.0.1:{port}"],
                                env={**os.environ, LIB_PATH_ENV: str(libdir)}, capture_output=True, text=True,
                                check=True, timeout=60).stdout.split()
    finally:
        worker.kill()
        worker.wait()
    assert mapped == [str(libdir / "libggml-rpc.so.0")]


@pytest.fixture
def small_disk_28m() -> Iterator[Path]:
    """A 28 MiB tmpfs: room for the worker's source and a few of its object files, not for the build."""
    folder = Path(tempfile.mkdtemp(prefix="gcd-", dir="/tmp"))
    try:
        with small_disk(folder, "28m") as mount:
            yield mount
    finally:
        folder.rmdir()


@pytest.mark.integration
def test_a_full_disk_during_the_build_is_a_clear_error_and_nothing_half_built_is_kept(
        small_disk_28m: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker_binary("cpu")  # makes sure the source is there to copy
    source = worker_source(pinned_version(), lambda _message, _fraction: None)
    shutil.copytree(source, small_disk_28m / "src" / source.name)
    monkeypatch.setenv(CACHE_ENV, str(small_disk_28m))
    with pytest.raises(DeployError, match="the disk is full") as caught:
        worker_binary("cpu")
    assert CACHE_ENV in str(caught.value)
    assert cached_worker("cpu") is None
    assert not (small_disk_28m / "bin" / build_key(pinned_version(), "cpu")).exists()
    assert not list((small_disk_28m / "bin").glob(".*"))  # no scratch folder left to be mistaken for a build


def test_a_nodes_build_lock_is_a_lease_that_the_next_build_waits_for(tmp_path: Path) -> None:
    lock = tmp_path / "bin" / "key.lock"
    said: list[str] = []

    async def take_turns() -> tuple[list[str], int]:
        order = []
        async with node_lock(LocalRemote("a"), str(lock), lambda message, _: said.append(message)):
            owner = PidRecord.read(lock / "owner")
            assert owner is not None and owner.running(LEASE_MARKER)

            async def second() -> None:
                async with node_lock(LocalRemote("b"), str(lock), lambda message, _: said.append(message)):
                    order.append("b")

            waiting = asyncio.create_task(second())
            for _ in range(400):  # until the second one says that it waits
                if said:
                    break
                await asyncio.sleep(0.05)
            order.append("a")
        await waiting
        return order, owner.pid

    order, first = asyncio.run(take_turns())
    assert order == ["a", "b"]
    assert said == [f"waiting for another build on b (pid {first})"]
    assert not lock.exists()


def test_a_followed_command_ends_with_its_whole_process_group() -> None:
    """A build's compilers are children of children of the command: stopping it must reach them too."""
    async def follow_then_stop() -> list[int]:
        lines = LocalRemote("n").follow("sh -c 'sleep 300 & echo $!; wait' & sleep 300 & echo $!; wait")
        pids = [int(await anext(lines)), int(await anext(lines))]
        await lines.aclose()
        return pids

    pids = asyncio.run(follow_then_stop())
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)


def test_a_node_without_cmake_or_a_compiler_is_told_one_command_that_installs_both(tmp_path: Path) -> None:
    os_release = (FIXTURES / "probe" / "os-release_debian-12-bookworm_which-distro.txt").read_text()
    facts = parse_node(f"==uname==\nLinux x86_64\n==os-release==\n{os_release}\n")
    assert facts.toolchain.cmake is None and facts.toolchain.cxx is None
    node = Node(name="n0", host="192.0.2.7", backend="cpu", build="remote")
    with pytest.raises(DeployError) as failed:
        asyncio.run(decide_deployment(LocalRemote("n0"), node, facts, str(tmp_path), frozenset()))
    assert str(failed.value) == ("node n0: cmake and c++ not found, needed to build the worker there "
                                 "(fix: sudo apt-get install -y cmake build-essential)")


@pytest.mark.parametrize(("capture", "reason"), [
    ("cmake-configure_vulkan-sdk-missing_debian12-cmake3.25.txt",
     "Could NOT find Vulkan (missing: Vulkan_LIBRARY Vulkan_INCLUDE_DIR glslc)"),
    ("cmake-configure_cuda-no-gpu-no-cublas_debian12-cmake3.25.txt",
     'CUDA_ARCHITECTURES is set to "native", but no GPU was detected.'),
])
def test_why_a_configure_failed_is_cmakes_message_not_its_last_error_line(capture: str, reason: str) -> None:
    """Real output of configuring the worker project (Debian 12, cmake 3.25, no Vulkan SDK; CUDA 13 without a
    GPU or cuBLAS), whose last line with "error" in it is "-- Configuring incomplete, errors occurred!"."""
    lines = (FIXTURES / "cmake" / capture).read_text().splitlines()
    assert failure_reason(lines) == reason


def test_why_a_compile_failed_is_the_first_compiler_error_the_cause_of_the_rest() -> None:
    """Real output of building llama.cpp's unguarded ggml-vulkan.cpp against Debian 12's Vulkan headers (1.3.239,
    no VK_EXT_layer_settings) with gcc 12 and ninja: six errors follow from the first, the last is a symptom."""
    capture = FIXTURES / "cmake" / "cmake-build_vulkan-headers-1.3.239-layer-settings-unguarded_debian12-gcc12.txt"
    reason = failure_reason(capture.read_text().splitlines())
    # gcc quotes names in U+2018 and U+2019 under a UTF-8 locale.
    assert reason is not None and reason.endswith(
        "ggml-vulkan.cpp:5214:21: error: \u2018LayerSettingEXT\u2019 is not a member of \u2018vk\u2019")
    lines = ["[3/40] Building CXX object a.o", "FAILED: a.o", "c++ -Werror=format -c /src/a.cpp",
             "/src/a.cpp: In function 'int main()':", "/src/a.cpp:1:1: error: 'x' was not declared",
             "/src/a.cpp:2:1: error: 'y' was not declared", "ninja: build stopped: subcommand failed."]
    assert failure_reason(lines) == "/src/a.cpp:1:1: error: 'x' was not declared"
    assert failure_reason(["/src/b.c:1:10: fatal error: vulkan/vulkan.h: No such file or directory",
                           "compilation terminated."]) == "/src/b.c:1:10: fatal error: vulkan/vulkan.h: No such file " \
        "or directory"
    # No compiler diagnostic: the last line that names an error (make's own).
    assert failure_reason(["make[2]: *** [a.o] Error 1", "make: *** [all] Error 2"]) == "make: *** [all] Error 2"
    assert failure_reason(["[1/2] ok"]) is None
