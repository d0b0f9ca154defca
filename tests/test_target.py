"""What a cross-built worker targets: HWCAP read as ggml reads it, -march from the node's features (never the
builder's), the cache key, the toolchain file, and an arm64 node's probe under emulation."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.nodes.build import build_key
from core.nodes.probe import parse_cpuinfo, parse_node
from core.nodes.target import (
    CrossCompiler,
    Target,
    arm_march,
    cross_compiler,
    cross_flags,
    cross_target,
    parse_auxv,
    toolchain_file,
)

FIXTURES = Path(__file__).parent / "fixtures" / "probe"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def auxv(cpu: str) -> str:
    """glibc's LD_SHOW_AUXV=1 under qemu-user 7.2 with QEMU_CPU=cpu, captured in the tests' arm64 root."""
    return fixture(f"ld-show-auxv_qemu-user-7.2-aarch64-{cpu}.txt")


def features_line(name: str) -> frozenset[str]:
    return parse_cpuinfo(fixture(name)).flags


def test_hwcap_of_an_emulated_pi_4_names_only_armv8_features() -> None:
    assert parse_auxv(auxv("cortex-a72")) == {"fp", "asimd", "aes", "pmull", "sha1", "sha2", "crc32", "cpuid"}


def test_hwcap_names_are_the_kernels_features_names() -> None:
    """An emulated Cortex-A76 reads as a real Pi 5's Features line, less the event stream qemu has no timer for."""
    pi5 = features_line("proc-cpuinfo_arm64_raspberry-pi-5-cortex-a76_kernel6.1.47_arm-socs-table-issue96.txt")
    assert parse_auxv(auxv("cortex-a76")) == pi5 - {"evtstrm"}


def test_hwcap2_is_read_too() -> None:
    features = parse_auxv(auxv("max"))
    assert features is not None and {"i8mm", "bf16", "sve2", "sve", "asimddp"} <= features


def test_no_hwcap_line_is_none_not_an_empty_cpu() -> None:
    assert parse_auxv("") is None
    assert parse_auxv("AT_PAGESZ: 4096\n") is None
    assert parse_auxv("AT_HWCAP: zz\n") is None


@pytest.mark.parametrize(("source", "march"), [
    ("proc-cpuinfo_arm64_raspberry-pi-4-cortex-a72_spaces_glances-issue2616.txt", "armv8-a"),
    ("proc-cpuinfo_arm64_raspberry-pi-5-cortex-a76_kernel6.1.47_arm-socs-table-issue96.txt", "armv8.2-a+dotprod+fp16"),
    ("proc-cpuinfo_arm64_aws-graviton2-neoverse-n1_spaces_archspec.txt", "armv8.2-a+dotprod+fp16"),
    ("proc-cpuinfo_arm64_aws-graviton3-neoverse-v1_archspec.txt", "armv8.2-a+dotprod+fp16+i8mm+sve"),
])
def test_march_comes_from_the_boards_features(source: str, march: str) -> None:
    assert arm_march(features_line(source)) == march


def test_an_emulated_pi_4_gets_the_baseline_and_a_pi_5_dotprod() -> None:
    assert arm_march(parse_auxv(auxv("cortex-a72")) or frozenset()) == "armv8-a"
    assert arm_march(parse_auxv(auxv("cortex-a76")) or frozenset()) == "armv8.2-a+dotprod+fp16"
    # fp16 needs both the scalar and the vector half-precision features
    assert arm_march(frozenset({"fp", "asimd", "fphp"})) == "armv8-a"


def emulated_probe(cpu: str) -> str:
    """PROBE_COMMAND's sections as an arm64 root under qemu-user answers them: uname and auxv are the emulated
    CPU's, /proc/cpuinfo is the x86 host's."""
    host = fixture("proc-cpuinfo_x86-64_amd-epyc-9654-zen4_rocky8.5_archspec.txt")
    return (f"==uname==\nLinux aarch64\n==cpuinfo==\n{host}\n==auxv==\n{auxv(cpu)}\n"
            "==meminfo==\nMemTotal: 1000 kB\nMemAvailable: 500 kB\n")


