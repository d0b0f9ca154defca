"""The GPU toolkits a worker build needs beyond cmake and a C++ compiler: CUDA (found, or installed from PyPI) and
ROCm (found, or said in one line what is missing).

CUDA: the system's toolkit when it is complete (nvcc, the runtime and cuBLAS: ggml-cuda links cuBLAS), else
NVIDIA's own CUDA wheels from PyPI installed once into the cache (``toolkits/cuda-13.0.2``), which need no GPU
and no root. The wheels are not laid out as a toolkit: nvcc looks for headers and libraries under
``targets/<arch>-linux/`` and CMake links the unversioned ``libcublas.so``, which the wheels do not ship, so the
install adds those links. No wheel has a ``libcuda.so`` (the driver, or its stub): without one to link the build
sets GGML_CUDA_NO_VMM, and the worker then loads the driver at run time through the CUDA runtime. The GPU
architectures are always explicit, never CMake's ``native``, which fails with no GPU at build time and would
hide what the binary runs on; they are part of the build's cache key.
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.errors import DeployError
from core.nodes.shell import Remote

ARCHITECTURES_ENV = "GGML_CLUSTER_CUDA_ARCHITECTURES"
# One architecture keeps the build near half an hour on 2 cores (32 min measured; each more costs about as much). 90 is
# Hopper (H100/H200), the datacenter GPU this project's GPU checks run on: real code for it starts at once, and
# CMake's plain "90" also embeds PTX that the driver compiles for newer GPUs (Blackwell) on first use. PTX is never
# run on an older GPU: for Ampere/Ada (RTX 30xx/40xx, A100, L4) set GGML_CLUSTER_CUDA_ARCHITECTURES, e.g. "80"
# (real code that runs on every 8.x GPU) or "86;89" (each, tuned, twice the build time).
DEFAULT_ARCHITECTURES = "90"
# The cuda-toolkit meta-package pins one consistent set of component wheels per release: nvcc 13.0.88, cudart
# 13.0.96, cccl 13.0.85, cuBLAS 13.1.0.3. 13.0 is the release measured building the pinned llama.cpp, and the
# oldest CUDA 13: its binaries run with any driver from R580 on.
CUDA_WHEELS_RELEASE = "13.0.2"
CUDA_WHEELS_EXTRAS = ("nvcc", "crt", "nvvm", "cudart", "cccl", "cublas")
# Where the wheels put the toolkit, under pip's --target folder.
CUDA_WHEELS_ROOT = "nvidia/cu13"
# nvcc's folder of headers and libraries for its target, by `uname -m` (CUDA's own names; sbsa = ARM servers).
CUDA_TARGET_DIRS = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}
CUDA_LIBRARIES = ("cudart", "cublas", "cublasLt")
HIP_MINIMUM = (6, 1)  # ggml-hip's own check (FATAL_ERROR "At least ROCM/HIP V6.1 is required")

Progress = Callable[[str, float | None], None]
_ARCHITECTURE = re.compile(r"\d{2,3}[af]?(-real|-virtual)?")


@dataclass(frozen=True)
class CudaToolkit:
    """A CUDA toolkit a worker can be built with: ``driver`` is the libcuda to link (None: GGML_CUDA_NO_VMM)."""

    root: Path
    version: str
    source: str  # system | pypi
    driver: Path | None


def cuda_architectures(value: str | None = None) -> str:
    """The GPU architectures to build for, as CMake wants them (``86;90``): ``value``, else
    $GGML_CLUSTER_CUDA_ARCHITECTURES, else DEFAULT_ARCHITECTURES. Commas or spaces may separate them, and
    compute capabilities as nvidia-smi prints them (``8.9``) are read as 89; ``native`` is refused."""
    raw = value if value is not None else os.environ.get(ARCHITECTURES_ENV) or DEFAULT_ARCHITECTURES
    items = [item.replace(".", "") for item in re.split(r"[;,\s]+", raw.strip()) if item]
    bad = [item for item in items if not _ARCHITECTURE.fullmatch(item)]
    if bad or not items:
        raise DeployError(f"bad CUDA architecture list {raw!r}" + (f" ({', '.join(bad)})" if bad else ""),
                          f"fix: set ${ARCHITECTURES_ENV} to compute capabilities such as 86;90 (nvidia-smi "
                          "--query-gpu=compute_cap), never native: it needs a GPU at build time")
    return ";".join(dict.fromkeys(items))


def key_suffix(backend: str, architectures: str | None = None) -> str:
    """What a build's cache key adds for ``backend``: ``-sm90`` / ``-sm86_90`` for cuda (the architectures change
    the binary), nothing for the others."""
    if backend != "cuda":
        return ""
    return "-sm" + "_".join(cuda_architectures(architectures).split(";"))


def toolkit_problems(root: Path) -> list[str]:
    """What the folder lacks to be a CUDA toolkit ggml-cuda builds with (empty: nothing)."""
    problems = [] if (root / "bin" / "nvcc").is_file() else ["nvcc"]
    includes = _include_dirs(root)
    problems += [header for header in ("cuda_runtime.h", "cublas_v2.h")
                 if not any((folder / header).is_file() for folder in includes)]
    problems += [f"lib{name}.so" for name in CUDA_LIBRARIES
                 if not any((folder / f"lib{name}.so").exists() for folder in _library_dirs(root))]
    return problems


def _include_dirs(root: Path) -> list[Path]:
    return [root / "include", *sorted(root.glob("targets/*/include")), root / "math_libs" / "include"]


def _library_dirs(root: Path) -> list[Path]:
    # The last: a distribution's toolkit with root /usr (Debian's nvidia-cuda-toolkit) keeps them by multiarch.
    return [root / "lib64", root / "lib", *sorted(root.glob("targets/*/lib")), root / "math_libs" / "lib64",
            *sorted(root.glob("lib/*-linux-gnu"))]


def system_candidates(environ: dict[str, str], nvcc: str | None) -> list[Path]:
    """Folders that may hold the system's CUDA toolkit, best first: $CUDA_HOME, $CUDA_PATH, the toolkit of the
    nvcc on PATH (its folder's parent, links resolved), /usr/local/cuda."""
    candidates = [Path(environ[name]) for name in ("CUDA_HOME", "CUDA_PATH") if environ.get(name)]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    return list(dict.fromkeys(candidates))


def parse_nvcc_version(text: str) -> str | None:
    """The release from `nvcc --version` (``Cuda compilation tools, release 13.0, V13.0.88`` → 13.0.88)."""
    match = re.search(r"release [\d.]+, V(\d+(?:\.\d+)*)", text) or re.search(r"release (\d+(?:\.\d+)*)", text)
    return match.group(1) if match else None


def parse_ldconfig(text: str, name: str) -> Path | None:
    """The path of library ``name`` (e.g. libcuda.so.1) in `ldconfig -p` output, None when it is not listed."""
    for line in text.splitlines():
        library, _, path = line.partition("=>")
        if library.strip().split(" ", 1)[0] == name and path.strip():
            return Path(path.strip())
    return None


def find_driver(root: Path, ldconfig: str) -> Path | None:
    """The libcuda the build can link: the driver's (``ldconfig -p``), else the toolkit's stub; None when there
    is neither, as with the PyPI wheels."""
    for name in ("libcuda.so", "libcuda.so.1"):
        found = parse_ldconfig(ldconfig, name)
        if found is not None:
            return found
    return next((folder / "stubs" / "libcuda.so" for folder in _library_dirs(root)
                 if (folder / "stubs" / "libcuda.so").is_file()), None)


def cuda_cmake_args(toolkit: CudaToolkit, architectures: str) -> tuple[str, ...]:
    """The CMake arguments that build ggml-cuda with this toolkit for these architectures."""
    args = [f"-DCUDAToolkit_ROOT={toolkit.root}", f"-DCMAKE_CUDA_COMPILER={toolkit.root / 'bin' / 'nvcc'}",
            f"-DCMAKE_CUDA_ARCHITECTURES={architectures}"]
    if toolkit.driver is None:
        args.append("-DGGML_CUDA_NO_VMM=ON")  # nothing to link for the driver API's memory calls
    else:
        args.append(f"-DCUDA_cuda_driver_LIBRARY={toolkit.driver}")  # a driver's libcuda.so.1 has no dev link
    return tuple(args)


def cuda_toolkit(cache: Path, progress: Progress) -> CudaToolkit:
    """The system's complete CUDA toolkit, else the PyPI one in ``cache``/toolkits (installed on first use)."""
    ldconfig = _output(["ldconfig", "-p"]) or _output(["/sbin/ldconfig", "-p"]) or ""
    incomplete = []
    for root in system_candidates(dict(os.environ), shutil.which("nvcc")):
        if not (root / "bin" / "nvcc").is_file():
            continue
        problems = toolkit_problems(root)
        if problems:
            incomplete.append(f"{root} lacks {', '.join(problems)}")
            continue
        return CudaToolkit(root, _nvcc_version(root) or "unknown", "system", find_driver(root, ldconfig))
    if incomplete:
        progress(f"the system's CUDA toolkit is incomplete ({'; '.join(incomplete)}): using NVIDIA's CUDA "
                 f"{CUDA_WHEELS_RELEASE} wheels from PyPI", None)
    root = install_cuda_wheels(cache / "toolkits", progress)
    return CudaToolkit(root, _nvcc_version(root) or CUDA_WHEELS_RELEASE, "pypi", find_driver(root, ldconfig))


def _nvcc_version(root: Path) -> str | None:
    return parse_nvcc_version(_output([str(root / "bin" / "nvcc"), "--version"]) or "")


def install_cuda_wheels(toolkits: Path, progress: Progress, machine: str | None = None) -> Path:
    """NVIDIA's CUDA wheels (compiler, runtime, CCCL, cuBLAS) installed with pip into
    ``toolkits/cuda-<release>`` and laid out as a toolkit; returns its root. Done once: the folder appears only
    complete."""
    home = toolkits / f"cuda-{CUDA_WHEELS_RELEASE}"
    root = home / CUDA_WHEELS_ROOT
    if not toolkit_problems(root):
        return root
    machine = (machine or platform.machine()).lower()
    if machine not in CUDA_TARGET_DIRS:
        raise DeployError(f"NVIDIA's CUDA wheels are not made for {machine}",
                          "fix: install the CUDA toolkit (with cuBLAS) on this machine")
    toolkits.mkdir(parents=True, exist_ok=True)
    # Builds for other architectures may want it at the same time: one installs, the others wait and reuse it.
    with (toolkits / f"{home.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if toolkit_problems(root):
            _install(home, machine, progress)
    return root


def _install(home: Path, machine: str, progress: Progress) -> None:
    scratch = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
    try:
        progress(f"installing NVIDIA's CUDA {CUDA_WHEELS_RELEASE} compiler and cuBLAS from PyPI (about 500 MB)", None)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
             "--target", str(scratch), cuda_requirement()], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DeployError(f"cannot install the CUDA wheels from PyPI: {last}",
                              "fix: install the CUDA toolkit (with cuBLAS), or let pip reach PyPI")
        lay_out_toolkit(scratch / CUDA_WHEELS_ROOT, CUDA_TARGET_DIRS[machine])
        problems = toolkit_problems(scratch / CUDA_WHEELS_ROOT)
        if problems:
            raise DeployError(f"the CUDA {CUDA_WHEELS_RELEASE} wheels lack {', '.join(problems)}",
                              "fix: install the CUDA toolkit (with cuBLAS) on this machine")
        shutil.rmtree(home, ignore_errors=True)
        scratch.replace(home)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cuda_requirement() -> str:
    """The pip requirement of the toolkit's wheels: ``cuda-toolkit[nvcc,…,cublas]==13.0.2``."""
    return f"cuda-toolkit[{','.join(CUDA_WHEELS_EXTRAS)}]=={CUDA_WHEELS_RELEASE}"


def lay_out_toolkit(root: Path, target_dir: str) -> None:
    """Add the links that make the wheels' files a toolkit: ``targets/<target_dir>/{include,lib}`` and ``lib64``
    (where nvcc and CMake look), and an unversioned ``libX.so`` for each ``libX.so.N`` (what the linker takes)."""
    targets = root / "targets" / target_dir
    targets.mkdir(parents=True, exist_ok=True)
    for name in ("include", "lib"):
        _link(targets / name, Path("..", "..", name))
    _link(root / "lib64", Path("lib"))
    for library in sorted((root / "lib").glob("lib*.so.*")):
        stem = library.name.split(".so.", 1)[0] + ".so"
        if not (root / "lib" / stem).exists():
            _link(root / "lib" / stem, Path(library.name))


def _link(path: Path, to: Path) -> None:
    if not path.is_symlink() and not path.exists():
        path.symlink_to(to)


def _output(command: Sequence[str]) -> str | None:
    try:
        result = subprocess.run(list(command), capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


# The same choices as `cuda_toolkit` and `cuda_cmake_args`, made on a node by its shell (a node has no ggml-cluster):
# a complete system toolkit, else the wheels installed by the node's python3 into its own toolkits folder. Leaves
# the CMake arguments in "$@"; says why not on a line with "error:" and exits 1.
_REMOTE_CUDA = r"""tk=
has() { for g in "$@"; do [ -e "$g" ] && return 0; done; return 1; }
nvcc_root=$(n=$(command -v nvcc) && readlink -f "$n" | sed 's|/bin/nvcc$||')
for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$nvcc_root" /usr/local/cuda; do
    [ -n "$c" ] && [ -f "$c/bin/nvcc" ] || continue
    ok=1
    for f in cuda_runtime.h cublas_v2.h; do
        has "$c"/include/$f "$c"/targets/*/include/$f "$c"/math_libs/include/$f || ok=
    done
    for f in @LIBRARIES@; do
        has "$c"/lib64/$f "$c"/lib/$f "$c"/targets/*/lib/$f "$c"/math_libs/lib64/$f "$c"/lib/*-linux-gnu/$f || ok=
    done
    [ -n "$ok" ] && { tk=$c; break; }
done
if [ -z "$tk" ]; then
    home=@TOOLKITS@/cuda-@RELEASE@; tk=$home/@WHEELS_ROOT@
    if [ ! -f "$tk/bin/nvcc" ] || [ ! -e "$tk/lib/libcublas.so" ]; then
        case $(uname -m) in @TARGET_CASES@ *) echo "error: no CUDA toolkit with cuBLAS here, and NVIDIA makes no CUDA \
wheels for $(uname -m)"; exit 1;; esac
        echo "installing NVIDIA's CUDA @RELEASE@ compiler and cuBLAS from PyPI (about 500 MB)"
        rm -rf "$home.partial"
        python3 -m pip install --quiet --disable-pip-version-check --no-compile --target "$home.partial" \
            '@REQUIREMENT@' || { echo "error: no CUDA toolkit with cuBLAS here, and python3 -m pip cannot install \
the CUDA wheels"; exit 1; }
        w=$home.partial/@WHEELS_ROOT@
        mkdir -p "$w/targets/$t" && ln -sfn ../../include "$w/targets/$t/include" &&
            ln -sfn ../../lib "$w/targets/$t/lib" && ln -sfn lib "$w/lib64" || exit 1
        for f in "$w"/lib/lib*.so.*; do [ -e "${f%%.so.*}.so" ] || ln -s "${f##*/}" "${f%%.so.*}.so"; done
        rm -rf "$home" && mv "$home.partial" "$home" || exit 1
    fi
fi
drv=$({ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null |
    awk '$1 == "libcuda.so" || $1 == "libcuda.so.1" {print $NF; exit}')
[ -n "$drv" ] || drv=$(ls "$tk"/lib64/stubs/libcuda.so "$tk"/lib/stubs/libcuda.so "$tk"/targets/*/lib/stubs/libcuda.so \
    2>/dev/null | head -n 1)
set -- "-DCUDAToolkit_ROOT=$tk" "-DCMAKE_CUDA_COMPILER=$tk/bin/nvcc" "-DCMAKE_CUDA_ARCHITECTURES=@ARCHITECTURES@"
if [ -n "$drv" ]; then set -- "$@" "-DCUDA_cuda_driver_LIBRARY=$drv"; else set -- "$@" -DGGML_CUDA_NO_VMM=ON; fi
echo "CUDA toolkit $tk for architectures @ARCHITECTURES@"
"""


def remote_toolkit_script(backend: str, root: str, architectures: str | None = None) -> str:
    """POSIX sh that a node's worker build runs first, in the subshell that then runs cmake: for cuda it finds or
    installs the toolkit there (under ``root``/toolkits) and leaves its CMake arguments in ``"$@"``; for the other
    backends it empties ``"$@"``."""
    if backend != "cuda":
        return "set --\n"
    cases = " ".join(f"{machine}) t={folder};;" for machine, folder in CUDA_TARGET_DIRS.items())
    values = {"TOOLKITS": shlex.quote(f"{root}/toolkits"), "TARGET_CASES": cases, "WHEELS_ROOT": CUDA_WHEELS_ROOT,
              "REQUIREMENT": cuda_requirement(), "RELEASE": CUDA_WHEELS_RELEASE,
              "LIBRARIES": " ".join(f"lib{name}.so" for name in CUDA_LIBRARIES),
              "ARCHITECTURES": cuda_architectures(architectures)}
    return re.sub(r"@([A-Z_]+)@", lambda match: values[match.group(1)], _REMOTE_CUDA)


@dataclass(frozen=True)
class RocmFacts:
    """What a ROCm build needs, as found: the HIP version (None: no hipcc) and whether rocBLAS and hipBLAS are
    there for CMake (their package config files)."""

    hip_version: str | None
    rocblas: bool
    hipblas: bool


# Where ggml-hip looks (its CMakeLists: $ROCM_PATH, else /opt/rocm, else /usr), what HIP it is, and whether CMake's
# find_package finds rocBLAS and hipBLAS there. The same command runs here and on a node (POSIX sh).
ROCM_PROBE = r"""p=${ROCM_PATH:-}; [ -n "$p" ] || { [ -d /opt/rocm ] && p=/opt/rocm || p=/usr; }
{ "$p/bin/hipcc" --version || hipcc --version; } 2>/dev/null | grep 'HIP version'
for n in rocblas hipblas; do
    for f in "$p"/lib/cmake/$n/*onfig.cmake "$p"/lib64/cmake/$n/*onfig.cmake "$p"/lib/*-linux-gnu/cmake/$n/*onfig.cmake
    do [ -f "$f" ] && { echo "$n: $f"; break; }; done
done
true"""


def parse_rocm_probe(text: str) -> RocmFacts:
    """RocmFacts from the output of ROCM_PROBE."""
    version = re.search(r"HIP version:\s*(\S+)", text)
    found = {line.split(":", 1)[0].strip() for line in text.splitlines()}
    return RocmFacts(version.group(1) if version else None, "rocblas" in found, "hipblas" in found)


def rocm_missing(facts: RocmFacts) -> str | None:
    """What a ROCm build lacks, in one line (``HIP >= 6.1 (found 5.2.21153), rocBLAS, hipBLAS``); None when
    nothing."""
    missing = []
    version = tuple(int(part) for part in re.findall(r"\d+", facts.hip_version or "")[:2])
    if facts.hip_version is None:
        missing.append("HIP >= 6.1 (no hipcc)")
    elif version < HIP_MINIMUM:
        missing.append(f"HIP >= 6.1 (found {facts.hip_version})")
    missing += [name for name, found in (("rocBLAS", facts.rocblas), ("hipBLAS", facts.hipblas)) if not found]
    return ", ".join(missing) or None


def check_rocm(facts: RocmFacts, where: str = "here") -> None:
    """Raise DeployError naming, in one line, what a ROCm build lacks ``where`` (before cmake spends time)."""
    missing = rocm_missing(facts)
    if missing:
        raise DeployError(f"cannot build the rocm worker {where}: it needs {missing}",
                          "fix: install ROCm 6.1 or newer with its rocblas and hipblas development packages "
                          "(and set ROCM_PATH if it is not in /opt/rocm)")


async def check_rocm_on(remote: Remote, where: str) -> None:
    """`check_rocm` for a node (a local one too), through its shell."""
    check_rocm(parse_rocm_probe((await remote.run(ROCM_PROBE)).stdout), where)


def backend_cmake_args(backend: str, cache: Path, progress: Progress) -> tuple[tuple[str, ...], dict[str, object]]:
    """The CMake arguments a backend's toolkit adds on this machine, and what the manifest records of it: for
    cuda the toolkit (found or installed) and the architectures; for rocm nothing, after checking that the build
    can succeed (DeployError otherwise); for the others nothing."""
    if backend == "rocm":
        check_rocm(parse_rocm_probe(_output(["/bin/sh", "-c", ROCM_PROBE]) or ""))
        return (), {}
    if backend != "cuda":
        return (), {}
    architectures = cuda_architectures()
    toolkit = cuda_toolkit(cache, progress)
    progress(f"CUDA {toolkit.version} ({toolkit.source}, {toolkit.root}) for architectures {architectures}"
             + ("" if toolkit.driver else "; no libcuda to link, so GGML_CUDA_NO_VMM"), None)
    return cuda_cmake_args(toolkit, architectures), {
        "cuda": {"architectures": architectures, "toolkit": toolkit.source, "version": toolkit.version,
                 "root": str(toolkit.root), "vmm": toolkit.driver is not None}}
