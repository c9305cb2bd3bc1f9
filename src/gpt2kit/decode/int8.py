"""Products with int8 weights: x (R, in) @ (W (out, in) * s (out,))^T, by the kernel that is fastest here.

Weight-only int8 keeps activations in floating point; only the weight is stored as int8 with one
scale per output channel, so y = (x @ W^T) * s exactly, and a kernel may apply s before or after
the product. The formulations this module can run (docs/quantization.md and docs/benchmarks.md,
"Figures behind the code's choices", have the measurements):

  i8pack-bf16  torch.ops.aten._weight_int8pack_mm on bfloat16 activations (cast in, cast back)
  i8pack       the same op on the activations' own dtype (a scalar loop on CPU in float32)
  dequant      F.linear(x, W.to(x.dtype)) * s: the whole matrix converted each call, then the dtype's
               GEMM; slow for a few rows, the portable path (any device, any shape)
  native-avx2  gpt2kit's own C kernel (decode/native.py, csrc/int8_linear.c), float32 activations on
               an AVX2 CPU: streams the int8 weights near memory bandwidth; built on first use
  native-a16   integer products for several rows (csrc/int8act_linear.c, isa avx2-a16): float32 rows
               rounded to 16-bit codes, one scale per row (the widest codes whose int32 sums stay exact),
               times the int8 weights by AVX2's vpmaddwd: weight-only accuracy (docs/quantization.md)

Which one runs is decided per (device type, activation dtype, row bucket) by `decide_for`: the choice
stored for this machine (decode/kernel_choice.py), else the CPU family's known-good default unless
interleaved rounds of timings on a matrix of the model's size say clearly otherwise (medians, a spread
check, never slower than the float32 product for a few rows), unless GPT2KIT_INT8_KERNEL names one; a
candidate whose product on the measurement's own input differs from a float32 reference is left out
before it is timed (a wrong kernel is fast, and would otherwise win).
`_weight_int8pack_mm` is used only where its contract holds (2-D contiguous input, in_features a
multiple of 16: other sizes crash or return wrong values in torch 2.13's CPU kernel; on AVX-512 it
segfaults on weight rows not aligned to 16 bytes or activation rows not aligned to 32, so a weight
that is not (a view, a tensor read from a file) takes dequant and activations are re-allocated).
On CUDA a candidate that raises in the measurement is left out, one that raises later on another shape
falls back to dequant there with one RuntimeWarning (`unavailable()` lists both).

Legend: R rows (batch x tokens), in/out the matrix's features.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

import gpt2kit.decode.kernel_choice as kernel_choice
import gpt2kit.decode.native as native

KERNELS = ("native-avx2", "native-a16", "i8pack-bf16", "i8pack", "dequant")
ENV = "GPT2KIT_INT8_KERNEL"
_CHOSEN = kernel_choice.REGISTRY.chosen  # ("int8", (device type, activation dtype, rows bucket)) -> kernel
_UNAVAILABLE: dict[str, str] = {}  # where a kernel failed -> the error (measurement or first use)


# Row buckets and the row count each is measured at: decode steps (1, few), small batches of tokens
# (many), prompts (prefill: 129-512 rows) and long prompts (long), where the winner changes.
_BUCKET_ROWS = {"1": 1, "few": 8, "many": 64, "prefill": 256, "long": 1024}
_HOPELESS = 10.0  # a candidate this many times slower than the fastest on the screening slice is not timed


def _bucket(rows: int) -> str:
    return ("1" if rows == 1 else "few" if rows <= 16 else "many" if rows <= 128
            else "prefill" if rows <= 512 else "long")


_I8PACK = getattr(torch.ops.aten, "_weight_int8pack_mm", None)  # absent in old torch builds


def _i8pack_ok(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch 2.13's AVX-512 kernel reads with aligned loads: weight rows on 16 bytes, activation rows on
    # 32 (found on an AMD EPYC; anything else segfaults). in_features a multiple of 16 keeps every row
    # aligned once the first is; the activations are re-allocated where they are not (_aligned).
    return (_I8PACK is not None and weight.shape[1] % 16 == 0 and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and x2.dim() == 2)


def _aligned(x2: torch.Tensor) -> torch.Tensor:
    """x2 contiguous and starting on 64 bytes (a fresh allocation's alignment) for _weight_int8pack_mm."""
    x2 = x2.contiguous()
    return x2 if x2.data_ptr() % 64 == 0 else x2.clone()


# A model's scales are converted to the kernel's dtype once per scale tensor (again when it is written
# in place or replaced), not once per product; inference tensors (no version counter) every time.
_SCALES: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, torch.Tensor]] = {}


