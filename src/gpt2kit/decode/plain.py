"""The plain kernels of the flat decode step: x (R, in) @ W^T (+ b) for a handful of rows R.

A decode step pushes a few rows through each weight matrix, so the matrix's bytes are the whole
cost and how the GEMM kernel handles a tiny M decides the speed. For bfloat16/float16 on CPU,
x @ W^T (F.linear) can be slow there while W @ x^T (torch.mv for one row, mm for a few) reads a
row-major W faster; float32 stays on F.linear, fastest on MKL when W is stored (in, out), the layout
decode.layout puts it in. Which is faster differs between CPUs (docs/benchmarks.md), so for the
half-precision types the choice is made on the model's own matrices (choose_half_kernels: "mv" by
default, another only on clear evidence, stored per machine by decode/kernel_choice.py) rather than assumed.

PlainKernels is the KernelSet (decode.bind) on these products: the model's own parameters, no copies;
decode.packed's set runs on prepacked copies. A layer that is not a plain nn.Linear (a quantized or
adapted module swapped in) is called as the module it is.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gpt2kit.decode.f32 as f32
import gpt2kit.decode.kernel_choice as kernel_choice
from gpt2kit.decode.bind import Binding, Mat, Op, Product

FEW_ROWS = 16  # up to this many rows a decode product is weight streaming, not compute

# How half-precision few-row products run on this machine: "linear" (F.linear) or "mv" (W @ x^T),
# for one row and for 2..FEW_ROWS rows; measured on first use (choose_half_kernels).
_CHOSEN = kernel_choice.REGISTRY.chosen  # ("half", (dtype, a single row)) -> kernel
HALF_KERNELS = ("mv", "linear")


def matmul_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x (..., in), weight (out, in) -> (..., out), by the kernel that is
    fastest here for few rows."""
    rows = x.numel() // x.shape[-1]
    if (rows > FEW_ROWS or x.device.type != "cpu" or weight.dtype == torch.float32
            or not weight.is_contiguous()
            or _CHOSEN.get(("half", (weight.dtype, rows == 1)), "mv") == "linear"):
        return F.linear(x, weight, bias)
    return _w_times_xt(x, weight, bias, rows)


def _w_times_xt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    x2 = x.reshape(rows, x.shape[-1])  # (R, in)
    if rows == 1:
        y = torch.mv(weight, x2[0])[None]  # (1, out)
    else:
        y = torch.mm(weight, x2.t()).t()  # (R, out)
    if bias is not None:
        y = y + bias  # a separate add: addmv/addmm's fused bias is many times slower on some CPUs
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def choose_half_kernels(weight: torch.Tensor, trials: int = kernel_choice.ROUNDS, remeasure: bool = False) -> None:
    """Decide F.linear against W @ x^T on `weight` (a model's largest block matrix, bf16/fp16, CPU)
    for 1 and 8 rows, once per dtype per process: the choice stored for this machine, else `trials`
    interleaved rounds decided by kernel_choice.decide against the default ("mv"); a measured choice
    is stored (decode/kernel_choice.py). `remeasure`: measure again, stored or not."""
    if weight.device.type != "cpu" or weight.dtype == torch.float32 or not weight.is_contiguous():
        return
    for single in (True, False):
        key = (weight.dtype, single)
        if ("half", key) in _CHOSEN and not remeasure:
            continue
        rows = 1 if single else 8
        bucket = (f"half {str(weight.dtype).removeprefix('torch.')} {'1 row' if single else f'2-{FEW_ROWS} rows'} "
                  f"{weight.shape[0]}x{weight.shape[1]} threads={torch.get_num_threads()}")
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        bias = torch.zeros(weight.shape[0], dtype=weight.dtype)
        cands = {"linear": lambda x=x, b=bias: F.linear(x, weight, b),
                 "mv": lambda x=x, b=bias, r=rows: _w_times_xt(x, weight, b, r)}

        def take(cands=cands):
            with torch.inference_mode():
                got = kernel_choice.forced_timings() or _interleaved(cands, trials)
            return {k: v for k, v in got.items() if k in cands}
        kernel_choice.REGISTRY.settle("half", key, bucket, HALF_KERNELS.__contains__,
                                      lambda take=take: kernel_choice.measured(take, "mv"), fresh=remeasure)


def _interleaved(cands: dict, rounds: int) -> dict[str, list[float]]:
    for fn in cands.values():
        fn()  # warm-up
    out: dict[str, list[float]] = {k: [] for k in cands}
    names = list(cands)
    for r in range(rounds):
        for k in names[r % 2:] + names[:r % 2]:
            t0 = time.perf_counter()
            cands[k]()
            out[k].append(time.perf_counter() - t0)
    return out


