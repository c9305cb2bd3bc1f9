"""What machine this is: the one reader of the CPU's name and instruction sets, shared by `gpt2kit bench`
and the scripts in benchmarks/ (every table names the CPU and its flags), and of the memory free for new
allocations (packed decode copies, training's size check). No torch."""

from __future__ import annotations

import os
import platform

MEM_ENV = "GPT2KIT_MEM_AVAILABLE"  # bytes: stands in for MemAvailable (tests, or a cgroup-limited container)
FLAGS_ENV = "GPT2KIT_CPU_FLAGS"  # space-separated: stands in for the CPU's flags (tests: another CPU family)

# The instruction sets that decide which kernels are fast here (docs/benchmarks.md).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_info() -> dict[str, object]:
    """{"cpu": model name, "cores": logical CPUs, "isa": the ISA_FLAGS this CPU has} (Linux reads
    /proc/cpuinfo; elsewhere the name is platform's and isa is empty)."""
    cpu, flags = _read_cpuinfo()[0], cpu_flags()
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags]}


def cpu_flags() -> frozenset[str]:
    """Every flag /proc/cpuinfo lists for the first CPU (empty where there is no /proc/cpuinfo), or
    those $GPT2KIT_CPU_FLAGS names where it is set (what kernel choices are made for: a seam to
    decide as another CPU would; the kernels themselves still run on this one)."""
    forced = os.environ.get(FLAGS_ENV)
    return frozenset(forced.split()) if forced is not None else _read_cpuinfo()[1]


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return cpu, frozenset(flags)


def cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of the whole machine, ticks of this process), or None where /proc is absent: their
    difference over a span is what other processes ran meanwhile."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    t = os.times()
    return sum(v) - v[3] - v[4], round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))


def describe_cpu() -> str:
    """One line for a table's caption: "AMD EPYC 7B13, 2 cores (avx2, fma)"."""
    info = cpu_info()
    return f"{info['cpu']}, {info['cores']} cores ({', '.join(info['isa']) or 'no AVX2'})"


def mem_available() -> int | None:
    """Bytes of memory free for new allocations: $GPT2KIT_MEM_AVAILABLE when set, else MemAvailable from
    /proc/meminfo, else the available physical pages; None where none of them can be read."""
    forced = os.environ.get(MEM_ENV)
    if forced is not None:
        try:
            n = int(forced)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{MEM_ENV} must be a whole number of bytes >= 0, got {forced!r}")
        return n
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
