"""What a worker uses on its node (CPU time, resident memory, GPU busy and memory): read there by one
shell script, parsed here; and the CPU time of a process of this machine."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from core.nodes.gpus import Gpu, parse_nvidia_smi_csv, parse_rocm_smi_csv
from core.nodes.probe import make_script, split_sections
from core.nodes.shell import shell_command

NVIDIA_USE_FIELDS = ("index", "name", "memory.total", "memory.free", "utilization.gpu")


@dataclass(frozen=True)
class Sample:
    """One reading of a worker process on its node."""

    pid: int
    cpu_s: float | None   # CPU time the process has used since it started
    rss: int | None       # resident memory, bytes
    gpus: tuple[Gpu, ...] = ()


def sample_command(workdir: str, backend: str) -> str:
    """A POSIX sh script that reads the worker's pid file and prints its usage in ``==name==`` sections.

    Linux gives CPU time in clock ticks (/proc, 10 ms resolution); elsewhere (macOS) `ps` gives it to the
    hundredth of a second. GPU tools are asked only on nodes whose worker uses that GPU.
    """
    sections = [
        ("pid", "echo $pid"),
        # Shell builtins where they do: the sample runs every few seconds, next to the decode's threads.
        ("proc", 'read -r stat < /proc/$pid/stat && echo "$stat" && getconf CLK_TCK && '
                 'while read -r key value unit; do [ "$key" = VmRSS: ] && echo "$key $value $unit"; '
                 "done < /proc/$pid/status"),
        ("ps", "[ -r /proc/$pid/stat ] || ps -o rss=,time= -p $pid"),
    ]
    if backend == "cuda":
        sections.append(("nvidia-smi", f"nvidia-smi --query-gpu={','.join(NVIDIA_USE_FIELDS)} "
                                        "--format=csv,noheader,nounits"))
    elif backend == "rocm":
        sections.append(("rocm-smi", "rocm-smi --showuse --showmeminfo vram --csv"
                                     " || /opt/rocm/bin/rocm-smi --showuse --showmeminfo vram --csv"))
    folder = shell_command([workdir])
    # `read`, not $(cat …): no subshell and no process of its own next to the decode. Its status is
    # ignored: a pid file without a final newline still sets the variable. The file is "PID START".
    return (f'pid=; {{ read -r pid _ < {folder}/worker.pid; }} 2>/dev/null; [ -n "$pid" ] || exit 0\n'
            f'{make_script(sections)}')


def parse_sample(text: str) -> Sample | None:
    """The sample script's output as a Sample; None when no worker was running."""
    sections = split_sections(text)
    pid = sections.get("pid", "").strip()
    if not pid.isdigit():
        return None
    cpu_s, rss = parse_proc(sections.get("proc", ""))
    if cpu_s is None and rss is None:
        cpu_s, rss = parse_ps(sections.get("ps", ""))
    gpus = (parse_nvidia_smi_csv(sections.get("nvidia-smi", ""), NVIDIA_USE_FIELDS)
            + parse_rocm_smi_csv(sections.get("rocm-smi", "")))
    return Sample(int(pid), cpu_s, rss, gpus)


def parse_proc(text: str) -> tuple[float | None, int | None]:
    """CPU seconds and resident bytes from `/proc/PID/stat`, `getconf CLK_TCK` and the VmRSS line."""
    lines = text.splitlines()
    if len(lines) < 2:
        return None, None
    # The command name (field 2) is in parentheses and may hold spaces; count fields after its last ")".
    fields = lines[0].rpartition(")")[2].split()
    ticks = lines[1].strip()
    cpu_s = None
    if len(fields) > 12 and ticks.isdigit() and int(ticks) > 0:
        cpu_s = (int(fields[11]) + int(fields[12])) / int(ticks)  # utime + stime (fields 14 and 15)
    rss = None
    for line in lines[2:]:
        match = re.fullmatch(r"VmRSS:\s+(\d+)\s+kB", line.strip())
        if match:
            rss = int(match.group(1)) * 1024
    return cpu_s, rss


def parse_ps(text: str) -> tuple[float | None, int | None]:
    """CPU seconds and resident bytes from `ps -o rss=,time=` (BSD ``M:SS.hh`` or procps ``[D-]HH:MM:SS``)."""
    match = re.fullmatch(r"(\d+)\s+(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if not match:
        return None, None
    rss_kib, days, hours, minutes, seconds = match.groups()
    cpu_s = ((int(days or 0) * 24 + int(hours or 0)) * 60 + int(minutes)) * 60 + float(seconds)
    return cpu_s, int(rss_kib) * 1024


def cpu_percent(before: Sample, after: Sample, seconds: float) -> float | None:
    """The worker's CPU use between two samples ``seconds`` apart (100 = one core busy); None across a restart."""
    if before.pid != after.pid or before.cpu_s is None or after.cpu_s is None or seconds <= 0:
        return None
    return max(0.0, (after.cpu_s - before.cpu_s) / seconds * 100)


@dataclass(frozen=True)
class Usage:
    """What a node's status shows of its worker (the NodeStatus fields of the same names)."""

    cpu_percent: float | None = None
    rss: int | None = None
    gpu_percent: float | None = None   # mean over the node's GPUs
    gpu_mem_used: int | None = None    # summed over them
    gpu_mem_total: int | None = None


def usage(before: Sample | None, after: Sample | None, seconds: float) -> Usage:
    """The worker's use from its latest sample (and the one ``seconds`` before it, for CPU)."""
    if after is None:
        return Usage()
    busy = [gpu.utilization for gpu in after.gpus if gpu.utilization is not None]
    known = [(gpu.memory_total, gpu.memory_free) for gpu in after.gpus
             if gpu.memory_total is not None and gpu.memory_free is not None]
    return Usage(cpu_percent=cpu_percent(before, after, seconds) if before else None, rss=after.rss,
                 gpu_percent=sum(busy) / len(busy) if busy else None,
                 gpu_mem_used=sum(total - free for total, free in known) if known else None,
                 gpu_mem_total=sum(total for total, _ in known) if known else None)


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds a process of this machine has used (/proc, else `ps`), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
        return parse_proc(f"{stat.strip()}\n{os.sysconf('SC_CLK_TCK')}")[0]
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # procfs, and no such process
    except OSError:
        return None
    result = subprocess.run(["ps", "-o", "rss=,time=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return parse_ps(result.stdout)[0]
