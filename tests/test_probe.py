"""Hardware probe: every parser on real captured outputs (tests/fixtures/probe, provenance in the shared
fixtures' SOURCES.md), the backend choice, install hints, and one real run of PROBE_COMMAND here."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from core.nodes.gpus import (
    GIB,
    MIB,
    DisplayAdapter,
    Gpu,
    VulkanDevice,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_table,
    parse_rocm_smi_csv,
    parse_system_profiler_displays,
    parse_vulkaninfo_summary,
)
from core.nodes.probe import (
    PROBE_COMMAND,
    TOOLCHAIN_COMMAND,
    CpuInfo,
    EphemeralPorts,
    MemInfo,
    NodeFacts,
    OsInfo,
    Toolchain,
    choose_backend,
    install_hint,
    parse_cpuinfo,
    parse_df,
    parse_ephemeral,
    parse_meminfo,
    parse_node,
    parse_os_release,
    parse_sysctl,
    parse_toolchain,
    parse_uname,
    split_sections,
)
from tests.harness import ephemeral_ports

FIXTURES = Path(__file__).parent / "fixtures" / "probe"
KIB = 1024
ROCM_7900XT = "rocm-smi_csv_showproductname-showuse-showmeminfo-vram_rx7900xt-gfx1100_marimo-issue9237.csv"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def probe_output(sections: dict[str, str]) -> str:
    """Sections in the layout PROBE_COMMAND prints, for nodes assembled from separate captures."""
    return "".join(f"=={name}==\n{text}\n" for name, text in sections.items())


# Real output of cmake/c++/nvcc --version, captured on the development machine (Debian 12, CUDA 13.0).
DEV_MACHINE_TOOLCHAIN = """==cmake==
cmake version 3.25.1

CMake suite maintained and supported by Kitware (kitware.com/cmake).
==cxx==
c++ (Debian 12.2.0-14+deb12u1) 12.2.0
Copyright (C) 2022 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.