def test_an_emulated_arm_node_never_reads_the_hosts_x86_flags() -> None:
    facts = parse_node(emulated_probe("cortex-a72"))
    assert facts.arch == "aarch64"
    assert facts.cpu.flags == parse_auxv(auxv("cortex-a72"))
    assert not {"avx2", "sse4_2", "avx512f"} & facts.cpu.flags
    assert "AMD" not in facts.cpu.model and "emulated" in facts.cpu.model
    assert facts.cpu.cores > 0


def test_an_emulated_arm_node_without_auxv_has_no_features_rather_than_x86_ones() -> None:
    text = emulated_probe("cortex-a72").split("==auxv==")[0] + "==meminfo==\nMemTotal: 1000 kB\n"
    assert parse_node(text).cpu.flags == frozenset()


def test_a_real_pi_prefers_hwcap_and_falls_back_to_its_features_line() -> None:
    pi4 = fixture("proc-cpuinfo_arm64_raspberry-pi-4-cortex-a72_spaces_glances-issue2616.txt")
    with_auxv = parse_node(f"==uname==\nLinux aarch64\n==cpuinfo==\n{pi4}\n==auxv==\n{auxv('cortex-a72')}\n")
    assert with_auxv.cpu.flags == parse_auxv(auxv("cortex-a72")) and "Cortex-A72" in with_auxv.cpu.model
    without = parse_node(f"==uname==\nLinux aarch64\n==cpuinfo==\n{pi4}\n")
    assert without.cpu.flags == {"fp", "asimd", "evtstrm", "crc32", "cpuid"}


def test_an_x86_node_ignores_auxv() -> None:
    host = fixture("proc-cpuinfo_x86-64_amd-epyc-9654-zen4_rocky8.5_archspec.txt")
    facts = parse_node(f"==uname==\nLinux x86_64\n==cpuinfo==\n{host}\n==auxv==\nAT_HWCAP: 178bfbff\n")
    assert "avx2" in facts.cpu.flags


def test_the_cache_key_carries_the_target_arch_and_march() -> None:
    key = build_key("0.3.36", "cpu", "linux", "aarch64", cpu_arch="armv8.2-a+dotprod+fp16")
    assert key.endswith("-linux-aarch64-cpu-armv8.2-a+dotprod+fp16")
    assert build_key("0.3.36", "cpu", "linux", "aarch64", cpu_arch="armv8-a") != key
    assert build_key("0.3.36", "cpu", "linux", "x86_64").endswith("-linux-x86_64-cpu")
    target = cross_target("linux", "arm64", frozenset({"asimddp", "fphp", "asimdhp"}))
    assert target == Target("linux", "aarch64", "armv8.2-a+dotprod+fp16") and target.cross
    assert target.key_part() == "linux-aarch64-armv8.2-a+dotprod+fp16"


def test_a_cross_build_is_not_native_and_needs_only_the_nodes_libc() -> None:
    flags = cross_flags(Target("linux", "aarch64", "armv8-a"))
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_CPU_ARM_ARCH=armv8-a" in flags
    assert "-DGGML_OPENMP=OFF" in flags and any("-static-libstdc++" in flag for flag in flags)


def test_the_toolchain_file_names_the_cross_compilers_and_keeps_to_their_sysroot() -> None:
    text = toolchain_file(CrossCompiler("aarch64-linux-gnu"), "arm64")
    assert "set(CMAKE_SYSTEM_PROCESSOR aarch64)" in text
    assert "set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)" in text
    assert "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)" in text


def test_which_nodes_a_cross_compiler_serves() -> None:
    compiler = cross_compiler("linux", "aarch64")
    assert compiler is not None and compiler.package == "g++-aarch64-linux-gnu"
    assert cross_compiler("linux", "arm64") == compiler
    assert cross_compiler("darwin", "arm64") is None
    assert cross_compiler("linux", "mips") is None
