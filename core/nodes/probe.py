"""Describe a node's hardware from the output of shell commands run on it.

Each probe is a POSIX-sh command and a pure parser (text -> dataclass). `PROBE_COMMAND` runs them all in
one go and prints each output under a marker line ``==name==``; `parse_node` splits that text and hands
every section to its parser. Parsers never raise: missing or odd output gives empty fields or None.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.nodes.gpus import (
    GIB,
    NVIDIA_SMI_FIELDS,
    Gpu,
    VulkanDevice,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_table,
    parse_rocm_smi_csv,
    parse_system_profiler_displays,
    parse_vulkaninfo_summary,
)
from core.nodes.shell import Remote
from core.nodes.target import ARM64, parse_auxv


@dataclass(frozen=True)
class CpuInfo:
    """The CPU: model, logical CPU count, and feature flags (x86 ``flags`` / ARM ``Features``)."""

    model: str
    cores: int
    flags: frozenset[str]


@dataclass(frozen=True)
class MemInfo:
    """System memory in bytes."""

    total: int
    available: int


@dataclass(frozen=True)
class OsInfo:
    """The operating system: ``system`` is linux or darwin; the rest comes from /etc/os-release or sw_vers."""

    system: str
    distro_id: str
    version: str
    pretty: str


@dataclass(frozen=True)
class Toolchain:
    """Versions of the build tools a worker build needs, None where missing."""

    cmake: str | None
    cxx: str | None  # first line of `c++ --version`, e.g. "g++ (Debian 12.2.0-14) 12.2.0"
    nvcc: str | None
    hipcc: str | None


@dataclass(frozen=True)
class EphemeralPorts:
    """The ports the node's kernel hands out for outgoing connections and binds to port 0 (Linux
    ``ip_local_port_range`` less ``ip_local_reserved_ports``; macOS ``net.inet.ip.portrange``)."""

    low: int
    high: int
    reserved: tuple[tuple[int, int], ...] = ()  # inclusive ranges the kernel never hands out

    def may_take(self, port: int) -> bool:
        """Whether the kernel may give ``port`` to someone else while nothing listens on it."""
        return self.low <= port <= self.high and not any(first <= port <= last for first, last in self.reserved)


@dataclass(frozen=True)
class NodeFacts:
    """Everything the probe learned about a node."""

    os: OsInfo
    arch: str  # as `uname -m` says, amd64 read as x86_64: x86_64 | aarch64 | arm64 | armv7l ...
    cpu: CpuInfo
    memory: MemInfo
    gpus: tuple[Gpu, ...]
    toolchain: Toolchain
    vulkan: bool  # a real (not software) GPU answers through Vulkan
    disk_free: int | None  # bytes free in $HOME
    # Every device `vulkaninfo --summary` lists, software ones (llvmpipe) too: a `backend: vulkan` worker on a node
    # with software devices only is shown them with GGML_VK_VISIBLE_DEVICES (core.nodes.devices).
    vulkan_devices: tuple[VulkanDevice, ...] = ()
    ephemeral: EphemeralPorts | None = None  # None where the probe could not read it


_TOOLCHAIN_SECTIONS = (
    ("cmake", "cmake --version"),
    ("cxx", "c++ --version || g++ --version || clang++ --version"),
    # Non-interactive SSH shells rarely have the CUDA/ROCm bin folders on PATH.
    ("nvcc", "nvcc --version || /usr/local/cuda/bin/nvcc --version"),
    ("hipcc", "hipcc --version || /opt/rocm/bin/hipcc --version"),
)
_HARDWARE_SECTIONS = (
    ("uname", "uname -s -m"),
    ("os-release", "cat /etc/os-release"),
    ("macos-version", "sw_vers -productVersion"),
    # Only the first copy of each line: flags repeat for every core and a big server's cpuinfo is ~1 MB.
    ("cpuinfo", "awk '!seen[$0]++' /proc/cpuinfo"),
    # The CPU features the kernel (or qemu-user) gives a process, as ggml reads them (getauxval); glibc only.
    ("auxv", "LD_SHOW_AUXV=1 /bin/true | grep '^AT_HWCAP'"),
    ("sysctl", r"""[ "$(uname -s)" = Darwin ] && sysctl -a | grep -E '^(hw\.|machdep\.cpu\.)'"""),
    ("meminfo", "cat /proc/meminfo"),
    ("df", 'df -Pk "$HOME"'),
    # The human table is only a fallback, for an nvidia-smi whose --query-gpu fails.
    ("nvidia-smi", f"nvidia-smi --query-gpu={','.join(NVIDIA_SMI_FIELDS)} --format=csv,noheader,nounits"
                   " || { echo ==nvidia-smi-table==; nvidia-smi; }"),
    ("rocm-smi", "rocm-smi --showproductname --showmeminfo vram --csv"
                 " || /opt/rocm/bin/rocm-smi --showproductname --showmeminfo vram --csv"),
    ("vulkaninfo", "vulkaninfo --summary"),
    ("system_profiler", "system_profiler SPDisplaysDataType"),
    ("port-range", "cat /proc/sys/net/ipv4/ip_local_port_range || sysctl -n net.inet.ip.portrange.first"
                   " net.inet.ip.portrange.last"),
    ("reserved-ports", "cat /proc/sys/net/ipv4/ip_local_reserved_ports"),
)


def make_script(sections: Iterable[tuple[str, str]]) -> str:
    """One shell script that prints each command's output after an ``==name==`` line (see `split_sections`)."""
    return "\n".join(f"echo =={name}==; {{ {command}; }} 2>/dev/null || true" for name, command in sections)


