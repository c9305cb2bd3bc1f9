"""The float32 single-row products of the decode step: PyTorch's or gpt2kit's own, chosen per machine.

A batch-1 float32 decode step reads every matrix once (495 MB for GPT-2 124M, the tied head
included), so it should run at the speed of streaming them from memory. PyTorch's F.linear on the
column-major layout decode/layout.py gives float32 models (MKL / oneDNN) may stream them below the
bandwidth; gpt2kit's C kernel (csrc/f32_linear.c, through decode/native.py) reads that layout row by
row of W^T, each thread its own contiguous columns. Which is faster is measured, not assumed:

  torch          F.linear (what every other float32 product runs on)
  native-avx512  csrc/f32_linear.c, AVX-512F (where the CPU has avx512f and PyTorch sees AVX-512)
  native-avx2    csrc/f32_linear.c, AVX2 + FMA

The choice is kernel_choice's: the CPU family's default (DEFAULTS: native-avx2 on AVX2-only CPUs, torch
elsewhere until measured otherwise), interleaved medians on the model's own matrices (a whole step's
products, so the weights stream from memory as they do when decoding) that override it only on clear
evidence, the result stored per machine and model shape; a candidate whose product differs from
F.linear's by more than float32 round-off is never chosen. GPT2KIT_F32_KERNEL names one outright
(checked: one line naming the choices). Steps of 2..MAX_ROWS rows (a small batch) run on
decode/packed.py's oneDNN-prepacked copies or on the C kernel, chosen the same way (decide_few:
FEW_DEFAULTS, the medians of a whole step's products at FEW_ROWS rows); more rows run on packed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import gpt2kit.decode.kernel_choice as kernel_choice
import gpt2kit.decode.native as native

ENV = "GPT2KIT_F32_KERNEL"
KERNELS = ("torch", "native-avx512", "native-avx2")
MAX_ROWS = 8  # the C kernel's few rows; more run on F.linear
# The known-good kernel per CPU family (kernel_choice.family()); the measurement may replace it only by
# being MARGIN faster. Only what was measured on such a CPU is named here (docs/benchmarks.md): on an
# AVX2-only EPYC the C kernel streams the weights near the bandwidth limit where F.linear does not, so a
# fresh install (nothing measured or stored yet) starts on it; a kernel that cannot be built here falls
# back to torch (default_kernel).
DEFAULTS = {"amx": "torch", "avx512": "torch", "avx2": "native-avx2", "other": "torch"}
_CHOSEN = kernel_choice.REGISTRY.chosen  # ("f32", model shape) -> kernel


def check_kernel(name: str, given_as: str | None = None) -> str:
    """`name` if it is a float32 kernel that runs here; ValueError naming it (as `given_as`, default
    GPT2KIT_F32_KERNEL=) and the choices otherwise."""
    return kernel_choice.check_named(name, KERNELS, _why_not, "cpu", f"{given_as or ENV + '='}{name!r}",
                                     "a float32 kernel")


def _why_not(kernel: str, device: torch.device) -> str | None:
    if kernel == "torch":
        return None
    if device.type != "cpu":
        return f"gpt2kit's native kernel runs on CPU, not {device.type}"
    return native.why_f32_unavailable(kernel.removeprefix("native-"))


def product(kernel: str) -> Callable:
    """The product function (x (R, in), weight (out, in), bias | None) -> (R, out) for `kernel`: F.linear,
    or the C kernel where a call fits it (float32, R <= MAX_ROWS, x contiguous, weight the transpose of a
    row-major matrix as decode/layout.py stores it) and F.linear for any other call."""
    if kernel == "torch":
        return F.linear
    fn, isa = native.f32_linear(), native.F32_ISAS[kernel.removeprefix("native-")]
    assert fn is not None, "product() of an unavailable kernel (check_kernel first)"

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (x.dim() != 2 or x.shape[0] > MAX_ROWS or weight.stride(0) != 1 or x.dtype != torch.float32
                or weight.dtype != torch.float32 or not x.is_contiguous() or not x.is_cpu
                or (bias is not None and not bias.is_contiguous())):
            return F.linear(x, weight, bias)
        M, K = x.shape
        N = weight.shape[0]
        y = torch.empty(M, N)  # (R, out)
        fn(x.data_ptr(), M, K, weight.data_ptr(), weight.stride(1), N, None if bias is None else bias.data_ptr(),
           y.data_ptr(), torch.get_num_threads(), isa)
        return y

    return linear


def bucket(shape: str) -> str:
    """The stored choice's name: single rows of a model of `shape` ("C x layers x V") at this thread count."""
    return f"f32 cpu 1 row {shape} threads={torch.get_num_threads()}"


