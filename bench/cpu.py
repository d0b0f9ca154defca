"""Where a bench's CPU time goes on this machine: CPU seconds by kind of process, from /proc, read before and after
a request.

Every process of a bed shares this machine's cores (the nodes' network namespaces share its PID namespace), so
one reading of /proc covers the workers, each node's sshd, the controller (its relays' thread included), the
coordinator and whatever else ran (the client, the delay proxies, this bench), and /proc/stat gives the whole
machine's busy time, which says whether the cores were saturated. Kernel tick resolution (10 ms a process), so
read it over a request of many tokens.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.nodes.sample import parse_proc

TICK = os.sysconf("SC_CLK_TCK")
KINDS = ("workers", "sshd", "controller", "coordinator")


def kind_of(comm: str, cmdline: list[str]) -> str | None:
    """Which kind of bench process this is (None: another one)."""
    if comm == "ggml-rpc-server":
        return "workers"
    if comm.startswith("sshd"):
        return "sshd"
    if "-m" in cmdline:  # the controller and the coordinator run as `python -m MODULE`
        after = cmdline.index("-m") + 1
        module = cmdline[after] if after < len(cmdline) else ""
        if module == "core.controller":
            return "controller"
        if module.startswith("core.engine."):
            return "coordinator"
    return None


@dataclass
class Usage:
    """CPU seconds so far: per live process (by pid, with its kind) and the machine's busy time."""

    busy_s: float
    processes: dict[int, tuple[str, float]] = field(default_factory=dict)


def sample() -> Usage:
    """The machine's busy CPU time and each bench process's user + system time, now."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[:7])
    usage = Usage(busy_s=(user + nice + system + irq + softirq) / TICK)  # not steal: another guest's time
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone between the listing and the read
            continue
        kind = kind_of(stat[stat.index("(") + 1:stat.rindex(")")], cmdline)
        cpu_s = parse_proc(f"{stat.strip()}\n{TICK}")[0] if kind is not None else None
        if kind is not None and cpu_s is not None:
            usage.processes[int(entry.name)] = (kind, cpu_s)
    return usage


def spent(before: Usage, after: Usage) -> dict[str, float]:
    """CPU seconds each kind spent between two samples (a process that started in between counts from zero; one
    that ended is lost to its kind but not to ``machine``), and the machine's busy seconds as ``machine``."""
    totals = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, seconds) in after.processes.items():
        then = before.processes.get(pid)
        totals[kind] += seconds - (then[1] if then is not None and then[0] == kind else 0.0)
    totals["machine"] = after.busy_s - before.busy_s
    return totals