TOOLCHAIN_COMMAND = make_script(_TOOLCHAIN_SECTIONS)
PROBE_COMMAND = make_script(_HARDWARE_SECTIONS + _TOOLCHAIN_SECTIONS)

_MARKER = re.compile(r"==([a-z0-9_-]+)==")
_KNOWN_ARCH = re.compile(r"x86_64|amd64|i[3-6]86|aarch64|arm64|armv\d+\w*|riscv64|ppc64(le)?|s390x|loongarch64|mips\w*")
_ARM_IMPLEMENTERS = {"0x41": "ARM", "0x4e": "NVIDIA", "0x61": "Apple", "0xc0": "Ampere"}
_ARM_PARTS = {
    ("0x41", "0xd03"): "Cortex-A53",
    ("0x41", "0xd05"): "Cortex-A55",
    ("0x41", "0xd07"): "Cortex-A57",
    ("0x41", "0xd08"): "Cortex-A72",
    ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0c"): "Neoverse-N1",
    ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x61", "0x022"): "M1 Icestorm",
    ("0x61", "0x023"): "M1 Firestorm",
}
_APT_DISTROS = frozenset({"debian", "ubuntu", "raspbian", "linuxmint", "pop"})
_DNF_DISTROS = frozenset({"fedora", "rhel", "rocky", "amzn", "centos", "almalinux", "ol"})
_PACKAGES = {"apt-get": {"c++": "build-essential"}, "dnf": {"c++": "gcc-c++"}}


def split_sections(text: str) -> dict[str, str]:
    """Split probe output at its ``==name==`` marker lines into {name: text}; text before any marker is dropped."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        marker = _MARKER.fullmatch(line.strip())
        if marker:
            current = sections.setdefault(marker.group(1), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def parse_uname(text: str) -> tuple[str, str]:
    """(system, arch) from `uname -s -m`; also reads `uname -srm` and `uname -a`. Empty strings where unknown."""
    tokens = text.split()
    system = tokens[0].lower() if tokens and tokens[0].isalpha() else ""
    arch = next((token for token in reversed(tokens[1:]) if _KNOWN_ARCH.fullmatch(token.lower())), "")
    if not arch and len(tokens) == 2:
        arch = tokens[1]
    arch = arch.lower()
    return system, "x86_64" if arch == "amd64" else arch


def parse_os_release(text: str) -> OsInfo:
    """Distribution facts from /etc/os-release (ID, VERSION_ID, PRETTY_NAME)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            fields[key] = value.strip().strip("\"'")
    return OsInfo("linux", fields.get("ID", "").lower(), fields.get("VERSION_ID", ""),
                  fields.get("PRETTY_NAME", fields.get("NAME", "")))


