"""Starting the engine's child processes: the coordinator and the profiler run apart from the controller,
because llama.cpp's RPC client aborts the process when a worker goes away."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `core`


async def start(module: str, argument: str, log: IO[bytes], *, stdin: bool) -> asyncio.subprocess.Process:
    """``python -m module argument`` with piped stdout (its protocol) and stderr to ``log`` (llama.cpp's)."""
    # ggml's abort handler attaches gdb and prints a backtrace on stdout, the protocol channel.
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, argument,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=log, cwd=str(ROOT), env={**os.environ, "GGML_NO_BACKTRACE": "1"})
