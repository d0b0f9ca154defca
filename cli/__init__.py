"""ggml-cluster command line: typer commands and rich rendering only."""

from __future__ import annotations

import signal
import sys
from types import FrameType


def _interrupted_at_start(_signum: int, _frame: FrameType | None) -> None:
    sys.stderr.write("interrupted (nothing was started)\n")
    sys.exit(130)


def main() -> None:
    """Console-script entry point: Ctrl-C while the command loads is a line, not a traceback."""
    signal.signal(signal.SIGINT, _interrupted_at_start)
    from cli.app import app

    # Back to Python's own handler: asyncio.run turns it into the cancellation that commands clean up after.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    app()
