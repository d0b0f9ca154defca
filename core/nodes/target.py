"""What a worker binary is built for: the node's OS and arch, and for another arch the CPU features it may use.

This machine builds natively (GGML_NATIVE: every instruction its own CPU has). A node of another arch gets a
cross-built worker when this machine has a cross compiler for it (Debian's ``g++-<triplet>``): built here in
about a minute instead of minutes on a board or hours under emulation, with ``-march`` from the node's own CPU
features, never the builder's. A wrong ``-march`` is the most common ARM failure (SIGILL at start), so the flags
come from HWCAP, the features the kernel (or qemu-user) says the node's CPU has, as ggml itself reads them.
"""

from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass

# The Debian cross compilers this machine may have, by the node arch (`uname -m`) they build for.
CROSS_TRIPLETS = {"aarch64": "aarch64-linux-gnu", "arm64": "aarch64-linux-gnu"}
ARM64 = frozenset({"aarch64", "arm64"})
# Linux's arm64 HWCAP and HWCAP2 bits, named as /proc/cpuinfo's Features line names them
# (arch/arm64/include/uapi/asm/hwcap.h, arch/arm64/kernel/cpuinfo.c).
HWCAP_NAMES = ("fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp", "asimdhp",
               "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512",
               "sve", "asimdfhm", "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg")
HWCAP2_NAMES = ("dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint",
                "svei8mm", "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh", "rng", "bti", "mte")
# What ggml's ARM kernels use, as a -march extension, and the HWCAP feature(s) that must all be there for it.
_ARM_EXTENSIONS = (("dotprod", ("asimddp",)), ("fp16", ("fphp", "asimdhp")), ("i8mm", ("i8mm",)),
                   ("sve", ("sve",)))


@dataclass(frozen=True)
class Target:
    """The node a worker is built for: ``cpu_arch`` is the -march a cross build uses (None: a native build)."""

    system: str
    arch: str
    cpu_arch: str | None = None

    @property
    def cross(self) -> bool:
        """Whether this machine cannot run what it builds for the target."""
        return self.cpu_arch is not None

    def key_part(self) -> str:
        """The target's part of a build's cache key: ``linux-x86_64``, ``linux-aarch64-armv8.2-a+dotprod+fp16``."""
        return f"{self.system}-{self.arch}" + (f"-{self.cpu_arch}" if self.cpu_arch else "")


def native() -> Target:
    """This machine, built for natively."""
    return Target(platform.system().lower(), _arch(platform.machine()))


def _arch(name: str) -> str:
    name = name.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def parse_auxv(text: str) -> frozenset[str] | None:
    """The CPU features an arm64 process is given, from glibc's ``LD_SHOW_AUXV=1`` output (``AT_HWCAP: 119ffb``,
    ``AT_HWCAP2: 0x0``; hex with or without 0x). None when the output has no AT_HWCAP line (musl, busybox)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("AT_HWCAP", "AT_HWCAP2"):
            try:
                values[key.strip()] = int(value.strip(), 16)
            except ValueError:
                continue
    if "AT_HWCAP" not in values:
        return None
    features = {name for bit, name in enumerate(HWCAP_NAMES) if values["AT_HWCAP"] >> bit & 1}
    features |= {name for bit, name in enumerate(HWCAP2_NAMES) if values.get("AT_HWCAP2", 0) >> bit & 1}
    return frozenset(features)


def arm_march(features: frozenset[str]) -> str:
    """The -march (GGML_CPU_ARM_ARCH) for an arm64 CPU with these features: ``armv8-a`` (a Raspberry Pi 4's
    Cortex-A72), else ``armv8.2-a`` with what it has of dotprod, fp16, i8mm and sve (a Pi 5: +dotprod+fp16)."""
    extensions = [name for name, needs in _ARM_EXTENSIONS if all(feature in features for feature in needs)]
    return "armv8.2-a" + "".join(f"+{name}" for name in extensions) if extensions else "armv8-a"


@dataclass(frozen=True)
class CrossCompiler:
    """A cross compiler for one node arch: its GNU triplet, and the Debian package that installs it."""

    triplet: str

    @property
    def package(self) -> str:
        return f"g++-{self.triplet}"

    @property
    def cxx(self) -> str:
        return f"{self.triplet}-g++"

    @property
    def cc(self) -> str:
        return f"{self.triplet}-gcc"

    def found(self) -> bool:
        """Whether this machine has it (both compilers on PATH)."""
        return shutil.which(self.cxx) is not None and shutil.which(self.cc) is not None


def cross_compiler(system: str, arch: str) -> CrossCompiler | None:
    """The cross compiler a linux node of ``arch`` needs from this x86_64 machine (None: no such build here)."""
    if system != "linux" or native().system != "linux" or native().arch != "x86_64":
        return None
    triplet = CROSS_TRIPLETS.get(arch.lower())
    return CrossCompiler(triplet) if triplet else None


def cross_target(system: str, arch: str, features: frozenset[str]) -> Target:
    """The target of a cross build for a node: its arch, with -march from its CPU features."""
    return Target(system, _arch(arch), arm_march(features) if _arch(arch) == "aarch64" else None)


def toolchain_file(compiler: CrossCompiler, arch: str) -> str:
    """A CMake toolchain file for the cross compiler: the target's processor, compilers, and libraries looked up
    in its own sysroot only (never this machine's)."""
    return "\n".join([
        "set(CMAKE_SYSTEM_NAME Linux)",
        f"set(CMAKE_SYSTEM_PROCESSOR {_arch(arch)})",
        f"set(CMAKE_C_COMPILER {compiler.cc})",
        f"set(CMAKE_CXX_COMPILER {compiler.cxx})",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)",
        "",
    ])


def cross_flags(target: Target) -> tuple[str, ...]:
    """CMake flags of a cross build: no native tuning, the node's -march, and a binary that needs only the node's
    libc (libstdc++ and libgcc linked in, ggml's own thread pool instead of libgomp), since a minimal board image
    may lack the others or carry older ones."""
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF",
             "-DCMAKE_EXE_LINKER_FLAGS=-static-libstdc++ -static-libgcc"]
    if target.cpu_arch and target.arch == "aarch64":
        flags.append(f"-DGGML_CPU_ARM_ARCH={target.cpu_arch}")
    return tuple(flags)
