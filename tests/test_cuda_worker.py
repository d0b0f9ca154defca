"""The CUDA worker as `make cuda-worker` builds it here, with no GPU: it holds the CUDA backend, and started with no
driver it says so and serves only its CPU device (what the device check must catch).

The build takes most of an hour on 2 cores, so these tests use the cached binary and are skipped, saying how to
build it, only when this machine has none; the code that builds it is tested in tests/test_toolkit.py."""

from __future__ import annotations

import json
import re
import subprocess
import time
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
                    "`make cuda-worker` builds it (35-70 minutes on 2 cores)")
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
    assert b"ggml_backend_cuda_reg" in binary  # the backend's registration, linked in (a static build)
    assert b"sm_" + cuda_architectures().split(";")[0].encode()[:2] in binary  # its device code


def start(binary: Path, seconds: float = 30.0) -> str:
    """What the worker prints until it lists its devices (then it is stopped)."""
    process = subprocess.Popen([str(binary), "-p", str(free_port()), "-t", "1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    try:
        for line in process.stdout:
            lines.append(line)
            if lines[-2:-1] == ["Devices:\n"] or time.monotonic() > deadline:
                break
    finally:
        process.kill()
        process.wait()
    return "".join(lines)


@pytest.mark.skipif(has_driver(), reason="this machine has a CUDA driver: the worker finds its GPUs")
def test_with_no_driver_the_cuda_worker_says_so_and_serves_only_its_cpu(cuda_worker: WorkerBinary) -> None:
    output = start(cuda_worker.path)
    # The captured start on a machine with no driver; what differs between runs is the port and the memory.
    def general(text: str) -> str:
        return re.sub(r"127\.0\.0\.1:\d+|\d+ MiB", "N", text)

    assert general(output) == general(NO_DRIVER.read_text())
