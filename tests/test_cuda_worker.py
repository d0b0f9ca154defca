"""The CUDA worker as `make cuda-worker` builds it here, with no GPU: it holds the CUDA backend, and started with no
driver it says so and serves only its CPU device (what the device check must catch).

The build takes half an hour on 2 cores (32 minutes measured, at one job), so these tests use the cached binary
and are skipped, saying how to build it, only when this machine has none; the code that builds it is tested in
tests/test_toolkit.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from core.nodes.build import WorkerBinary, build_key, cached_worker, pinned_version
from core.nodes.toolkit import cuda_architectures
from tests.harness import FIXTURES, free_port

pytestmark = pytest.mark.integration
NO_DRIVER = FIXTURES / "rpc-server_startup_cuda-no-driver_pypi-cuda13.0.88_debian12.txt"


@pytest.fixture(scope="module")
def cuda_worker() -> WorkerBinary:
    found = cached_worker("cuda")
    if found is None:
        pytest.skip(f"no CUDA worker is built on this machine ({build_key(pinned_version(), 'cuda')}): "
                    "`make cuda-worker` builds it (about 30 minutes on 2 cores)")
    return found


def has_driver() -> bool:
    ldconfig = subprocess.run(["sh", "-c", "ldconfig -p || /sbin/ldconfig -p"], capture_output=True, text=True,
                              check=False).stdout
    return "libcuda.so.1 " in ldconfig


def test_the_cached_cuda_worker_holds_the_cuda_backend_for_its_architectures(cuda_worker: WorkerBinary) -> None:
    manifest = json.loads((cuda_worker.path.parent / "manifest.json").read_text())
    assert manifest["backend"] == "cuda"
    assert manifest["cuda"]["architectures"] == cuda_architectures()
    binary = cuda_worker.path.read_bytes()
    assert b"ggml_backend_cuda_reg" in binary  # the backend's registration, linked in (a static ggml)
    for architecture in cuda_architectures().split(";"):  # device code for each ("-arch sm_90" in its fatbin)
        assert f"sm_{re.sub(r'[^0-9].*', '', architecture)}".encode() in binary


def run(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The worker run with stdout line-buffered (as a terminal would see it) and killed after 5 s."""
    return subprocess.run(["timeout", "-s", "KILL", "5", "stdbuf", "-oL", str(binary), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def general(text: str) -> str:
    """The output without what differs between runs and machines: the port and the memory."""
    return re.sub(r"127\.0\.0\.1:\d+|\(\d+ MiB, \d+ MiB free\)|CPU: .* \(", "…", text)


@pytest.mark.skipif(has_driver(), reason="this machine has a CUDA driver: the worker finds its GPUs")
def test_with_no_driver_the_cuda_worker_says_so_and_serves_only_its_cpu(cuda_worker: WorkerBinary) -> None:
    started = run(cuda_worker.path, "-p", str(free_port()), "-t", "1")
    assert general(started.stdout) == general(NO_DRIVER.read_text())
    # Asked for a device it lacks, it lists what it has and exits 1: the CUDA failure, then the CPU alone.
    listed = run(cuda_worker.path, "-d", "no-such-device")
    assert listed.returncode == 1
    assert listed.stdout.splitlines()[0] == NO_DRIVER.read_text().splitlines()[0]
    assert [line.split(":")[0].strip() for line in listed.stdout.split("available devices:\n")[1].splitlines()
            if "MiB free" in line] == ["CPU"]
