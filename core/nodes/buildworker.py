"""Build (or find cached) this machine's worker for a backend, as `up` would: ``python -m core.nodes.buildworker
cuda``. Prints progress to stderr and, when done, the binary's path and its manifest to stdout; exit 1 with the
one-line reason when the build fails. The Makefile's ``cuda-worker`` target runs it."""

from __future__ import annotations

import argparse
import sys
import time

from core.errors import DeployError
from core.nodes.build import worker_binary


def main(argv: list[str] | None = None) -> int:
    """Build the worker for the backend named on the command line; the exit status says whether it worked."""
    parser = argparse.ArgumentParser(prog="python -m core.nodes.buildworker", description=__doc__)
    parser.add_argument("backend", help="cpu | cuda | rocm | vulkan | metal")
    args = parser.parse_args(argv)
    started = time.monotonic()
    last: list[str] = []

    def progress(message: str, fraction: float | None) -> None:
        # Progress lines come once per compiled file: print a message when it changes, and every 5 %.
        shown = message if fraction is None else f"{message} {fraction:.0%}"
        if fraction is None or not last or last[0] != message or int(fraction * 20) != int(float(last[1]) * 20):
            print(f"[{time.monotonic() - started:7.1f}s] {shown}", file=sys.stderr, flush=True)
            last[:] = [message, str(fraction or 0.0)]

    try:
        binary = worker_binary(args.backend, progress)
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(binary.path)
    print((binary.path.parent / "manifest.json").read_text())
    print(f"took {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