def forced() -> str | None:
    """GPT2KIT_F32_KERNEL's kernel, checked (ValueError naming the choices), or None when it is unset."""
    name = os.environ.get(ENV)
    return check_kernel(name) if name else None


def chosen_kernel(shape: str) -> str | None:
    """The kernel decided for `shape` in this process (None: not decided yet), or the forced one."""
    return forced() or _CHOSEN.get(("f32", shape))


def decide_for(shape: str, mats: Sequence[tuple[torch.Tensor, torch.Tensor | None]], *,
               fresh: bool = False, rounds: int = kernel_choice.ROUNDS) -> kernel_choice.Choice:
    """How single-row float32 products of a model of `shape` run here, and why: GPT2KIT_F32_KERNEL when
    set; else the choice stored for this machine (checked against F.linear first), else interleaved
    rounds over `mats` ((weight, bias) of one step, in order) decided by kernel_choice against the
    family default; a measured choice is stored. `fresh`: measure even where one is stored."""
    if forced():
        choice = kernel_choice.Choice(forced(), "forced", f"{ENV} is set")
        kernel_choice.REGISTRY.set("f32", shape, choice)
        return choice

    def still_right(kernel: str) -> bool:
        return (kernel in KERNELS and not _why_not(kernel, torch.device("cpu"))
                and disagreement(kernel, mats[:1]) is None)

    return kernel_choice.REGISTRY.settle(
        "f32", shape, bucket(shape), still_right,
        lambda: kernel_choice.measured(lambda: sample(mats, rounds), default_kernel()), fresh=fresh)


def default_kernel() -> str:
    """This CPU family's default (DEFAULTS), or torch where that kernel cannot run here."""
    kernel = DEFAULTS[kernel_choice.family()]
    return kernel if not _why_not(kernel, torch.device("cpu")) else "torch"


def disagreement(kernel: str, mats: Sequence[tuple[torch.Tensor, torch.Tensor | None]], rows: int = 1) -> str | None:
    """Why `kernel`'s products of `rows` rows on `mats` are not F.linear's within float32 round-off (the
    bound 2 K eps sum_k |x_k w_k| covers both summation orders), or None when they are."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for w, b in mats:
            x = torch.randn(rows, w.shape[1], generator=g)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            got = product(kernel)(x, w, b).double()
            allowed = 2 * w.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t())
            allowed += torch.finfo(torch.float32).eps * ref.abs() + 1e-30
            if not bool(((got - ref).abs() <= allowed).all()):
                return f"{kernel} differs from F.linear on {tuple(w.shape)} beyond float32 round-off"
    return None


def sample(mats: Sequence[tuple[torch.Tensor, torch.Tensor | None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per step's products (every matrix of `mats` once, one row) for each candidate that runs
    here and agrees with F.linear, in `rounds` interleaved rounds (GPT2KIT_KERNEL_TIMINGS replaces the
    timings, never the agreement check)."""
    cands = [k for k in KERNELS if _why_not(k, torch.device("cpu")) is None
             and (k == "torch" or disagreement(k, mats[:2] + mats[-1:]) is None)]
    forced = kernel_choice.forced_timings()
    if forced is not None:
        return {k: v for k, v in forced.items() if k in cands}
    fns = {k: product(k) for k in cands}
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w, _ in mats}
    out: dict[str, list[float]] = {k: [] for k in cands}
    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round warms up
            for k in cands[r % len(cands):] + cands[:r % len(cands)]:
                fn = fns[k]
                t0 = time.perf_counter()
                for w, b in mats:
                    fn(xs[w.shape[1]], w, b)
                if r:
                    out[k].append(time.perf_counter() - t0)
    return out