def _scale_as(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if scale.dtype == dtype:
        return scale
    if scale.is_inference():
        return scale.to(dtype)
    key = (id(scale), dtype)
    hit = _SCALES.get(key)
    if hit is not None and hit[0]() is scale and hit[1] == scale._version:
        return hit[2]
    converted = scale.to(dtype)
    _SCALES[key] = (weakref.ref(scale, lambda _, key=key: _SCALES.pop(key, None)), scale._version, converted)
    return converted


def run_kernel(kernel: str, x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (R, in) float, weight (out, in) int8, scale (out,) [, bias (out,)] -> (R, out) in x2's dtype."""
    if kernel == "native-avx2":
        return _native(x2, weight, scale, bias)
    if kernel == "native-a16":
        return _native(x2, weight, scale, bias, kernel)
    if kernel == "dequant" or not _i8pack_ok(x2, weight):
        y = F.linear(x2, weight.to(x2.dtype)) * _scale_as(scale, x2.dtype)
        return y if bias is None else y + bias
    if kernel == "i8pack-bf16" and x2.dtype != torch.bfloat16:
        y = _I8PACK(_aligned(x2.to(torch.bfloat16)), weight, _scale_as(scale, torch.bfloat16))  # (R, out) bf16
        # back to x2's dtype: one op, the bias add promoting the bfloat16 product (same values as cast, then add)
        if bias is None or bias.dtype != x2.dtype:
            y = y.to(x2.dtype)
            return y if bias is None else y + bias
        return torch.add(bias, y)
    y = _I8PACK(_aligned(x2), weight, _scale_as(scale, x2.dtype))
    return y if bias is None else y + bias


def _native(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None, kernel: str = "native-avx2") -> torch.Tensor:
    """A C kernel (native-avx2, or native-a16), for what it takes: CPU, float32 activations, 2-D;
    anything else (a dtype or device it lacks) raises NotImplementedError, so the measurement leaves it
    out for that dtype. Inputs that need a gradient take dequant (the C kernels are not differentiable)."""
    if not x2.is_cpu or x2.dtype != torch.float32 or x2.dim() != 2:  # is_cpu: no device object per product
        raise NotImplementedError(f"{kernel} takes 2-D float32 CPU activations, not {x2.dtype} on {x2.device}")
    if torch.is_grad_enabled() and x2.requires_grad:
        return run_kernel("dequant", x2, weight, scale, bias)
    plain_bias = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.is_cpu)
    x2, weight, scale = x2.contiguous(), weight.contiguous(), _scale_as(scale, torch.float32).contiguous()
    b = bias if plain_bias else None
    y = (native.run_int8_linear(x2, weight, scale, b) if kernel == "native-avx2"
         else native.run_int8act_linear(x2, weight, scale, b, "avx2-a16"))
    return y if plain_bias else y + bias


def _time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def screen(screened: Mapping[str, float], hopeless: float = _HOPELESS) -> set[str]:
    """The candidates worth timing on the whole matrix, from their times on the screening slice: all
    but those more than `hopeless` times slower than the fastest."""
    fastest = min(screened.values())
    return {k for k, t in screened.items() if t <= hopeless * fastest}


TOLERANCE = 3e-2  # of the reference's largest value: bfloat16 rounding passes, a wrong kernel does not


def disagreement(y: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Why a candidate's product `y` is not `reference` (float32, computed apart), or None when every
    value is within TOLERANCE of the reference's largest value: bfloat16 activations round to 2^-8,
    while zeros, garbage, a wrong shape or NaNs are off by the product itself."""
    if y.shape != reference.shape:
        return f"shape {tuple(y.shape)}, expected {tuple(reference.shape)}"
    err = (y.float() - reference).abs().max().item() if y.numel() else 0.0
    scale = reference.abs().max().item() if reference.numel() else 0.0
    if not err <= TOLERANCE * scale + 1e-6:  # `not <=`: a NaN fails too
        return f"off by up to {err:.3g} where the product's largest value is {scale:.3g}"
    return None


ROUNDS = kernel_choice.ROUNDS
_SAMPLE_S = 2e-3  # a sample repeats the product until it takes about this long (many products for single rows)


@torch.inference_mode()
def measure(device: torch.device, dtype: torch.dtype, rows: int, in_features: int = 768,
            out_features: int = 3072, reps: int = 3, *, hopeless: float = _HOPELESS,
            candidates: Mapping[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
            ) -> dict[str, float]:
    """Seconds per product of each candidate (the median of `sample`'s rounds, at least `reps`)."""
    got = sample(device, dtype, rows, in_features, out_features, max(reps, 1), hopeless=hopeless,
                 candidates=candidates)
    return {k: statistics.median(v) for k, v in got.items()}


@torch.inference_mode()
def sample(device: torch.device, dtype: torch.dtype, rows: int, in_features: int = 768,
           out_features: int = 3072, rounds: int = ROUNDS, *, hopeless: float = _HOPELESS,
           candidates: Mapping[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
           float32: bool = False) -> dict[str, list[float]]:
    """Seconds per product of each candidate on a random (out, in) int8 matrix and `rows` rows, one
    sample per round, in `rounds` interleaved rounds (the order rotated each round, so no candidate
    always runs after the same one); a sample repeats the product until it takes _SAMPLE_S. GPT-2 124M's
    c_fc size by default: big enough to stream from memory like the real matrices, small enough to
    time in milliseconds. `candidates` (name -> fn(x, w, s)) are KERNELS through run_kernel unless
    given. `float32`: also sample the float32 product on the same matrix (F.linear on the column-major
    layout decode.layout gives float32 models), as "float32", the bound kernel_choice.decide applies.

    Before any timing, each candidate's product on a slice of 1/16 of the matrix's rows (its warm-up)
    is compared with the float32 reference (`disagreement`); one that differs is left out, with a
    RuntimeWarning, and listed by `unavailable()` (a wrong kernel must never win by being fast), as is
    one that raises. Each is then timed once on the slice; one more than `hopeless` times slower
    there than the fastest (`screen`) is not run on the whole matrix (its one sample is the slice's,
    scaled by 16): the float32 scalar loop of `i8pack` would take seconds at prompt sizes. The rest run
    on the whole matrix once, untimed, checked against the reference again, then sampled. (The whole
    matrix, not a smaller one, decides: which kernel wins at a few hundred rows depends on whether
    it fits in cache.) GPT2KIT_KERNEL_TIMINGS, where set, replaces the samples (not the checks)."""
    if device.type == "cpu":
        native.int8_linear()  # built (or loaded) before anything is timed
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g).to(device)
    s = (torch.rand(out_features, generator=g) / 127).to(device)
    x = torch.randn(rows, in_features, generator=g).to(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    part = max(1, out_features // 16)
    reference = F.linear(x.float(), w.float()) * s.float()  # (rows, out) float32, computed apart

    if candidates is None:
        candidates = {k: (lambda x, w, s, k=k: run_kernel(k, x, w, s)) for k in KERNELS
                      if not (k == "i8pack-bf16" and dtype == torch.bfloat16)}  # that one is i8pack there
    where = f"{device.type} {str(dtype).removeprefix('torch.')}"
    fns, screened = {}, {}
    for k, kernel in candidates.items():
        def fn(kernel=kernel, w=w, s=s):
            y = kernel(x, w, s)
            sync()
            return y
        try:  # the warm-up on the slice, checked; a kernel this device or dtype lacks is left out
            wrong = disagreement(fn(w=w[:part], s=s[:part]), reference[:, :part])
            if wrong is None:
                screened[k] = 16 * _time(lambda fn=fn: fn(w=w[:part], s=s[:part]), 1)
        except (NotImplementedError, RuntimeError) as e:
            if k == "dequant" or isinstance(e, torch.OutOfMemoryError):
                raise
            _UNAVAILABLE[f"{where} {k}"] = _first_line(e)
            continue
        if wrong is not None:
            _left_out_as_wrong(f"{where} {k}", wrong)
            continue
        fns[k] = fn
    if not screened:
        raise RuntimeError(f"no int8 kernel computed the right product on {where}: {unavailable()}")
    fns = {k: fn for k, fn in fns.items() if k in screen(screened, hopeless)}
    for k, fn in list(fns.items()):  # the whole matrix once, untimed, checked
        wrong = disagreement(fn(), reference)
        if wrong is not None:
            _left_out_as_wrong(f"{where} {k}", wrong)
            del fns[k], screened[k]
    if float32:
        w32 = (w.float() * s.float()[:, None]).t().contiguous().t()  # (out, in), column-major
        x32 = x.float()
        fns["float32"] = lambda: (F.linear(x32, w32), sync())
    samples = {k: [t] for k, t in screened.items() if k not in fns}  # the screened-out: the slice's time
    forced = kernel_choice.forced_timings()
    if forced is not None:
        return {k: forced[k] for k in [*samples, *fns] if k in forced}
    return samples | _rounds(fns, rounds)


def _rounds(fns: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    names = list(fns)
    reps = {}
    for k in names:  # how many products make a sample of _SAMPLE_S
        reps[k] = max(1, min(200, math.ceil(_SAMPLE_S / max(_time(fns[k], 1), 1e-7))))
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(reps[k]):
                fns[k]()
            out[k].append((time.perf_counter() - t0) / reps[k])
    return out


def _left_out_as_wrong(where: str, wrong: str) -> None:
    _UNAVAILABLE[where] = f"wrong result: {wrong}"
    warnings.warn(f"int8 kernel {where.rsplit(' ', 1)[-1]} computed a wrong product in the measurement on "
                  f"{where.rsplit(' ', 1)[0]} ({wrong}); it is left out", RuntimeWarning, stacklevel=4)


# The family's known-good kernel per rows bucket, in preference order (the first that runs and passes the
# checks; a measured one replaces it by being MARGIN faster). Prompts on the avx512 family: native-a16.
_FEW = ("native-avx2", "i8pack-bf16", "i8pack", "dequant")
_A16 = ("native-a16", *_FEW)
_FLOAT32 = {"1": _FEW, "few": _FEW, "many": _FEW, "prefill": ("native-avx2", "dequant"), "long": ("dequant",)}
DEFAULTS = {
    "float32": _FLOAT32,
    "float32 avx512": {**_FLOAT32, "many": _A16, "prefill": _A16, "long": ("native-a16", "dequant")},
    "bfloat16": {"1": ("i8pack", "dequant"), "few": ("i8pack", "dequant"), "many": ("i8pack", "dequant"),
                 "prefill": ("dequant",), "long": ("dequant",)},
}
_BOUNDED = ("1", "few")  # weight streaming: int8 must beat the float32 product
# Decode steps never take native-a16: single rows run in the native step on native-avx2's product, and whole
# batch-8 steps ran slower on it than on i8pack-bf16 though its product alone measured ahead (docs/benchmarks.md).
_STEP_BARRED = {"1": {"native-a16"}, "few": {"native-a16"}}


def check_kernel(name: str, device: torch.device | str = "cpu", given_as: str | None = None) -> str:
    """`name` if it is a kernel that can run on `device` here; ValueError naming it (as `given_as`,
    default GPT2KIT_INT8_KERNEL=) and the choices otherwise."""
    return kernel_choice.check_named(name, KERNELS, _why_not, device, f"{given_as or ENV + '='}{name!r}",
                                     "a kernel")


def _why_not(kernel: str, device: torch.device) -> str | None:
    if kernel == "native-avx2":
        if device.type != "cpu":
            return f"gpt2kit's native kernel runs on CPU, not {device.type}"
        return native.why_unavailable()
    if kernel == "native-a16":
        if device.type != "cpu":
            return f"gpt2kit's native kernel runs on CPU, not {device.type}"
        return native.why_int8act_unavailable("avx2-a16")
    if kernel.startswith("i8pack") and _I8PACK is None:
        return f"this torch ({torch.__version__}) has no _weight_int8pack_mm"
    return None


def _default(dtype: torch.dtype, bucket: str, measured: Mapping[str, object]) -> str:
    fam = kernel_choice.family()
    table = DEFAULTS["bfloat16" if dtype in (torch.bfloat16, torch.float16)
                     else "float32 avx512" if fam == "avx512" else "float32"]
    prefs = table[bucket] if fam != "other" else ("dequant",)
    return next((k for k in prefs if k in measured), min(measured, key=lambda k: KERNELS.index(k)
                                                          if k in KERNELS else len(KERNELS)))


def choose(device: torch.device, dtype: torch.dtype, rows: int) -> str:
    """The kernel for products of `rows` rows of `dtype` activations on `device`: GPT2KIT_INT8_KERNEL
    when set (checked: ValueError for an unknown or unavailable one), else `decide_for`'s choice,
    made once per process and rows bucket (1, 2-16, 17-128, 129-512, more)."""
    forced = os.environ.get(ENV)
    if forced:
        return check_kernel(forced, device)
    key = (device.type, dtype, _bucket(rows))
    kernel = _CHOSEN.get(("int8", key))
    if kernel is None:
        kernel = decide_for(device, dtype, rows).kernel
    return kernel


def decide_for(device: torch.device, dtype: torch.dtype, rows: int, *, fresh: bool = False) -> kernel_choice.Choice:
    """How products of `rows` rows are run here, and why: the choice stored for this machine and bucket
    (its kernel checked against the float32 reference first), else a measurement (`sample`, at 1, 8,
    64, 256 or 1,024 rows) decided by kernel_choice.decide against the family's default (DEFAULTS) and,
    for a few rows, the float32 product; a measured choice is stored. `fresh`: measure even where a
    choice is stored. The result is this process's choice for the bucket from then on."""
    device = torch.device(device)
    key = (device.type, dtype, _bucket(rows))
    name = f"int8 {device.type} {str(dtype).removeprefix('torch.')} {key[2]} threads={torch.get_num_threads()}"
    rows = _BUCKET_ROWS[key[2]]

    barred = _STEP_BARRED.get(key[2], set())

    def still_right(kernel: str) -> bool:
        return (kernel in KERNELS and kernel not in barred and not _why_not(kernel, device)
                and _still_right(kernel, device, dtype, rows))

    def take() -> dict[str, list[float]]:
        return {k: v for k, v in sample(device, dtype, rows, float32=key[2] in _BOUNDED).items() if k not in barred}

    return kernel_choice.REGISTRY.settle("int8", key, name, still_right, lambda: kernel_choice.measured(
        take, "dequant", lambda m: _default(dtype, key[2], m), "float32"), fresh=fresh)


@torch.inference_mode()
def _still_right(kernel: str, device: torch.device, dtype: torch.dtype, rows: int) -> bool:
    """Whether a stored kernel still computes the product here (a library rebuilt wrong is never kept)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (192, 768), dtype=torch.int8, generator=g).to(device)
    s = (torch.rand(192, generator=g) / 127).to(device)
    x = torch.randn(min(rows, 64), 768, generator=g).to(device, dtype)
    try:
        wrong = disagreement(run_kernel(kernel, x, w, s), F.linear(x.float(), w.float()) * s.float())
    except (NotImplementedError, RuntimeError) as e:
        wrong = _first_line(e)
    if wrong is not None:
        where = f"{device.type} {str(dtype).removeprefix('torch.')} {kernel}"
        _left_out_as_wrong(where, wrong)
    return wrong is None


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ (weight (out, in) int8 * scale (out,))^T + bias -> (..., out), in x's dtype."""
    if x.dim() == 2:  # (R, in): the decode step's rows, no reshape
        return _run(choose(x.device, x.dtype, x.shape[0]), x, weight, scale, bias)
    x2 = x.reshape(-1, x.shape[-1])  # (R, in)
    y = _run(choose(x.device, x.dtype, x2.shape[0]), x2, weight, scale, bias)  # (R, out)
    return y.view(*x.shape[:-1], weight.shape[0])


def _run(kernel: str, x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """run_kernel, falling back to dequant (with one warning per shape) where the chosen op refuses a
    shape the measurement did not try: its contract on devices not tested here (CUDA) is not known."""
    if kernel == "dequant":
        return run_kernel(kernel, x2, weight, scale, bias)
    try:
        return run_kernel(kernel, x2, weight, scale, bias)
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        where = f"{x2.device.type} {str(x2.dtype).removeprefix('torch.')} {kernel} {tuple(weight.shape)}"
        if where not in _UNAVAILABLE:
            _UNAVAILABLE[where] = _first_line(e)
            warnings.warn(f"int8 kernel {kernel} failed on {where} ({_first_line(e)}); using dequant there",
                          RuntimeWarning, stacklevel=3)
        return run_kernel("dequant", x2, weight, scale, bias)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def chosen() -> dict[str, str]:
    """The kernels chosen so far in this process, e.g. {'cpu float32 1': 'i8pack-bf16'} (for bench)."""
    return {f"{d} {str(t).removeprefix('torch.')} {b}": c.kernel
            for (d, t, b), c in kernel_choice.REGISTRY.decisions("int8").items()}


def decisions() -> dict[str, kernel_choice.Choice]:
    """How each of chosen()'s kernels was chosen (source default / stored / measured, the medians)."""
    return {f"{d} {str(t).removeprefix('torch.')} {b}": c
            for (d, t, b), c in kernel_choice.REGISTRY.decisions("int8").items()}


def unavailable() -> dict[str, str]:
    """Kernels that failed in this process, by where they were tried, with the error's first line."""
    return dict(_UNAVAILABLE)


def forget() -> None:
    """Forget this process's choices and failures: the next product decides again (after the store,
    GPT2KIT_INT8_KERNEL's absence, or the native kernel changed; `bench --kernels --remeasure` measures anew)."""
    kernel_choice.REGISTRY.forget("int8")
    _UNAVAILABLE.clear()


@runtime_checkable
class Int8Weights(Protocol):
    """A module whose product is int8_linear(x, weight, scale, bias) (the tied head's of an int8
    embedding: bias None): gpt2kit.quant.modules's QuantLinear and QuantEmbedding. int8_weights()
    gives those tensors, or None while the module runs another product (int8 activations): what
    decode.native_step may hand to C in the module's place."""

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None: ...