==nvcc==
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
==hipcc==
"""


# --- sections ---------------------------------------------------------------------------------------------

def test_split_sections_keeps_banner_lines_that_are_not_markers() -> None:
    vulkan = fixture("vulkaninfo_summary_jetson-orin-nano-super_595.78_no-layers_yzma.txt")
    sections = split_sections("login banner\n" + probe_output({"vulkaninfo": vulkan, "df": ""}))
    assert set(sections) == {"vulkaninfo", "df"}
    assert sections["vulkaninfo"].startswith("==========\nVULKANINFO\n==========")
    assert sections["df"] == ""


def test_probe_command_marks_every_section() -> None:
    names = [line.split("==")[1] for line in PROBE_COMMAND.splitlines()]
    assert names == ["uname", "os-release", "macos-version", "cpuinfo", "auxv", "sysctl", "meminfo", "df", "nvidia-smi",
                     "rocm-smi", "vulkaninfo", "system_profiler", "port-range", "reserved-ports", "cmake", "cxx",
                     "nvcc", "hipcc"]
    assert "==nvidia-smi-table==" in PROBE_COMMAND  # printed only when the CSV query fails
    assert PROBE_COMMAND.endswith(TOOLCHAIN_COMMAND)
    assert all(line.endswith("2>/dev/null || true") for line in PROBE_COMMAND.splitlines())


# --- uname / os-release -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "expected"), [
    ("uname-srm_linux-proxmox-x86_64_webi-installers-issue780.txt", ("linux", "x86_64")),
    ("uname-srm_android-aarch64_webi-installers-issue780.txt", ("linux", "aarch64")),
    ("uname-srm_darwin-macos-arm64_webi-installers-issue780.txt", ("darwin", "arm64")),
    ("uname-a_raspberry-pi-5_6.6.0-rc3-v8+_raspberrypi-linux-pr5636.txt", ("linux", "aarch64")),
    ("uname-a_raspberry-pi-os-bullseye-64bit_x13binary-issue63.txt", ("linux", "aarch64")),
    ("uname-r_raspberry-pi-os-bookworm-64bit_quecpython-issue2.txt", ("", "")),  # release only: nothing to read
])
def test_uname(name: str, expected: tuple[str, str]) -> None:
    assert parse_uname(fixture(name)) == expected


def test_uname_of_probe_form_and_amd64() -> None:
    # Typed for this test, in the `uname -s -m` layout the probe uses.
    assert parse_uname("Linux sparc64\n") == ("linux", "sparc64")
    assert parse_uname("FreeBSD amd64") == ("freebsd", "x86_64")


@pytest.mark.parametrize(("name", "expected"), [
    ("os-release_debian-12-bookworm_which-distro.txt",
     OsInfo("linux", "debian", "12", "Debian GNU/Linux 12 (bookworm)")),
    ("os-release_debian-13-trixie_which-distro.txt", OsInfo("linux", "debian", "13", "Debian GNU/Linux 13 (trixie)")),
    ("os-release_ubuntu-22.04_which-distro.txt", OsInfo("linux", "ubuntu", "22.04", "Ubuntu 22.04 LTS")),
    ("os-release_ubuntu-24.04_which-distro.txt", OsInfo("linux", "ubuntu", "24.04", "Ubuntu 24.04 LTS")),
    ("os-release_raspbian-11-bullseye_bookworm-feedback-issue204.txt",
     OsInfo("linux", "raspbian", "11", "Raspbian GNU/Linux 11 (bullseye)")),
    ("os-release_raspbian-12-bookworm-32bit_which-distro.txt",
     OsInfo("linux", "raspbian", "12", "Raspbian GNU/Linux 12 (bookworm)")),
    # 64-bit Raspberry Pi OS says plain Debian.
    ("os-release_raspberry-pi-os-64bit-bookworm_bookworm-feedback-issue348.txt",
     OsInfo("linux", "debian", "12", "Debian GNU/Linux 12 (bookworm)")),
    ("os-release_raspberry-pi-os-lite-64bit-trixie_ot-br-posix-issue3579.txt",
     OsInfo("linux", "debian", "13", "Debian GNU/Linux 13 (trixie)")),
])
def test_os_release(name: str, expected: OsInfo) -> None:
    assert parse_os_release(fixture(name)) == expected


# --- CPU and memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "model", "cores", "has", "lacks"), [
    # archspec captures keep one processor block only, so they count 1 CPU.
    ("proc-cpuinfo_x86-64_amd-epyc-9654-zen4_rocky8.5_archspec.txt", "AMD EPYC 9654 96-Core Processor", 1,
     {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "fma", "f16c"}, {"amx_tile"}),
    ("proc-cpuinfo_x86-64_intel-skylake-avx512_rhel7_archspec.txt", "Intel(R) Xeon(R) Gold 6132 CPU @ 2.60GHz", 1,
     {"avx2", "avx512f", "avx512bw", "avx512vl"}, {"avx512_bf16"}),
    # "vmx flags" is a different line: its words are not CPU flags.
    ("proc-cpuinfo_x86-64_intel-core-ultra9-285_ubuntu24.04_spaces_archspec.txt", "Intel(R) Core(TM) Ultra 9 285", 1,
     {"avx2", "avx_vnni", "sha_ni"}, {"avx512f", "ept_x_only", "preemption_timer"}),
    ("proc-cpuinfo_arm64_raspberry-pi-5-cortex-a76_kernel6.1.47_arm-socs-table-issue96.txt",
     "Raspberry Pi 5 Model B Rev 1.0 (ARM Cortex-A76)", 4, {"asimd", "asimddp", "fphp", "atomics"}, {"sve"}),
    ("proc-cpuinfo_arm64_raspberry-pi-4-cortex-a72_spaces_glances-issue2616.txt",
     "Raspberry Pi 4 Model B Rev 1.5 (ARM Cortex-A72)", 4, {"fp", "asimd", "evtstrm", "crc32", "cpuid"}, {"asimddp"}),
    ("proc-cpuinfo_arm64_aws-t4g.small-graviton2_al2023_amazon-linux-2023-issue455.txt", "ARM Neoverse-N1", 2,
     {"asimddp", "atomics", "ssbs"}, {"sve"}),
    ("proc-cpuinfo_arm64_aws-graviton2-neoverse-n1_spaces_archspec.txt", "ARM Neoverse-N1", 1, {"asimddp"}, {"sve"}),
    ("proc-cpuinfo_arm64_aws-graviton3-neoverse-v1_archspec.txt", "ARM Neoverse-V1", 1,
     {"sve", "svei8mm", "svebf16", "i8mm", "bf16"}, {"sve2"}),
    ("proc-cpuinfo_arm64_nvidia-grace-neoverse-v2_ubuntu22.04_archspec.txt", "ARM Neoverse-V2", 1,
     {"sve", "sve2", "i8mm", "bf16", "bti"}, set()),
    ("proc-cpuinfo_arm64_apple-m1-asahi-linux_archspec.txt", "Apple M1 Icestorm", 1,
     {"asimddp", "asimdfhm", "sha3", "frint"}, {"sve", "i8mm"}),
])
def test_cpuinfo(name: str, model: str, cores: int, has: set[str], lacks: set[str]) -> None:
    cpu = parse_cpuinfo(fixture(name))
    assert (cpu.model, cpu.cores) == (model, cores)
    assert has <= cpu.flags
    assert not lacks & cpu.flags


def test_cpuinfo_flag_counts() -> None:
    assert len(parse_cpuinfo(fixture("proc-cpuinfo_arm64_raspberry-pi-4-cortex-a72_spaces_glances-issue2616.txt"))
               .flags) == 5
    assert len(parse_cpuinfo(fixture("proc-cpuinfo_x86-64_intel-skylake-avx512_rhel7_archspec.txt")).flags) == 125


def test_cpuinfo_of_unknown_arm_part() -> None:
    # Typed for this test: a 64-bit ARM block with a part number the table does not name.
    text = "processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x51\nCPU part\t: 0x805\n"
    assert parse_cpuinfo(text) == CpuInfo("implementer 0x51 part 0x805", 1, frozenset({"fp", "asimd"}))


@pytest.mark.parametrize(("name", "total_kib", "available_kib"), [
    ("proc-meminfo_x86-64_intel-core-i5-16GB_gopsutil.txt", 16115528, 11225936),
    ("proc-meminfo_arm64_raspberry-pi-zero-2w_trixie_picamera2-issue1358.txt", 426068, 233696),
    ("proc-meminfo_legacy-header-format_embedded_gopsutil-issue1002.txt", 254472, 210156),
    # No MemAvailable: MemFree 80288 + Buffers 7652 + Cached 21700.
    ("proc-meminfo_arm_openwrt_no-memavailable_sysinfo-issue164.txt", 125128, 80288 + 7652 + 21700),
])
def test_meminfo(name: str, total_kib: int, available_kib: int) -> None:
    assert parse_meminfo(fixture(name)) == MemInfo(total_kib * KIB, available_kib * KIB)


def test_sysctl_m4_max() -> None:
    cpu, memory = parse_sysctl(fixture("sysctl_macos-sequoia_apple-m4-max_archspec.txt"))
    assert (cpu.model, cpu.cores) == ("Apple M4 Max", 16)
    assert {"arm64", "neon", "feat_dotprod", "feat_i8mm", "feat_bf16", "feat_sme2"} <= cpu.flags
    assert not {"feat_ssbs", "feat_specres", "watchpoint", "caps"} & cpu.flags  # 0, or counts rather than flags
    assert memory == MemInfo(68719476736, 67793829888)  # hw.memsize, hw.memsize_usable


def test_sysctl_m1_pro() -> None:
    cpu, memory = parse_sysctl(fixture("sysctl_macos-monterey_apple-m1_archspec.txt"))
    assert (cpu.model, cpu.cores) == ("Apple M1 Pro", 8)
    assert {"feat_dotprod", "neon"} <= cpu.flags
    assert not {"feat_i8mm", "feat_bf16"} & cpu.flags
    assert memory == MemInfo(17179869184, 17179869184)  # no hw.memsize_usable on Monterey


@pytest.mark.parametrize(("name", "model"), [
    ("sysctl_machdep.cpu_apple-m1_bigsur_py-cpuinfo-issue162.txt", "Apple M1"),
    ("sysctl_machdep.cpu_apple-silicon-early-brand-apple-processor_archspec-issue38.txt", "Apple processor"),
])
def test_sysctl_machdep_only(name: str, model: str) -> None:
    cpu, memory = parse_sysctl(fixture(name))
    assert cpu == CpuInfo(model, 8, frozenset())  # machdep.cpu.thread_count
    assert memory == MemInfo(0, 0)


def test_sysctl_intel_feature_words() -> None:
    # Typed for this test, in the layout of an Intel Mac's machdep.cpu lines.
    cpu, _ = parse_sysctl("machdep.cpu.features: FPU SSE4.2 AVX1.0\nmachdep.cpu.leaf7_features: BMI1 AVX2\n"
                          "hw.optional.avx2_0: 1\nhw.ncpu: 12\n")
    assert cpu.flags == {"fpu", "sse4.2", "avx1.0", "bmi1", "avx2", "avx2_0"}
    assert cpu.cores == 12


# --- GPUs -------------------------------------------------------------------------------------------------

def test_nvidia_csv_header_two_gpus() -> None:
    gpus = parse_nvidia_smi_csv(fixture("nvidia-smi_csv_header_2gpu_gtx1080ti-gtx1060_bpytop-issue26.csv"))
    assert gpus == (Gpu("nvidia", "GeForce GTX 1080 Ti", 11175 * MIB, (11175 - 2856) * MIB, utilization=36.0),
                    Gpu("nvidia", "GeForce GTX 1060 6GB", 6078 * MIB, (6078 - 4) * MIB, utilization=0.0))


def test_nvidia_csv_header_gb10_unified() -> None:
    gpus = parse_nvidia_smi_csv(fixture("nvidia-smi_csv_header_gb10-unified-memory_unsloth-pr10703.csv"))
    assert gpus == (Gpu("nvidia", "NVIDIA GB10", None, None, 0, unified=True),)


@pytest.mark.parametrize(("name", "gpu"), [
    ("nvidia-smi_query-gpu_allfields_csv_h100-80gb_590.48.01.csv",
     Gpu("nvidia", "NVIDIA H100 80GB HBM3", 81559 * MIB, 81081 * MIB, 0, utilization=0.0)),
    ("nvidia-smi_query-gpu_allfields_csv_rtx4080super_595.71.05.csv",
     Gpu("nvidia", "NVIDIA GeForce RTX 4080 SUPER", 16376 * MIB, 15348 * MIB, 0, utilization=0.0)),
])
def test_nvidia_csv_all_fields_by_header(name: str, gpu: Gpu) -> None:
    assert parse_nvidia_smi_csv(fixture(name)) == (gpu,)


def test_nvidia_csv_noheader_with_units() -> None:
    text = fixture("nvidia-smi_csv_noheader_units_a10-vgpu_gpustack-issue888.txt")
    columns = ("index", "name", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")
    a10 = Gpu("nvidia", "NVIDIA A10-12Q", 12288 * MIB, (12288 - 227) * MIB, 0, utilization=0.0)
    assert parse_nvidia_smi_csv(text, columns) == (a10,)
    assert parse_nvidia_smi_csv(text) == ()  # not the probe's four columns: skipped, not misread


@pytest.mark.parametrize("name", [
    "nvidia-smi_csv_noheader_nounits_fan-na_i3pystatus-pr776.txt",
    "nvidia-smi_csv_noheader_nounits_fan-notsupported-olddriver_i3pystatus-pr776.txt",
])
def test_nvidia_csv_noheader_nounits_na_fields(name: str) -> None:
    columns = ("memory.total", "memory.free", "memory.used", "temperature.gpu", "fan.speed", "utilization.gpu",
               "utilization.memory")
    assert parse_nvidia_smi_csv(fixture(name), columns) == (Gpu("nvidia", "", 2004 * MIB, 2004 * MIB, utilization=0.0),)


def test_nvidia_csv_noheader_gb10() -> None:
    text = fixture("nvidia-smi_csv_noheader_gb10-unified-memory_llama-swap-issue782.txt")
    gpus = parse_nvidia_smi_csv(text, ("memory.used", "memory.total", "utilization.memory"))
    assert gpus == (Gpu("nvidia", "", None, None, unified=True),)


def test_nvidia_csv_of_the_probe_query() -> None:
    # Typed for this test, in the `--format=csv,noheader,nounits` layout that no public capture shows.
    text = "0, NVIDIA GeForce RTX 4090, 24564, 24057\n1, NVIDIA GB10, [N/A], [N/A]\n"
    assert parse_nvidia_smi_csv(text) == (Gpu("nvidia", "NVIDIA GeForce RTX 4090", 24564 * MIB, 24057 * MIB, 0),
                                          Gpu("nvidia", "NVIDIA GB10", None, None, 1, unified=True))


@pytest.mark.parametrize(("name", "gpus"), [
    ("nvidia-smi_table_h100-80gb_590.48.01.txt",
     (Gpu("nvidia", "NVIDIA H100 80GB HBM3", 81559 * MIB, 81559 * MIB, 0),)),
    # MIG: the physical GPU row only; the MIG instance rows below it are not GPUs of their own.
    ("nvidia-smi_table_h100-mig_590.48.01.txt",
     (Gpu("nvidia", "NVIDIA H100 80GB HBM3", 81559 * MIB, (81559 - 59) * MIB, 0),)),
    # The table cuts long names; the process list below must not be read as GPUs.
    ("nvidia-smi_table_rtx4080super_595.71.05.txt",
     (Gpu("nvidia", "NVIDIA GeForce RTX 4080 ...", 16376 * MIB, (16376 - 596) * MIB, 0),)),
    ("nvidia-smi_table_rtx2080super_610.57.04_kmd-header.txt",
     (Gpu("nvidia", "NVIDIA GeForce RTX 2080 ...", 8192 * MIB, (8192 - 211) * MIB, 0),)),
    ("nvidia-smi_table_2x-rtx4090_550.163.01_TRUNCATED_rlinf-issue255.txt",
     (Gpu("nvidia", "NVIDIA GeForce RTX 4090", 24564 * MIB, (24564 - 507) * MIB, 0),
      Gpu("nvidia", "NVIDIA GeForce RTX 4090", 24564 * MIB, (24564 - 459) * MIB, 1))),
    ("nvidia-smi_table_2x-rtx5090_610.57.04_kmd-header_TRUNCATED_club-3090-issue1229.txt",
     (Gpu("nvidia", "NVIDIA GeForce RTX 5090", 32607 * MIB, (32607 - 29324) * MIB, 0),
      Gpu("nvidia", "NVIDIA GeForce RTX 5090", 32607 * MIB, (32607 - 30357) * MIB, 1))),
    ("nvidia-smi_table_gb10-not-supported_580.126.09_arctictraining-pr345.txt",
     (Gpu("nvidia", "NVIDIA GB10", None, None, 0, unified=True),)),
    ("nvidia-smi_table_jetson-orin-nano_540.5.0_all-na_yzma.txt",
     (Gpu("nvidia", "Orin (nvgpu)", None, None, 0, unified=True),)),
])
def test_nvidia_table(name: str, gpus: tuple[Gpu, ...]) -> None:
    assert parse_nvidia_smi_table(fixture(name)) == gpus


def test_nvidia_table_cut_after_a_gpu_row() -> None:
    text = fixture("nvidia-smi_table_2x-rtx4090_550.163.01_TRUNCATED_rlinf-issue255.txt")
    cut = "\n".join(text.splitlines()[:13])  # ends on GPU 1's first row
    assert parse_nvidia_smi_table(cut)[1] == Gpu("nvidia", "NVIDIA GeForce RTX 4090", None, None, 1)


def test_rocm_smi_csv_dgpu_and_igpu() -> None:
    gpus = parse_rocm_smi_csv(fixture(
        "rocm-smi_csv_showproductname-showmeminfo-vram-showuniqueid_rx6800-gfx1030-plus-igpu-gfx1036_localai-pr7761.csv"))
    assert gpus == (Gpu("amd", "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", 17163091968, 17163091968 - 692142080, 0),
                    Gpu("amd", "Raphael", 67108864, 67108864 - 26079232, 1))


def test_rocm_smi_csv_7900xt() -> None:
    gpus = parse_rocm_smi_csv(fixture(ROCM_7900XT))
    assert gpus == (Gpu("amd", "Radeon RX 7900 XT", 21458059264, 21458059264 - 27856896, 0, utilization=0.0),)


def test_rocm_smi_csv_after_a_warning() -> None:
    # Typed for this test: a warning line before the header, and MiB units as Hygon's fork names them.
    text = "WARNING: AMD GPU device(s) is/are in a low-power state. Check power control/runtime_status\n" \
           "device,vram Total Memory (MiB),vram Total Used Memory (MiB),Card Series\ncard2,65520,2,DCU xxxx\n"
    assert parse_rocm_smi_csv(text) == (Gpu("amd", "DCU xxxx", 65520 * MIB, 65518 * MIB, 2),)


def test_vulkaninfo_igpu_dgpu_and_llvmpipe() -> None:
    devices = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_intel-igpu+rtx4070-laptop+llvmpipe_yzma.txt"))
    assert devices == (VulkanDevice(0, "Intel(R) Graphics (RPL-S)", "integrated", "intel"),
                       VulkanDevice(1, "NVIDIA GeForce RTX 4070 Laptop GPU", "discrete", "nvidia"),
                       VulkanDevice(2, "llvmpipe (LLVM 20.1.2, 256 bits)", "cpu", "other"))
    assert [device.is_gpu for device in devices] == [True, True, False]


@pytest.mark.parametrize(("name", "device"), [
    ("vulkaninfo_summary_jetson-orin-nano-super_595.78_no-layers_yzma.txt",
     VulkanDevice(0, "NVIDIA Tegra Orin (nvgpu)", "integrated", "nvidia")),
    ("vulkaninfo_summary_jetson-orin-nano_user-elided_yzma.txt",
     VulkanDevice(0, "NVIDIA Tegra Orin (nvgpu)", "integrated", "nvidia")),
    ("vulkaninfo_summary_devices-excerpt_rx6600xt-amdgpu-pro_nixgl-issue153.txt",
     VulkanDevice(0, "AMD Radeon RX 6600 XT", "discrete", "amd")),
])
def test_vulkaninfo_single_device(name: str, device: VulkanDevice) -> None:
    assert parse_vulkaninfo_summary(fixture(name)) == (device,)


def test_system_profiler_apple_m3() -> None:
    adapters = parse_system_profiler_displays(
        fixture("system_profiler_SPDisplaysDataType_apple-m3_metal3_smctemp-issue26.txt"))
    assert adapters == (DisplayAdapter(Gpu("apple", "Apple M3", None, None, unified=True), "Metal 3"),)


def test_system_profiler_radeon_vega_old_metal_wording() -> None:
    adapters = parse_system_profiler_displays(fixture(
        "system_profiler_SPDisplaysDataType_imac-pro-radeon-vega64_metal-old-format_cpu_info-issue17.txt"))
    assert adapters == (DisplayAdapter(Gpu("amd", "Radeon Pro Vega 64", 16 * GIB, None),
                                       "Supported, feature set macOS GPUFamily2 v1"),)


def test_system_profiler_vendor_without_pci_id() -> None:
    # Typed for this test: a vendor line without its PCI id, and Intel's dynamic VRAM wording.
    text = "Chipset Model: GeForce GT 750M\nVendor: NVIDIA Corporation\nVRAM (Total): 2048 MB\n" \
           "Chipset Model: Intel Iris Pro\nVRAM (Dynamic, Max): 1536 MB\n"
    assert [adapter.gpu for adapter in parse_system_profiler_displays(text)] == [
        Gpu("nvidia", "GeForce GT 750M", 2048 * MIB, None), Gpu("intel", "Intel Iris Pro", 1536 * MIB, None)]


# --- toolchain and disk -----------------------------------------------------------------------------------

def test_toolchain_from_dev_machine_capture() -> None:
    assert parse_toolchain(DEV_MACHINE_TOOLCHAIN) == Toolchain("3.25.1", "c++ (Debian 12.2.0-14+deb12u1) 12.2.0",
                                                               "13.0", None)


def test_toolchain_of_other_compilers() -> None:
    # Typed for this test from the version lines the tools print (not captures).
    text = probe_output({"cmake": "",
                         "cxx": "Apple clang version 15.0.0 (clang-1500.3.9.4)\nTarget: arm64-apple-darwin23",
                         "nvcc": "Cuda compilation tools, release 12.4, V12.4.131",
                         "hipcc": "HIP version: 6.0.32830-d62f6a171\nAMD clang version 17.0.0"})
    assert parse_toolchain(text) == Toolchain(None, "Apple clang version 15.0.0 (clang-1500.3.9.4)", "12.4",
                                              "6.0.32830-d62f6a171")


def test_df() -> None:
    # Typed for this test, in the `df -Pk` layout (a filesystem name with a space, as macOS autofs has).
    text = "Filesystem     1024-blocks     Used Available Capacity Mounted on\n" \
           "map auto_home            0        0         0     100% /System/Volumes/Data/home\n"
    assert parse_df(text) == 0
    assert parse_df("Filesystem 1024-blocks Used Available Capacity Mounted on\n/dev/vda 264212084 24056260 "
                    "82334652 23% /\n") == 82334652 * KIB
    assert parse_df("df: /nonexistent: No such file or directory\n") is None


@pytest.mark.parametrize("parse", [
    parse_uname, parse_os_release, parse_cpuinfo, parse_meminfo, parse_df, parse_nvidia_smi_csv,
    parse_nvidia_smi_table, parse_rocm_smi_csv, parse_vulkaninfo_summary, parse_sysctl,
    parse_system_profiler_displays, parse_toolchain, parse_node, split_sections,
])
@pytest.mark.parametrize("text", ["", "\n\n", "garbage: : = , | [N/A]\n==\n", "NVIDIA-SMI has failed because it "
                                  "couldn't communicate with the NVIDIA driver.\n"])
def test_parsers_never_raise(parse: Callable[[str], object], text: str) -> None:
    parse(text)


# --- whole node -------------------------------------------------------------------------------------------

LAPTOP = {  # sections assembled from separate captures: an Ubuntu x86 laptop with an Intel iGPU and an RTX 4070
    "uname": fixture("uname-srm_linux-proxmox-x86_64_webi-installers-issue780.txt"),
    "os-release": fixture("os-release_ubuntu-24.04_which-distro.txt"),
    "cpuinfo": fixture("proc-cpuinfo_x86-64_intel-core-ultra9-285_ubuntu24.04_spaces_archspec.txt"),
    "meminfo": fixture("proc-meminfo_x86-64_intel-core-i5-16GB_gopsutil.txt"),
    "nvidia-smi": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",  # typed
    "nvidia-smi-table": fixture("nvidia-smi_table_2x-rtx4090_550.163.01_TRUNCATED_rlinf-issue255.txt"),
    "vulkaninfo": fixture("vulkaninfo_summary_intel-igpu+rtx4070-laptop+llvmpipe_yzma.txt"),
}


def test_node_from_linux_sections() -> None:
    facts = parse_node(probe_output(LAPTOP) + DEV_MACHINE_TOOLCHAIN)
    assert facts.os == OsInfo("linux", "ubuntu", "24.04", "Ubuntu 24.04 LTS")
    assert facts.arch == "x86_64"
    assert facts.cpu.model == "Intel(R) Core(TM) Ultra 9 285" and "avx2" in facts.cpu.flags
    assert facts.memory == MemInfo(16115528 * KIB, 11225936 * KIB)
    # nvidia-smi's GPUs (with memory) first; Vulkan adds only the Intel iGPU, and never llvmpipe.
    assert [gpu.name for gpu in facts.gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090",
                                                "Intel(R) Graphics (RPL-S)"]
    assert facts.gpus[2] == Gpu("intel", "Intel(R) Graphics (RPL-S)", None, None, 0, unified=True)
    assert facts.vulkan
    assert facts.toolchain.nvcc == "13.0"
    assert facts.disk_free is None
    assert choose_backend(facts) == ("cuda", "2x NVIDIA GeForce RTX 4090 (24.0 GiB) and nvcc 13.0 found")


def test_node_from_macos_sections() -> None:
    facts = parse_node(probe_output({
        "uname": fixture("uname-srm_darwin-macos-arm64_webi-installers-issue780.txt"),
        "macos-version": "15.0",  # typed: no sw_vers capture was found
        "sysctl": fixture("sysctl_macos-sequoia_apple-m4-max_archspec.txt"),
        "system_profiler": fixture("system_profiler_SPDisplaysDataType_apple-m3_metal3_smctemp-issue26.txt"),
    }))
    assert facts.os == OsInfo("darwin", "macos", "15.0", "macOS 15.0")
    assert (facts.arch, facts.cpu.model, facts.memory.total) == ("arm64", "Apple M4 Max", 64 * GIB)
    assert facts.gpus == (Gpu("apple", "Apple M3", None, None, unified=True),)
    assert facts.toolchain == Toolchain(None, None, None, None)
    assert choose_backend(facts) == ("metal", "Apple M3 (unified memory) runs Metal")


# --- backend choice ---------------------------------------------------------------------------------------

def linux_node(*, gpus: tuple[Gpu, ...] = (), vulkan: bool = False, nvcc: str | None = None,
               hipcc: str | None = None, cpuinfo: str = "proc-cpuinfo_arm64_aws-t4g.small-graviton2_al2023_amazon-"
               "linux-2023-issue455.txt") -> NodeFacts:
    return NodeFacts(parse_os_release(fixture("os-release_debian-12-bookworm_which-distro.txt")), "aarch64",
                     parse_cpuinfo(fixture(cpuinfo)), MemInfo(8 * GIB, 4 * GIB), gpus,
                     Toolchain("3.25.1", "c++", nvcc, hipcc), vulkan, None)


def test_cuda_needs_nvcc() -> None:
    gb10 = parse_nvidia_smi_table(fixture("nvidia-smi_table_gb10-not-supported_580.126.09_arctictraining-pr345.txt"))
    assert choose_backend(linux_node(gpus=gb10, nvcc="13.0")) == (
        "cuda", "NVIDIA GB10 (unified memory) and nvcc 13.0 found")
    assert choose_backend(linux_node(gpus=gb10)) == (
        "cpu", "NVIDIA GB10 (unified memory) found but the CUDA toolkit (nvcc) is missing; "
               "using the CPU: ARM Neoverse-N1 (2 logical CPUs)")


def test_gpu_without_toolkit_falls_back_to_vulkan() -> None:
    jetson = parse_node(probe_output({
        "uname": "Linux aarch64",  # typed
        "nvidia-smi-table": fixture("nvidia-smi_table_jetson-orin-nano_540.5.0_all-na_yzma.txt"),
        "vulkaninfo": fixture("vulkaninfo_summary_jetson-orin-nano_user-elided_yzma.txt"),
    }))
    assert jetson.gpus == (Gpu("nvidia", "Orin (nvgpu)", None, None, 0, unified=True),)  # Vulkan's copy dropped
    assert choose_backend(jetson) == ("vulkan", "Orin (nvgpu) (unified memory) found but the CUDA toolkit (nvcc) is "
                                                "missing; Vulkan runs on Orin (nvgpu) (unified memory)")


def test_rocm_needs_hipcc() -> None:
    amd = parse_rocm_smi_csv(fixture(ROCM_7900XT))
    assert choose_backend(linux_node(gpus=amd, hipcc="6.0.32830-d62f6a171")) == (
        "rocm", "Radeon RX 7900 XT (20.0 GiB) and hipcc 6.0.32830-d62f6a171 found")
    assert choose_backend(linux_node(gpus=amd))[1].startswith("Radeon RX 7900 XT (20.0 GiB) found but ROCm (hipcc) "
                                                              "is missing; ")


def test_vulkan_without_vendor_tools() -> None:
    facts = parse_node(probe_output({
        "uname": "Linux x86_64",  # typed
        "vulkaninfo": fixture("vulkaninfo_summary_devices-excerpt_rx6600xt-amdgpu-pro_nixgl-issue153.txt"),
    }))
    assert facts.gpus == (Gpu("amd", "AMD Radeon RX 6600 XT", None, None, 0),)
    assert choose_backend(facts) == (
        "vulkan", "AMD Radeon RX 6600 XT found but ROCm (hipcc) is missing; Vulkan runs on AMD Radeon RX 6600 XT")


def test_cpu_on_a_raspberry_pi() -> None:
    facts = linux_node(cpuinfo="proc-cpuinfo_arm64_raspberry-pi-5-cortex-a76_kernel6.1.47_arm-socs-table-issue96.txt")
    assert choose_backend(facts) == (
        "cpu",
        "no GPU backend available; using the CPU: Raspberry Pi 5 Model B Rev 1.0 (ARM Cortex-A76) (4 logical CPUs)")


def test_llvmpipe_alone_is_no_vulkan_gpu() -> None:
    text = fixture("vulkaninfo_summary_intel-igpu+rtx4070-laptop+llvmpipe_yzma.txt")
    only_llvmpipe = text[:text.index("GPU0:")] + text[text.index("GPU2:"):]
    facts = parse_node(probe_output({"uname": "Linux x86_64", "vulkaninfo": only_llvmpipe}))  # typed uname
    assert (facts.vulkan, facts.gpus) == (False, ())
    assert choose_backend(facts)[0] == "cpu"


def test_intel_mac_with_radeon_uses_the_cpu() -> None:
    facts = parse_node(probe_output({
        "uname": "Darwin x86_64",  # typed
        "system_profiler": fixture(
            "system_profiler_SPDisplaysDataType_imac-pro-radeon-vega64_metal-old-format_cpu_info-issue17.txt"),
    }))
    assert facts.gpus[0].vendor == "amd"
    assert choose_backend(facts)[0] == "cpu"  # no ROCm on macOS, and Metal only on Apple silicon


# --- install hints ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "missing", "hint"), [
    ("os-release_debian-12-bookworm_which-distro.txt", "cmake", "sudo apt-get install -y cmake"),
    ("os-release_ubuntu-24.04_which-distro.txt", "c++", "sudo apt-get install -y build-essential"),
    ("os-release_raspbian-12-bookworm-32bit_which-distro.txt", "cmake", "sudo apt-get install -y cmake"),
])
def test_install_hint_apt(name: str, missing: str, hint: str) -> None:
    assert install_hint(parse_os_release(fixture(name)), missing) == hint


def test_install_hint_elsewhere() -> None:
    fedora = OsInfo("linux", "fedora", "40", "Fedora Linux 40")
    amazon = OsInfo("linux", "amzn", "2023", "Amazon Linux 2023")
    macos = OsInfo("darwin", "macos", "15.0", "macOS 15.0")
    arch = OsInfo("linux", "arch", "", "Arch Linux")
    assert install_hint(fedora, "c++") == "sudo dnf install -y gcc-c++"
    assert install_hint(amazon, "cmake") == "sudo dnf install -y cmake"
    assert install_hint(macos, "cmake") == "brew install cmake"
    assert install_hint(macos, "c++") == "xcode-select --install"
    assert install_hint(arch, "cmake") == "install cmake with the system's package manager"
    assert install_hint(arch, "c++") == "install a C++ compiler (g++ or clang++) with the system's package manager"


def test_one_install_hint_installs_every_missing_tool() -> None:
    """Both cmake and a compiler missing: one command that installs both, not one that installs the first."""
    debian = parse_os_release(fixture("os-release_debian-12-bookworm_which-distro.txt"))
    assert install_hint(debian, "cmake", "c++") == "sudo apt-get install -y cmake build-essential"
    assert install_hint(OsInfo("linux", "rocky", "9", "Rocky Linux 9"), "cmake", "c++") == \
        "sudo dnf install -y cmake gcc-c++"
    assert install_hint(OsInfo("darwin", "macos", "15.0", "macOS 15.0"), "cmake", "c++") == \
        "xcode-select --install && brew install cmake"
    assert install_hint(OsInfo("linux", "arch", "", "Arch Linux"), "cmake", "c++") == \
        "install cmake and a C++ compiler (g++ or clang++) with the system's package manager"


@pytest.mark.parametrize(("port_range", "reserved", "expected"), [
    ("32768\t60999\n", "\n", EphemeralPorts(32768, 60999)),
    ("32768\t60999", "50052,50100-50110", EphemeralPorts(32768, 60999, ((50052, 50052), (50100, 50110)))),
    ("49152\n65535\n", "", EphemeralPorts(49152, 65535)),  # macOS: sysctl's two lines
    ("", "", None),  # Windows, BSDs: unknown, so no advice
    ("60999 32768", "", None),
])
def test_the_ephemeral_range_is_read_with_its_reserved_ports(port_range: str, reserved: str,
                                                             expected: EphemeralPorts | None) -> None:
    assert parse_ephemeral(port_range, reserved) == expected


def test_a_port_in_the_ephemeral_range_may_be_taken_unless_reserved() -> None:
    ports = EphemeralPorts(32768, 60999, ((50052, 50052), (50100, 50110)))
    assert ports.may_take(32768) and ports.may_take(60999) and ports.may_take(50053)
    assert not any(ports.may_take(port) for port in (29152, 32767, 61000, 50052, 50100, 50105, 50110))


# --- this machine -----------------------------------------------------------------------------------------

@pytest.mark.skipif(sys.platform != "linux", reason="asserts Linux facts about this machine; every other system's "
                    "probe output is covered by the captured fixtures above, and CI runs on Linux")
def test_probe_command_on_this_machine() -> None:
    done = subprocess.run(["/bin/sh", "-c", PROBE_COMMAND], capture_output=True, text=True, timeout=60, check=True)
    facts = parse_node(done.stdout)
    assert facts.os.system == "linux"
    assert facts.arch == platform.machine().lower()
    assert facts.cpu.cores >= 1 and facts.cpu.cores == os.cpu_count()  # dropping repeated lines kept every CPU
    assert facts.cpu.model and facts.cpu.flags
    assert 0 < facts.memory.available <= facts.memory.total
    assert facts.disk_free is not None and facts.disk_free > 0
    assert facts.toolchain.cmake is not None
    ephemeral = ephemeral_ports()
    assert facts.ephemeral is not None and (facts.ephemeral.low, facts.ephemeral.high) == (ephemeral[0], ephemeral[-1])
    assert (facts.toolchain.cxx is not None) == (shutil.which("c++") is not None)
    if shutil.which("nvcc"):
        assert facts.toolchain.nvcc is not None
