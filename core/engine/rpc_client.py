"""llama.cpp's RPC client library, as the coordinator and the profiler load it: the workers registered as devices,
and the failed computes they report (ggml-cluster's patch on ggml-rpc)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from core.engine.step import ComputeFailure

# Where llama-cpp-python loads its libraries from, instead of its own lib/ folder.
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"


class _CFailure(ctypes.Structure):
    _fields_ = [("endpoint", ctypes.c_char * 128), ("device", ctypes.c_uint32), ("status", ctypes.c_int32),
                ("failures", ctypes.c_uint32)]  # struct ggml_backend_rpc_compute_failure


class ComputeStatus:
    """The RPC client's record of failed computes reported by the workers, taken after each step.

    A llama-cpp-python built without the patch has no such record: then a failed compute kills the worker and
    this process, as in stock ggml-rpc, and the controller's restart path recovers.
    """

    def __init__(self, rpc: ctypes.CDLL) -> None:
        self._take = getattr(rpc, "ggml_backend_rpc_take_compute_failure", None)
        if self._take is not None:
            self._take.argtypes = [ctypes.POINTER(_CFailure)]
            self._take.restype = ctypes.c_bool

    @property
    def available(self) -> bool:
        """Whether this llama-cpp-python reports failed computes."""
        return self._take is not None

    def take(self) -> ComputeFailure | None:
        """The failure reported since the previous call, if any (an in-process read: no network)."""
        if self._take is None:
            return None
        found = _CFailure()
        if not self._take(ctypes.byref(found)):
            return None
        return ComputeFailure(found.endpoint.decode(errors="replace"), found.device, found.status, found.failures)


def register_rpc_servers(endpoints: tuple[str, ...]) -> ComputeStatus:
    """Register each endpoint as an RPC backend in llama-cpp-python's own ggml registry.

    llama-cpp-python ignores its `rpc_servers` argument. Load the soname files (libggml.so.0): the
    wheel also ships copies without `.0`, and loading those gives a second, empty registry. From the folder
    llama-cpp-python loaded its libraries from: $LLAMA_CPP_LIB_PATH when set (tests/stock.py's stock RPC
    client), else its own lib/.
    """
    import llama_cpp

    override = os.environ.get(LIB_PATH_ENV)  # read as llama-cpp-python reads it: set, even empty, wins
    lib = Path(override) if override is not None else Path(llama_cpp.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(lib / "libggml.so.0"), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so.0"), mode=ctypes.RTLD_GLOBAL)
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register.restype = None
    for endpoint in endpoints:
        registry = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not registry:
            raise RuntimeError(f"ggml_backend_rpc_add_server({endpoint}) returned no backend")
        ggml.ggml_backend_register(registry)
    return ComputeStatus(rpc)