# Steps of 2..MAX_ROWS float32 rows (a small batch) run on oneDNN's prepacked copies (decode/packed.py,
# "packed") or on the C kernel; per family the known-good one, replaced only by a measurement MARGIN faster.
FEW_DEFAULTS = {"amx": "packed", "avx512": "packed", "avx2": "packed", "other": "packed"}
FEW_ROWS = MAX_ROWS  # the rows of the measurement: the C kernel's most, a batch of 8


def few_bucket(shape: str) -> str:
    return f"f32 cpu 2-{MAX_ROWS} rows {shape} threads={torch.get_num_threads()}"


def chosen_few(shape: str) -> str | None:
    """The kernel decided for 2..MAX_ROWS rows of `shape` in this process (None: not decided yet)."""
    return _CHOSEN.get(("f32-few", shape))


def decide_few(shape: str, mats: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
               packed: Callable[[torch.Tensor], torch.Tensor], *, fresh: bool = False,
               rounds: int = kernel_choice.ROUNDS) -> kernel_choice.Choice:
    """How float32 steps of 2..MAX_ROWS rows of a model of `shape` run here: "packed" (oneDNN on the
    copies packed(weight) gives) or a C kernel (native-*), as single rows' choice is made: the choice
    stored for this machine, else interleaved rounds of a whole step's products at FEW_ROWS rows decided
    by kernel_choice against FEW_DEFAULTS; a measured choice is stored. `fresh`: measure even where one is."""
    def still_right(kernel: str) -> bool:
        return kernel == "packed" or (kernel in KERNELS[1:] and not _why_not(kernel, torch.device("cpu"))
                                      and disagreement(kernel, mats[:1], FEW_ROWS) is None)

    default = FEW_DEFAULTS[kernel_choice.family()]
    return kernel_choice.REGISTRY.settle(
        "f32-few", shape, few_bucket(shape), still_right,
        lambda: kernel_choice.measured(lambda: sample_few(mats, packed, rounds), default), fresh=fresh)


def sample_few(mats: Sequence[tuple[torch.Tensor, torch.Tensor | None]], packed: Callable[[torch.Tensor], torch.Tensor],
               rounds: int) -> dict[str, list[float]]:
    """Seconds per step's products at FEW_ROWS rows for "packed" and each C kernel that runs here and
    agrees with F.linear, in `rounds` interleaved rounds (GPT2KIT_KERNEL_TIMINGS replaces the timings)."""
    cands = ["packed"] + [k for k in KERNELS[1:] if _why_not(k, torch.device("cpu")) is None
                          and disagreement(k, mats[:2] + mats[-1:], FEW_ROWS) is None]
    forced = kernel_choice.forced_timings()
    if forced is not None:
        return {k: v for k, v in forced.items() if k in cands}
    op = torch.ops.mkldnn._linear_pointwise.default
    copies = [(packed(w), b) for w, b in mats]
    xs = {w.shape[1]: torch.randn(FEW_ROWS, w.shape[1]) for w, _ in mats}
    fns = {"packed": lambda: [op(xs[w.shape[1]], w, b, "none", [], "") for w, b in copies]}
    for k in cands[1:]:
        fn = product(k)
        fns[k] = lambda fn=fn: [fn(xs[w.shape[1]], w, b) for w, b in mats]
    out: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round warms up
            for k in cands[r % len(cands):] + cands[:r % len(cands)]:
                t0 = time.perf_counter()
                fns[k]()
                if r:
                    out[k].append(time.perf_counter() - t0)
    return out


def decisions() -> dict[str, kernel_choice.Choice]:
    """How each model shape's single-row float32 kernel was chosen in this process."""
    return kernel_choice.REGISTRY.decisions("f32")


def forget() -> None:
    """Forget this process's choices (the next decode decides again)."""
    kernel_choice.REGISTRY.forget("f32")