def parse_cpuinfo(text: str) -> CpuInfo:
    """CPU model, logical CPU count (``processor`` entries) and flags from Linux /proc/cpuinfo."""
    fields: dict[str, str] = {}
    processors = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "processor":
            processors += 1
        fields.setdefault(key, value.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    # Old 32-bit ARM kernels name the CPU in "Processor"; 64-bit ARM kernels name it only by part number.
    model = fields.get("model name") or fields.get("Processor") or _name_arm_core(fields)
    return CpuInfo(model, processors, frozenset(flags.split()))


def _name_arm_core(fields: dict[str, str]) -> str:
    implementer = fields.get("CPU implementer", "").lower()
    part = fields.get("CPU part", "").lower()
    if not implementer:
        return fields.get("Model", "")
    maker = _ARM_IMPLEMENTERS.get(implementer, f"implementer {implementer}")
    core = f"{maker} {_ARM_PARTS.get((implementer, part), f'part {part}')}"
    board = fields.get("Model")  # Raspberry Pi kernels add the board name
    return f"{board} ({core})" if board else core


def arm_cpu(cpu: CpuInfo, cpuinfo: str, auxv: str) -> CpuInfo:
    """An arm64 node's CPU: its features from HWCAP (what ggml itself reads; else the Features line), never an x86
    ``flags`` line. Under qemu-user /proc/cpuinfo is the host's: its x86 model is not the node's either."""
    emulated = re.search(r"^flags\s*:", cpuinfo, re.M) is not None and not re.search(r"^Features\s*:", cpuinfo, re.M)
    hwcap = parse_auxv(auxv)
    features = hwcap if hwcap is not None else frozenset() if emulated else cpu.flags
    model = "arm64 CPU (emulated; /proc/cpuinfo is the host's)" if emulated else cpu.model
    return CpuInfo(model, cpu.cores, features)


def parse_meminfo(text: str) -> MemInfo:
    """Total and available memory from /proc/meminfo; without MemAvailable, available = MemFree + Buffers + Cached."""
    kib: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        numbers = value.split()
        if sep and numbers and numbers[0].isdigit():
            kib.setdefault(key.strip(), int(numbers[0]))
    available = kib.get("MemAvailable")
    if available is None:
        available = kib.get("MemFree", 0) + kib.get("Buffers", 0) + kib.get("Cached", 0)
    return MemInfo(kib.get("MemTotal", 0) * 1024, available * 1024)


def parse_df(text: str) -> int | None:
    """Free bytes from `df -Pk PATH`, None when the output has no data row."""
    row = re.search(r"\s(\d+)\s+(\d+)\s+(\d+)\s+\d+%(\s|$)", text)
    return int(row.group(3)) * 1024 if row else None


def parse_sysctl(text: str) -> tuple[CpuInfo, MemInfo]:
    """CPU and memory from macOS `sysctl` lines ("key: value").

    Cores are logical CPUs (hw.ncpu). Flags are the hw.optional.* features set to 1, and on Intel Macs the
    machdep.cpu.*features words, lower-cased. sysctl has no free-memory figure, and macOS hands out its
    file cache and compressed memory on demand, so available is hw.memsize_usable (else hw.memsize).
    """
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values.setdefault(key.strip(), value.strip())
    flags = {key.rsplit(".", 1)[-1].lower() for key, value in values.items()
             if key.startswith("hw.optional.") and value == "1"}
    for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features", "machdep.cpu.extfeatures"):
        flags.update(word.lower() for word in values.get(key, "").split())
    cores = next((int(values[key]) for key in ("hw.ncpu", "hw.logicalcpu", "machdep.cpu.thread_count")
                  if values.get(key, "").isdigit()), 0)
    total = int(values["hw.memsize"]) if values.get("hw.memsize", "").isdigit() else 0
    usable = values.get("hw.memsize_usable", "")
    return (CpuInfo(values.get("machdep.cpu.brand_string", ""), cores, frozenset(flags)),
            MemInfo(total, int(usable) if usable.isdigit() else total))


def parse_toolchain(text: str) -> Toolchain:
    """Tool versions from the cmake, cxx, nvcc and hipcc sections that TOOLCHAIN_COMMAND prints."""
    sections = split_sections(text)

    def find(section: str, pattern: str) -> str | None:
        match = re.search(pattern, sections.get(section, ""))
        return match.group(1) if match else None

    cxx = next((line.strip() for line in sections.get("cxx", "").splitlines() if line.strip()), None)
    return Toolchain(find("cmake", r"cmake version (\S+)"), cxx,
                     find("nvcc", r"release (\d+(?:\.\d+)*)"), find("hipcc", r"HIP version:\s*(\S+)"))


def parse_node(text: str) -> NodeFacts:
    """All facts from the output of PROBE_COMMAND."""
    sections = split_sections(text)
    system, arch = parse_uname(sections.get("uname", ""))
    if system == "darwin":
        version = sections.get("macos-version", "").strip()
        os_info = OsInfo("darwin", "macos", version, f"macOS {version}".strip())
        cpu, memory = parse_sysctl(sections.get("sysctl", ""))
    else:
        os_info = parse_os_release(sections.get("os-release", ""))
        cpu, memory = parse_cpuinfo(sections.get("cpuinfo", "")), parse_meminfo(sections.get("meminfo", ""))
        if arch in ARM64:
            cpu = arm_cpu(cpu, sections.get("cpuinfo", ""), sections.get("auxv", ""))
    gpus = list(parse_nvidia_smi_csv(sections.get("nvidia-smi", "")))
    if not gpus:
        gpus = list(parse_nvidia_smi_table(sections.get("nvidia-smi-table", "")))
    gpus += parse_rocm_smi_csv(sections.get("rocm-smi", ""))
    gpus += [adapter.gpu for adapter in parse_system_profiler_displays(sections.get("system_profiler", ""))]
    vulkan_devices = parse_vulkaninfo_summary(sections.get("vulkaninfo", ""))
    vulkan_gpus = [device for device in vulkan_devices if device.is_gpu]
    # A vendor's own tool knows the memory; Vulkan only adds GPUs that no such tool reported (e.g. Intel).
    covered = {gpu.vendor for gpu in gpus}
    gpus += [Gpu(device.vendor, device.name, None, None, device.index, unified=device.device_type == "integrated")
             for device in vulkan_gpus if device.vendor not in covered]
    return NodeFacts(os_info, arch, cpu, memory, tuple(gpus), parse_toolchain(text), bool(vulkan_gpus),
                     parse_df(sections.get("df", "")), vulkan_devices,
                     parse_ephemeral(sections.get("port-range", ""), sections.get("reserved-ports", "")))


def parse_ephemeral(port_range: str, reserved: str) -> EphemeralPorts | None:
    """The ephemeral ports from ``ip_local_port_range`` ("32768\t60999", or macOS's two sysctl lines) and
    ``ip_local_reserved_ports`` ("50052,50100-50110" or empty); None when the range is unreadable."""
    bounds = [int(number) for number in re.findall(r"\d+", port_range)[:2]]
    if len(bounds) != 2 or not 0 < bounds[0] <= bounds[1] <= 65535:
        return None
    ranges = []
    for item in reserved.replace("\n", ",").split(","):
        first, _, last = item.strip().partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ranges.append((int(first), int(last or first)))
    return EphemeralPorts(bounds[0], bounds[1], tuple(ranges))


def choose_backend(facts: NodeFacts) -> tuple[str, str]:
    """(backend, reason): the best of cuda, rocm, metal, vulkan and cpu that the node can build and run."""
    notes = []
    if facts.os.system == "linux":
        for vendor, backend, tool, version, toolkit in (
            ("nvidia", "cuda", "nvcc", facts.toolchain.nvcc, "the CUDA toolkit (nvcc)"),
            ("amd", "rocm", "hipcc", facts.toolchain.hipcc, "ROCm (hipcc)"),
        ):
            gpus = [gpu for gpu in facts.gpus if gpu.vendor == vendor]
            if gpus and version:
                return backend, f"{_describe(gpus)} and {tool} {version} found"
            if gpus:
                notes.append(f"{_describe(gpus)} found but {toolkit} is missing")
    if facts.os.system == "darwin" and facts.arch == "arm64":
        apple = [gpu for gpu in facts.gpus if gpu.vendor == "apple"]
        return "metal", f"{_describe(apple) if apple else 'Apple silicon GPU'} runs Metal"
    if facts.vulkan:
        notes.append(f"Vulkan runs on {_describe(facts.gpus)}")
        return "vulkan", "; ".join(notes)
    cpus = f"{facts.cpu.cores} logical CPU{'' if facts.cpu.cores == 1 else 's'}"
    notes.append(f"{'' if notes else 'no GPU backend available; '}using the CPU: {facts.cpu.model or 'unknown model'}"
                 f" ({cpus})")
    return "cpu", "; ".join(notes)


def node_backend(wanted: str, facts: NodeFacts) -> tuple[str, str]:
    """(backend, reason) for a node whose inventory asks for ``wanted``: that one, or for ``auto`` choose_backend's."""
    return (wanted, f"backend: {wanted} in the inventory") if wanted != "auto" else choose_backend(facts)


def _describe(gpus: Sequence[Gpu]) -> str:
    labels = Counter(_label(gpu) for gpu in gpus)
    return ", ".join(label if count == 1 else f"{count}x {label}" for label, count in labels.items())


def _label(gpu: Gpu) -> str:
    name = gpu.name or f"{gpu.vendor} GPU"
    if gpu.memory_total:
        return f"{name} ({gpu.memory_total / GIB:.1f} GiB)"
    return f"{name} (unified memory)" if gpu.unified else name


def install_hint(os: OsInfo, *missing: str) -> str:
    """One command that installs every missing build tool ("cmake", "c++") on this OS."""
    if os.system == "darwin":
        brewed = " ".join(tool for tool in missing if tool != "c++")
        commands = ["xcode-select --install"] if "c++" in missing else []
        return " && ".join([*commands, f"brew install {brewed}"] if brewed else commands)
    manager = "apt-get" if os.distro_id in _APT_DISTROS else "dnf" if os.distro_id in _DNF_DISTROS else None
    if manager is None:
        what = " and ".join("a C++ compiler (g++ or clang++)" if tool == "c++" else tool for tool in missing)
        return f"install {what} with the system's package manager"
    return f"sudo {manager} install -y {' '.join(_PACKAGES[manager].get(tool, tool) for tool in missing)}"


PARALLEL_NODES = 16  # nodes connected, probed and deployed at once


def local_cpu_flags() -> frozenset[str]:
    """This machine's CPU features: what a pushed (GGML_NATIVE) build may use."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text()).flags
    except OSError:
        return frozenset()


async def probe_node(remote: Remote) -> NodeFacts:
    """Reach the node and read its facts (OS, arch, CPU, memory, GPUs, toolchain)."""
    await remote.connect()
    return parse_node((await remote.run(PROBE_COMMAND, timeout=120)).stdout)