def _median_time(fn, trials: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]  # the median: robust to a busy neighbour


@functools.lru_cache(maxsize=1)
def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 / AMX, as oneDNN reports);
    without it bfloat16 products are emulated, far slower than float32 ones. The one such check."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the op
        return False


@functools.lru_cache(maxsize=1)
def bfloat16_decodes_faster(trials: int = 7) -> bool:
    """Whether products with a GPT-2-sized (3072, 768) matrix run faster in bfloat16 (by the kernel
    choose_half_kernels picks) than in float32 (MKL on the column-major layout) on this CPU, for one
    row and for a batch of 8 rows alike: what --dtype auto decides by. (On CPUs without native bf16
    one row can be faster in bf16 while batches and prefill are much slower; auto keeps float32
    there.) Measured once per process (a few milliseconds)."""
    w32 = torch.randn(768, 3072).t()  # (3072, 768), stored column-major as use_decode_layout keeps it
    w16 = w32.to(torch.bfloat16).contiguous()
    choose_half_kernels(w16)
    b32 = torch.randn(3072)
    b16 = b32.to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 8):
            x32 = torch.randn(rows, 768)
            x16 = x32.to(torch.bfloat16)
            t32 = _median_time(lambda x=x32: matmul_t(x, w32, b32), trials)
            t16 = _median_time(lambda x=x16: matmul_t(x, w16, b16), trials)
            if t16 >= t32:
                return False
    return True


def half_kernel_choice() -> dict[str, str]:
    """What choose_half_kernels picked, e.g. {"bfloat16/1 row": "mv", "bfloat16/2-16 rows": "linear"}."""
    return {name: c.kernel for name, c in half_decisions().items()}


def half_decisions() -> dict[str, kernel_choice.Choice]:
    """How each of half_kernel_choice()'s kernels was chosen (default / stored / measured, the medians)."""
    return {f"{str(d).removeprefix('torch.')}/{'1 row' if one else f'2-{FEW_ROWS} rows'}": c
            for (d, one), c in kernel_choice.REGISTRY.decisions("half").items()}


class PlainKernels:
    """The flat loop's products on the model's own parameters (no copies): a KernelSet (decode.bind).

    The product is matmul_t (a few half-precision rows), F.linear outright where a step's shape makes
    it matmul_t's choice (a sibling set, for_rows), or, for single float32 rows, the kernel use_f32
    named (decode.f32)."""

    watches_versions = False  # the parameters themselves: edits are seen as they happen

    def __init__(self, *, _product: Callable = matmul_t) -> None:
        self.product = _product  # matmul_t, or F.linear where a step's shape makes it matmul_t's choice
        self._linear = self if _product is F.linear else PlainKernels(_product=F.linear)
        self._f32: PlainKernels | None = None  # single float32 rows on gpt2kit's kernel (use_f32)
        self.f32_kernel = "torch"  # what this set's single float32 rows run on (decode.f32.KERNELS)

    def use_f32(self, kernel: str) -> None:
        """Run single float32 rows on `kernel` (one of decode.f32.KERNELS; "torch": F.linear)."""
        self._f32 = None if kernel == "torch" else PlainKernels(_product=f32.product(kernel))
        self.f32_kernel = self._linear.f32_kernel = kernel
        if self._f32 is not None:
            self._f32.f32_kernel = kernel

    def for_rows(self, rows: int, dtype: torch.dtype, cpu: bool) -> PlainKernels:
        """The set for a step of `rows` rows: F.linear outright where matmul_t would choose it for
        every matrix (float32, off the CPU, many rows, or half precision measured faster that way),
        so the products carry no per-call checks; a single float32 row on the kernel use_f32 named."""
        if rows == 1 and dtype == torch.float32 and cpu and self._f32 is not None:
            return self._f32
        if (rows > FEW_ROWS or not cpu or dtype == torch.float32
                or _CHOSEN.get(("half", (dtype, rows == 1)), "mv") == "linear"):
            return self._linear
        return self

    def bind(self, model: nn.Module) -> Binding:
        return Binding(model, self)

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def op(self, product: Product, role: str) -> Op:
        """The product on this set's function; the loop applies the GELU and adds the residual."""
        if product.__class__ is not Mat:
            return Op(product, ())
        return Op(self.product, (product.weight,) if role == "head" else (product.weight, product.bias))
