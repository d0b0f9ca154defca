"""GPU toolkits for worker builds: the CUDA toolkit (system or PyPI wheels) as CMake arguments, the architectures in
the cache key, the same choices made by a node's shell, and what a ROCm build lacks, in one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from core.errors import DeployError
from core.inventory import Node
from core.nodes import toolkit
from core.nodes.build import build_key, worker_digest
from core.nodes.deploy import _build_on_node
from core.nodes.remote import LocalRemote
from core.nodes.toolkit import (
    ARCHITECTURES_ENV,
    CUDA_WHEELS_RELEASE,
    CUDA_WHEELS_ROOT,
    ROCM_PROBE,
    CudaToolkit,
    RocmFacts,
    backend_cmake_args,
    check_rocm_on,
    cuda_architectures,
    cuda_cmake_args,
    cuda_requirement,
    cuda_toolkit,
    find_driver,
    key_suffix,
    lay_out_toolkit,
    parse_ldconfig,
    parse_nvcc_version,
    parse_rocm_probe,
    remote_toolkit_script,
    rocm_missing,
    toolkit_problems,
)

# The first lines of `nvcc --version` of the nvidia-cuda-nvcc 13.0.88 wheel, and of `ldconfig -p` on Debian 12.
NVCC_VERSION = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""
LDCONFIG = """1187 libs found in cache `/etc/ld.so.cache'
\tlibzstd.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libzstd.so.1
\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1
"""


@pytest.fixture(autouse=True)
def _default_architectures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARCHITECTURES_ENV, raising=False)


def wheels(root: Path) -> Path:
    """The files of NVIDIA's CUDA wheels that matter here, as pip --target leaves them (no links)."""
    cuda = root / CUDA_WHEELS_ROOT
    for path in ("bin/nvcc", "include/cuda_runtime.h", "include/cublas_v2.h", "lib/libcudart.so.13",
                 "lib/libcublas.so.13", "lib/libcublasLt.so.13", "lib/libnvvm.so.4"):
        (cuda / path).parent.mkdir(parents=True, exist_ok=True)
        (cuda / path).write_text("")
    (cuda / "bin" / "nvcc").write_text(f"#!/bin/sh\ncat <<'EOF'\n{NVCC_VERSION}EOF\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    return cuda


def test_architectures_are_explicit_and_default_to_one() -> None:
    assert cuda_architectures() == "90"
    assert cuda_architectures("8.9, 90 90") == "89;90"  # nvidia-smi's compute_cap, commas, repeats
    assert cuda_architectures("86-real;120a") == "86-real;120a"
    for bad in ("native", "all", ""):
        with pytest.raises(DeployError, match="CUDA architecture"):
            cuda_architectures(bad)


def test_the_architectures_are_in_the_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = worker_digest()
    assert build_key("0.3.36", "cuda", "Linux", "x86_64") == f"0.3.36-p{digest}-linux-x86_64-cuda-sm90"
    monkeypatch.setenv(ARCHITECTURES_ENV, "86;89")
    assert build_key("0.3.36", "cuda", "Linux", "x86_64") == f"0.3.36-p{digest}-linux-x86_64-cuda-sm86_89"
    assert build_key("0.3.36", "cpu", "Linux", "x86_64") == f"0.3.36-p{digest}-linux-x86_64-cpu"
    assert key_suffix("vulkan") == "" and key_suffix("cuda", "75") == "-sm75"


def test_the_wheels_become_a_toolkit_with_the_links_nvcc_and_cmake_need(tmp_path: Path) -> None:
    cuda = wheels(tmp_path)
    assert toolkit_problems(cuda) == ["libcudart.so", "libcublas.so", "libcublasLt.so"]
    lay_out_toolkit(cuda, "x86_64-linux")
    lay_out_toolkit(cuda, "x86_64-linux")  # again: nothing changes, nothing fails
    assert toolkit_problems(cuda) == []
    assert os.readlink(cuda / "lib" / "libcublas.so") == "libcublas.so.13"
    assert (cuda / "targets" / "x86_64-linux" / "include" / "cublas_v2.h").is_file()
    assert (cuda / "lib64" / "libcudart.so").exists()
    assert toolkit_problems(tmp_path / "nothing") == ["nvcc", "cuda_runtime.h", "cublas_v2.h", "libcudart.so",
                                                      "libcublas.so", "libcublasLt.so"]


def test_cmake_args_for_a_toolkit_without_a_driver_turn_vmm_off(tmp_path: Path) -> None:
    args = cuda_cmake_args(CudaToolkit(tmp_path, "13.0.88", "pypi", None), "90")
    assert args == (f"-DCUDAToolkit_ROOT={tmp_path}", f"-DCMAKE_CUDA_COMPILER={tmp_path}/bin/nvcc",
                    "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_NO_VMM=ON")
    driver = Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    args = cuda_cmake_args(CudaToolkit(tmp_path, "12.8", "system", driver), "86;89")
    assert "-DGGML_CUDA_NO_VMM=ON" not in args
    assert args[-2:] == ("-DCMAKE_CUDA_ARCHITECTURES=86;89", f"-DCUDA_cuda_driver_LIBRARY={driver}")


def test_the_driver_to_link_is_the_systems_else_the_toolkits_stub(tmp_path: Path) -> None:
    assert parse_ldconfig(LDCONFIG, "libz.so.1") == Path("/lib/x86_64-linux-gnu/libz.so.1")
    assert parse_ldconfig(LDCONFIG, "libz.so") is None
    assert find_driver(tmp_path, LDCONFIG) is None
    (tmp_path / "lib64" / "stubs").mkdir(parents=True)
    (tmp_path / "lib64" / "stubs" / "libcuda.so").write_text("")
    assert find_driver(tmp_path, LDCONFIG) == tmp_path / "lib64" / "stubs" / "libcuda.so"
    driver = LDCONFIG + "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    assert find_driver(tmp_path, driver) == Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1")


def test_nvcc_version() -> None:
    assert parse_nvcc_version(NVCC_VERSION) == "13.0.88"
    assert parse_nvcc_version("nvcc: command not found") is None


def test_a_complete_system_toolkit_wins_an_incomplete_one_falls_back_to_the_wheels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = wheels(tmp_path / "system")
    lay_out_toolkit(system, "x86_64-linux")
    cache = tmp_path / "cache"
    installed = wheels(cache / "toolkits" / f"cuda-{CUDA_WHEELS_RELEASE}")
    lay_out_toolkit(installed, "x86_64-linux")  # as if installed before: no download here
    monkeypatch.setattr(toolkit, "system_candidates", lambda _environ, _nvcc: [system])
    messages: list[str] = []
    found = cuda_toolkit(cache, lambda message, _fraction: messages.append(message))
    assert (found.root, found.source, found.version) == (system, "system", "13.0.88")
    (system / "include" / "cublas_v2.h").unlink()  # like /usr/local/cuda built from the wheels without cuBLAS
    found = cuda_toolkit(cache, lambda message, _fraction: messages.append(message))
    assert (found.root, found.source) == (installed, "pypi")
    assert messages == [f"the system's CUDA toolkit is incomplete ({system} lacks cublas_v2.h): using NVIDIA's CUDA "
                        f"{CUDA_WHEELS_RELEASE} wheels from PyPI"]


def test_the_wheels_are_one_release_of_nvidias_meta_package() -> None:
    assert cuda_requirement() == f"cuda-toolkit[nvcc,crt,nvvm,cudart,cccl,cublas]=={CUDA_WHEELS_RELEASE}"


def this_machines_ldconfig() -> str:
    return subprocess.run(["sh", "-c", "ldconfig -p || /sbin/ldconfig -p"], capture_output=True, text=True,
                          check=False).stdout


def run_remote_script(root: Path, environ: dict[str, str]) -> list[str]:
    script = remote_toolkit_script("cuda", str(root)) + 'printf "%s\\n" "$@"'
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True,
                            env={"PATH": "/usr/bin:/bin:/sbin", **environ})
    return result.stdout.splitlines()


def test_a_node_makes_the_same_choice_with_its_shell(tmp_path: Path) -> None:
    system = wheels(tmp_path / "system")
    lay_out_toolkit(system, "x86_64-linux")
    ldconfig = this_machines_ldconfig()
    expected = cuda_cmake_args(CudaToolkit(system, "", "system", find_driver(system, ldconfig)), "90")
    lines = run_remote_script(tmp_path / "node", {"CUDA_HOME": str(system)})
    assert lines == [f"CUDA toolkit {system} for architectures 90", *expected]
    (system / "lib" / "libcublasLt.so").unlink()  # incomplete: the node's wheels (installed before) instead
    if not toolkit_problems(Path("/usr/local/cuda")):
        pytest.skip("this machine has a complete /usr/local/cuda, which a node's shell prefers to the wheels")
    installed = wheels(tmp_path / "node" / "toolkits" / f"cuda-{CUDA_WHEELS_RELEASE}")
    lay_out_toolkit(installed, "x86_64-linux")
    lines = run_remote_script(tmp_path / "node", {"CUDA_HOME": str(system)})
    assert lines[0] == f"CUDA toolkit {installed} for architectures 90"
    assert lines[1] == f"-DCUDAToolkit_ROOT={installed}"


def test_other_backends_add_nothing_on_a_node() -> None:
    assert remote_toolkit_script("vulkan", "/home/u/.ggml-cluster") == "set --\n"


def test_what_a_rocm_build_lacks_is_one_line() -> None:
    assert rocm_missing(RocmFacts(None, False, False)) == "HIP >= 6.1 (no hipcc), rocBLAS, hipBLAS"
    assert rocm_missing(RocmFacts("6.0.32830-d62f6a171", True, False)) == \
        "HIP >= 6.1 (found 6.0.32830-d62f6a171), hipBLAS"
    assert rocm_missing(RocmFacts("6.1.40091-a8dbc0c19", True, True)) is None
    assert rocm_missing(RocmFacts("7.0.1", True, True)) is None


def test_the_rocm_probe_reads_hip_and_the_cmake_packages(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "hipcc").write_text("#!/bin/sh\necho 'HIP version: 6.0.32830-d62f6a171'\n"
                                            "echo 'AMD clang version 17.0.0'\n")
    (tmp_path / "bin" / "hipcc").chmod(0o755)
    (tmp_path / "lib" / "cmake" / "rocblas").mkdir(parents=True)
    (tmp_path / "lib" / "cmake" / "rocblas" / "rocblas-config.cmake").write_text("")
    result = subprocess.run(["sh", "-c", ROCM_PROBE], capture_output=True, text=True, check=True,
                            env={"PATH": "/usr/bin:/bin", "ROCM_PATH": str(tmp_path)})
    assert parse_rocm_probe(result.stdout) == RocmFacts("6.0.32830-d62f6a171", True, False)


def test_a_rocm_build_that_cannot_work_says_why_before_cmake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))  # nothing there (a distribution's hipcc may be on PATH)
    with pytest.raises(DeployError) as raised:
        backend_cmake_args("rocm", tmp_path, lambda _message, _fraction: None)
    assert raised.value.message.startswith("cannot build the rocm worker here: it needs HIP >= 6.1 (")
    assert raised.value.message.endswith("), rocBLAS, hipBLAS")
    assert "\n" not in str(raised.value)


def test_a_node_builds_its_cuda_worker_with_the_toolkit_its_shell_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole script an SSH node's build runs, with a cmake that only records what it is given."""
    system = wheels(tmp_path / "cuda")
    lay_out_toolkit(system, "x86_64-linux")
    tools, calls = tmp_path / "tools", tmp_path / "cmake-calls"
    tools.mkdir()
    (tools / "cmake").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" == >> {calls}\n'
                                 'if [ "$1" = --build ]; then mkdir -p "$2" && touch "$2/ggml-rpc-server"; fi\n')
    (tools / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin:/sbin")
    monkeypatch.setenv("CUDA_HOME", str(system))
    node = Node(name="gpu", host="192.0.2.7", backend="cuda", build="remote")
    root = tmp_path / "node"
    asyncio.run(_build_on_node(LocalRemote("gpu"), node, str(root), key="k", backend="cuda",
                               progress=lambda _message, _fraction: None))
    configure = calls.read_text().split("==\n")[0].splitlines()
    ldconfig = this_machines_ldconfig()
    toolkit_args = cuda_cmake_args(CudaToolkit(system, "", "system", find_driver(system, ldconfig)), "90")
    assert configure[-len(toolkit_args) - 1:] == ["-DGGML_CUDA=ON", *toolkit_args]
    assert (root / "bin" / "k.partial" / "ggml-rpc-server").is_file()


def test_a_nodes_rocm_is_checked_through_its_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lib" / "cmake" / "hipblas").mkdir(parents=True)
    (tmp_path / "lib" / "cmake" / "hipblas" / "hipblasConfig.cmake").write_text("")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    with pytest.raises(DeployError) as raised:
        asyncio.run(check_rocm_on(LocalRemote("amd"), "on node amd"))
    assert raised.value.message.startswith("cannot build the rocm worker on node amd: it needs HIP >= 6.1 (")
    assert raised.value.message.endswith("), rocBLAS")  # hipBLAS is there
