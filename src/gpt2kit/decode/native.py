"""gpt2kit's own CPU kernels (C, in csrc/), built with the system's C compiler on first use and called
through ctypes: the int8 weight-only product of csrc/int8_linear.c, for x86-64 CPUs with AVX2 and
FMA, and the int8-activation product of csrc/int8act_linear.c (gpt2kit/decode/int8act.py), for AVX2
and, where the CPU has it, AVX-512 VNNI (one library holds both; `why_int8act_unavailable(isa)` says
whether this CPU runs an instruction set, from its flags), and the float32 few-row product of
csrc/f32_linear.c (gpt2kit/decode/f32.py), for AVX2 + FMA and, where the CPU has avx512f, AVX-512
(`why_f32_unavailable(isa)`): PyTorch runs a single float32 row's product on one thread, this one
streams each thread's contiguous half of the matrix; and csrc/step.c, the whole batch-1 decode step
in one call on those products (gpt2kit/decode/native_step.py). Each library is built, cached and
loaded on its own, as described below for the first.

Why a kernel of our own: a batch-1 decode step reads every weight once, so an int8 model should run
at the speed of streaming its int8 bytes from memory. PyTorch's `_weight_int8pack_mm` is compute
bound on AVX2 (it scales every weight before the FMA, about one weight per cycle per core) and
falls well short of the memory bandwidth; this kernel widens, converts and multiplies, applying the
per-channel scale once per output, and prefetches the next rows (docs/quantization.md and
docs/benchmarks.md have the measurements). It is one candidate among the kernels gpt2kit.decode.int8
measures: it runs only where it wins.

The build: `cc -O3 -mavx2 -mfma -fopenmp -ffp-contract=off -shared -fPIC` (cc is $CC, else gcc, else
cc) in a private temporary directory, stored in `$GPT2KIT_CACHE/kernels/` (default
`~/.cache/gpt2kit/kernels/`) under a name hashed from the source, the compiler and the flags, so a
changed source or compiler builds anew and an unchanged one loads in milliseconds. Loading a library
runs its code, so what may be loaded from that directory is decided by decode/kernel_cache.py: a
directory only this user can write, a library owned by this user, writable by nobody else, whose
bytes match the SHA-256 stored with them, loaded from the bytes that were checked. A library that
fails is built again; a cache directory that fails (another user's, group- or world-writable) is not
used, with a warning, and the kernel is built for the process alone.

Under load the threads of one call may not all be running: a call whose columns are split between
two threads waits for the one the OS has not scheduled, a time slice late. csrc/solo.h (included by
every library) watches when each call's threads start and, while starts are late, sends the next
calls to one thread (the result does not depend on the thread count); `solo_stats(lib)` gives its
counters, GPT2KIT_NATIVE_LATE_US its threshold (a negative value: off). benchmarks/bench_load.py
measures it idle and beside busy processes.

It is built only where it can run: on Linux (where PyTorch's wheels carry the libgomp that a gcc
build links to), where PyTorch reports AVX2 or AVX-512 for the CPU and runs its threads on OpenMP
(the kernel's threads are then PyTorch's own pool: both use the libgomp already loaded). Anywhere
else, or without a C compiler, or when the build fails, `int8_linear()` is None,
`why_unavailable()` says why in one line, and the other kernels run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch

import gpt2kit.decode.kernel_cache as kernel_cache
from gpt2kit.machine import cpu_flags

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
ABI = 1  # csrc/int8_linear.c's gpt2kit_int8_linear_abi(): the signature this module calls
ABI_INT8ACT = 2  # csrc/int8act_linear.c's gpt2kit_int8act_linear_abi()
ABI_F32 = 1  # csrc/f32_linear.c's gpt2kit_f32_linear_abi()
ABI_STEP = 1  # csrc/step.c's gpt2kit_step_abi()
# The libraries, by their C source's stem: each is built, cached and loaded on its own, so one that
# fails to build (an old compiler without the AVX-512 VNNI target) leaves the other in use.
_LIBS = {"int8_linear": ABI, "int8act_linear": ABI_INT8ACT, "f32_linear": ABI_F32, "step": ABI_STEP}
_SOLO_STATS: dict[str, object] = {}  # library -> its C function gpt2kit_<lib>_solo_stats (csrc/solo.h)
_ROWS: dict[str, object] = {}  # "quantize", "rescale": csrc/int8act_linear.c's halves around another GEMM
_STATE: dict[str, dict[str, object]] = {}  # library -> {"fn": the loaded function} or {"why": the reason there is none}
ISAS = {"avx2": 1, "avx512-vnni": 2, "avx2-a16": 3}  # csrc/int8act_linear.c's isa argument (avx2-a16: int16 codes)
_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
F32_ISAS = {"avx2": 1, "avx512": 2}  # csrc/f32_linear.c's isa argument


def _source(lib: str = "int8_linear") -> bytes:
    return resources.files("gpt2kit.decode").joinpath(f"csrc/{lib}.c").read_bytes()


def _headers() -> dict[str, bytes]:
    """The headers every kernel source may include (csrc/*.h: solo.h, the thread-count fallback), by name."""
    folder = resources.files("gpt2kit.decode").joinpath("csrc")
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir(), key=lambda f: f.name) if f.name.endswith(".h")}


def sources_digest() -> str:
    """A short hash of every kernel source here (csrc/*.c and *.h): a stored kernel choice names it,
    so a changed kernel is measured anew (decode/kernel_choice.py)."""
    folder = resources.files("gpt2kit.decode").joinpath("csrc")
    files = sorted((f for f in folder.iterdir() if f.name.endswith((".c", ".h"))), key=lambda f: f.name)
    return hashlib.sha256(b"".join(f.name.encode() + b"\0" + f.read_bytes() + b"\0" for f in files)).hexdigest()[:12]


def cache_dir() -> Path:
    """Where built kernels are kept: $GPT2KIT_CACHE/kernels, else ~/.cache/gpt2kit/kernels."""
    root = os.environ.get("GPT2KIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gpt2kit")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def _cannot_run_here() -> str | None:
    """Why this CPU or PyTorch build cannot run the kernel, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"built on Linux only (this is {sys.platform})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (PyTorch reports {capability})"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "PyTorch here does not run its threads on OpenMP"
    return None


def library_name(cc: str, lib: str = "int8_linear") -> str:
    """The cached library's file name for compiler `cc`: a hash of the source, the compiler (its path
    and version) and the flags, so a changed source, compiler or flag builds anew."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = [name.encode() + b"\0" + body for name, body in _headers().items()]
    parts = [b"gpt2kit-native-2", _source(lib), *headers, (shutil.which(cc) or cc).encode(), version.encode(),
             " ".join(FLAGS).encode()]
    key = hashlib.sha256(b"".join(p + b"\0" for p in parts)).hexdigest()[:16]
    return f"{lib}-{key}.so"


def _compile(cc: str, lib: str) -> bytes:
    """The library's bytes, compiled in a private temporary directory (0700, removed after)."""
    with tempfile.TemporaryDirectory(prefix="gpt2kit-build-") as tmp:
        Path(tmp, f"{lib}.c").write_bytes(_source(lib))
        for name, body in _headers().items():
            Path(tmp, name).write_bytes(body)
        # relative names, run in tmp: the library does not depend on where it was built
        done = subprocess.run([cc, *FLAGS, f"{lib}.c", "-o", f"{lib}.so"], cwd=tmp,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(done.stderr.strip().splitlines() or ['no message'])[-1][:200]}")
        return Path(tmp, f"{lib}.so").read_bytes()


def load(directory: Path | None = None, lib: str = "int8_linear"):
    """Load one of gpt2kit's kernel libraries (`lib`: int8_linear, the weight-only product, or
    int8act_linear, the int8-activation one) and return its C function: the library cached in
    `directory` (default cache_dir()) if it passes kernel_cache's checks, else built with the C
    compiler and stored there (where `directory` is not this user's alone, or cannot be written, it
    is built for this process only). Raises RuntimeError, OSError or subprocess.SubprocessError with
    the reason."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    name = library_name(cc, lib)
    cache = kernel_cache.open_cache(cache_dir() if directory is None else Path(directory))
    try:
        body = cache.read(name) if cache else None
        if body is None:
            body = _compile(cc, lib)
            if cache:
                cache.write(name, body)  # best effort: a cache that cannot be written builds each process
    finally:
        if cache:
            cache.close()
    dll = kernel_cache.load(body, name)
    if getattr(dll, f"gpt2kit_{lib}_abi")() != _LIBS[lib]:
        raise RuntimeError("the library is of another version")
    fn = getattr(dll, f"gpt2kit_{lib}")
    stats = getattr(dll, f"gpt2kit_{lib}_solo_stats", None)  # None: a library built without csrc/solo.h
    if stats is not None:
        stats.argtypes, stats.restype = [ctypes.c_void_p], None
    _SOLO_STATS[lib] = stats
    if lib == "int8act_linear":  # x, R, K, q, sx, threads / acc, R, N, sx, s, b, y, threads
        quantize, rescale = dll.gpt2kit_int8act_quantize, dll.gpt2kit_int8act_rescale
        quantize.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int]
        rescale.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        quantize.restype = rescale.restype = None
        _ROWS.update(quantize=quantize, rescale=rescale)
    if lib == "step":  # net, x, kv, s_layer, s_kv, s_head, s_pos, P, logits, threads (decode/native_step.py)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                       ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    if lib == "f32_linear":  # x, M, K, Wt, ldw, N, b, y, threads, isa
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                       ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        fn.restype = None
        return fn
    args = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.argtypes = args + [ctypes.c_int] if lib == "int8act_linear" else args
    fn.restype = ctypes.c_int if lib == "int8act_linear" else None
    return fn


def _load(lib: str) -> dict[str, object]:
    why = _cannot_run_here()
    if why is None and _compiler() is None:
        why = "no C compiler (set CC, or install gcc)"
    if why is None:
        try:
            return {"fn": load(lib=lib)}
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            why = f"the build failed ({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})"
    return {"why": why}


def _function(lib: str, reload: bool):
    if reload:
        _STATE.clear()
    if lib not in _STATE:
        _STATE[lib] = {"why": "GPT2KIT_NO_NATIVE is set"} if os.environ.get("GPT2KIT_NO_NATIVE") else _load(lib)
    return _STATE[lib].get("fn")


def int8_linear(reload: bool = False):
    """The weight-only C function (built and loaded on the first call), or None where it cannot run
    here. reload: forget what this process found (for every library) and look again (after CC, PATH,
    GPT2KIT_CACHE or GPT2KIT_NO_NATIVE changed)."""
    return _function("int8_linear", reload)


def why_unavailable() -> str | None:
    """One line on why the weight-only kernel is unavailable, or None when it is loaded (after int8_linear())."""
    int8_linear()
    return _STATE["int8_linear"].get("why")


def int8act_linear(reload: bool = False):
    """The int8-activation C function (csrc/int8act_linear.c), as int8_linear() gives the weight-only one."""
    return _function("int8act_linear", reload)


def why_int8act_unavailable(isa: str) -> str | None:
    """Why the int8-activation kernel for `isa` (one of ISAS) cannot run here, or None: the library
    (as why_unavailable), and for avx512-vnni the CPU's flags (avx512f, avx512bw, avx512_vnni, and
    PyTorch seeing AVX-512, which it does only where the OS saves the AVX-512 registers)."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; valid choices: {', '.join(ISAS)}")
    int8act_linear()
    state = _STATE["int8act_linear"]
    if state.get("why") is not None or isa in ("avx2", "avx2-a16"):
        return state.get("why")
    return _avx512_why(state, "vnni", _VNNI_FLAGS)


def _avx512_why(state: dict, key: str, needed: frozenset[str]) -> str | None:
    """Why an AVX-512 variant needing CPU flags `needed` cannot run (a flag missing, or PyTorch not
    seeing AVX-512, which it does only where the OS saves the AVX-512 registers), or None; read once
    per load into state[key] (a product must not read /proc/cpuinfo)."""
    if key not in state:
        lacking = sorted(needed - cpu_flags())
        state[key] = (f"this CPU lacks {', '.join(lacking)}" if lacking
                      else None if torch.backends.cpu.get_cpu_capability() == "AVX512"
                      else f"PyTorch reports {torch.backends.cpu.get_cpu_capability()}, not AVX512")
    return state[key]


def run_int8act_linear(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       isa: str) -> torch.Tensor:
    """x2 (R, K) float32, its rows quantized to int8 on the fly, @ (weight (N, K) int8 * scale (N,)
    float32)^T [+ bias (N,) float32] -> (R, N) float32 (csrc/int8act_linear.c's arithmetic), by the
    C kernel for `isa` on PyTorch's thread count. Inputs must be CPU, contiguous, these dtypes
    (gpt2kit.decode.int8act checks before calling)."""
    why = why_int8act_unavailable(isa)
    if why is not None:
        raise RuntimeError(f"gpt2kit's native int8-activation kernel ({isa}) is unavailable: {why}")
    R, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(R, N, dtype=torch.float32)  # (R, N)
    if int8act_linear()(x2.data_ptr(), R, K, weight.data_ptr(), N, scale.data_ptr(),
                        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
                        ISAS[isa]) != 0:
        if isa == "avx2-a16" and K > 131072:
            raise NotImplementedError(f"the 16-bit activation kernel takes in_features up to 131072, got {K}")
        raise MemoryError(f"the int8-activation kernel could not allocate {R} x {K} bytes of scratch")
    return y


def int8act_rows() -> tuple[object, object] | None:
    """csrc/int8act_linear.c's (quantize, rescale): the int8-activation arithmetic's two halves, for
    another int8 GEMM between them (decode/int8act.py's torch._int_mm kernel), or None where the
    library cannot run here."""
    int8act_linear()
    return (_ROWS["quantize"], _ROWS["rescale"]) if "quantize" in _ROWS else None


def run_int8_linear(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (R, K) float32 @ (weight (N, K) int8 * scale (N,) float32)^T [+ bias (N,) float32] -> (R, N)
    float32, by the C kernel on PyTorch's thread count. Inputs must be CPU, contiguous, these dtypes
    (gpt2kit.decode.int8 checks before calling); the output is a new tensor."""
    fn = int8_linear()
    if fn is None:
        raise RuntimeError(f"gpt2kit's native int8 kernel is unavailable: {why_unavailable()}")
    R, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(R, N, dtype=torch.float32)  # (R, N)
    fn(x2.data_ptr(), R, K, weight.data_ptr(), N, scale.data_ptr(),
       None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def f32_linear(reload: bool = False):
    """The float32 few-row C function (csrc/f32_linear.c), as int8_linear() gives the weight-only one."""
    return _function("f32_linear", reload)


def step(reload: bool = False):
    """The batch-1 decode step's C function (csrc/step.c; gpt2kit/decode/native_step.py calls it)."""
    return _function("step", reload)


def why_f32_unavailable(isa: str) -> str | None:
    """Why the float32 kernel for `isa` (one of F32_ISAS) cannot run here, or None: the library (as
    why_unavailable), and for avx512 the CPU's avx512f flag and PyTorch seeing AVX-512."""
    if isa not in F32_ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; valid choices: {', '.join(F32_ISAS)}")
    f32_linear()
    state = _STATE["f32_linear"]
    if state.get("why") is not None or isa in ("avx2", "avx2-a16"):
        return state.get("why")
    return _avx512_why(state, "avx512", frozenset({"avx512f"}))



SOLO_BUCKETS_US = (10, 50, 100, 250, 1000)  # csrc/solo.h's start-delay histogram: < each, then the rest


def solo_stats(lib: str = "f32_linear") -> dict[str, object] | None:
    """csrc/solo.h's counters for one loaded library (None if it is not loaded in this process):
    calls, calls sent to one thread because the other threads started late, late starts, and the
    histogram of the latest thread's start delay over the calls on two or more threads (keys '<10us'
    ... '<1000us', '>=1000us')."""
    fn = _SOLO_STATS.get(lib)
    if fn is None:
        return None
    out = (ctypes.c_long * 9)()
    fn(ctypes.addressof(out))
    names = [f"<{b}us" for b in SOLO_BUCKETS_US] + [f">={SOLO_BUCKETS_US[-1]}us"]
    return {"calls": out[0], "solo_calls": out[1], "late_starts": out[2],
            "start_delay": dict(zip(names, list(out)[3:], strict=True))}
