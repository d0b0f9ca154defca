"""Stock llama.cpp parts (without our patches), for compatibility tests and benchmarks: a stock worker, and a
library folder that gives llama-cpp-python a stock RPC client.

A Python process with ``LLAMA_CPP_LIB_PATH=<stock_client_libdir()>`` runs llama-cpp-python (and the coordinator,
which loads the RPC library from the same folder) with llama.cpp's own RPC client against our workers; a
``stock_worker()`` serves our coordinator as an unpatched peer would.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from core.nodes.build import WorkerBinary, cache_dir, pinned_version, worker_binary, worker_source
from core.nodes.patches import flavour

RPC_LIBRARY = "libggml-rpc.so"
# As the wheel's own libraries (llama-cpp-python's CMakeLists): shared, found next to each other ($ORIGIN).
LIBRARY_FLAGS = ("-DBUILD_SHARED_LIBS=ON", "-DGGML_RPC=ON", "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN")


def stock_worker() -> WorkerBinary:
    """This machine's stock ggml-rpc-server (cpu), built once and cached."""
    return worker_binary("cpu", stock=True)


def installed_libdir() -> Path:
    """The installed llama-cpp-python's lib/ folder (found without loading it)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama-cpp-python is not installed; run `make setup`")
    return Path(spec.origin).parent / "lib"


def stock_client_libdir() -> Path:
    """A copy of the installed llama-cpp-python's lib/ folder whose RPC library (libggml-rpc.so and its
    versioned names) is built from the stock source: the same source, so the same ABI as the libraries around it.

    Keyed by the version and the installed wheel's patches (the rest of the folder is that wheel's); built once.
    """
    version = pinned_version()
    home = cache_dir() / "lib" / f"{version}-{flavour()}-stock-rpc"
    if home.is_dir():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with (home.parent / f"{home.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test run waits for the first one's build
        if not home.is_dir():
            built = _build_stock_rpc_library(version)
            scratch = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
            try:
                shutil.copytree(installed_libdir(), scratch / "lib")
                for library in (scratch / "lib").glob(f"{RPC_LIBRARY}*"):
                    stock = built / library.name
                    if not stock.exists():
                        raise RuntimeError(f"the stock build has no {library.name} (in {built})")
                    library.unlink()
                    shutil.copy2(stock, library)  # the file itself, as the wheel holds it, not a link
                (scratch / "lib").replace(home)  # complete, or not there at all
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return home


def _build_stock_rpc_library(version: str) -> Path:
    """Build the ggml-rpc shared library from the stock worker project; the folder it lands in."""
    project = worker_source(version, lambda _message, _fraction: None, stock=True)
    build = cache_dir() / "build" / f"{version}-stock-rpc-library"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for command in (["cmake", "-S", str(project), "-B", str(build), *generator, *LIBRARY_FLAGS],
                    ["cmake", "--build", str(build), "--target", "ggml-rpc", "--parallel", str(os.cpu_count() or 1)]):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    found = sorted(build.rglob(f"{RPC_LIBRARY}.*"))
    if not found:
        raise RuntimeError(f"the stock build made no {RPC_LIBRARY} in {build}")
    return found[0].parent
