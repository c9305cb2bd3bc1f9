"""oneDNN's products on a model's own float32 matrices, for steps of many rows (a prompt's prefill).

A prompt of hundreds of tokens is compute, not weight streaming: each product is a real GEMM. PyTorch's
F.linear runs it on MKL, then the GELU and the residual add as passes of their own over the (R, 4C) and
(R, C) results, and addmm first copies the bias into every row of its output. oneDNN's linear
(torch.ops.mkldnn._linear_pointwise) takes the bias, the tanh-GELU and the residual add into the GEMM
(post-ops) and reads the matrix where it lies (no copy kept: its per-call reorder of the weight is paid
once per product, small beside a product of hundreds of rows). Which is faster depends on the CPU (MKL
does not run its fastest code on every vendor's CPUs), so it is measured, not assumed:

  torch   F.linear, then the GELU and the add (what the spec's forward runs)
  onednn  oneDNN's linear with the bias, GELU and add fused in

The choice is kernel_choice's: the CPU family's default (DEFAULTS; only a family it was measured on
names onednn, docs/benchmarks.md), interleaved medians on the model's largest matrix at PROBE_ROWS rows
that override it only on clear evidence, the result stored per machine; GPT2KIT_PROMPT_KERNEL names
one outright. DnnKernels is the KernelSet (decode.bind) that runs it for steps of more than
plain.FEW_ROWS float32 CPU rows; every other step, and the LM head (a few rows: the last positions), runs
on the plain set it was made from. Rows are padded to decode.packed's buckets, as the packed products'
are, so prompts of every length keep a few dozen oneDNN primitives.

Legend: R rows, C n_embd.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import gpt2kit.decode.kernel_choice as kernel_choice
from gpt2kit.decode.bind import Binding, KernelSet, Mat, Op, Product
from gpt2kit.decode.packed import rows_bucket
from gpt2kit.decode.plain import FEW_ROWS, PlainKernels

ENV = "GPT2KIT_PROMPT_KERNEL"
KERNELS = ("torch", "onednn")
PROBE_ROWS = 256  # the rows of the measurement: a prompt's product, a quarter of a full context's
# The known-good kernel per CPU family (kernel_choice.family()); a measurement replaces it only by being
# MARGIN faster. onednn only where it was measured (docs/benchmarks.md, "Prompts on oneDNN").
DEFAULTS = {"amx": "torch", "avx512": "onednn", "avx2": "torch", "other": "torch"}
_CHOSEN = kernel_choice.REGISTRY.chosen  # ("prompt", rows of the probe matrix) -> kernel


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def check_kernel(name: str) -> str:
    """`name` if it is a prompt kernel that runs here; ValueError naming it and the choices otherwise."""
    return kernel_choice.check_named(name, KERNELS, _why_not, "cpu", f"{ENV}={name!r}", "a prompt kernel")


def _why_not(kernel: str, device: torch.device) -> str | None:
    if kernel == "torch":
        return None
    if device.type != "cpu":
        return f"oneDNN's linear runs on CPU, not {device.type}"
    return None if available() else "this torch build has no oneDNN linear"


class DnnKernels:
    """The flat loop's products of many float32 CPU rows on oneDNN (module doc); other steps on `plain`."""

    watches_versions = False  # the parameters themselves: edits are seen as they happen

    def __init__(self, plain: PlainKernels) -> None:
        self._plain = plain
        op = torch.ops.mkldnn._linear_pointwise
        self._unary, self._binary = op.default, op.binary

    @property
    def f32_kernel(self) -> str:
        return self._plain.f32_kernel

    def use_f32(self, kernel: str) -> None:
        self._plain.use_f32(kernel)

    def for_rows(self, rows: int, dtype: torch.dtype, cpu: bool) -> KernelSet:
        if rows > FEW_ROWS and dtype == torch.float32 and cpu:
            return self
        return self._plain.for_rows(rows, dtype, cpu)

    def bind(self, model: nn.Module) -> Binding:
        return Binding(model, self)

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def op(self, product: Product, role: str) -> Op:
        """x (R, in) @ W^T + b on oneDNN with the GELU or the residual add fused in; the head (the last
        positions' few rows) and a swapped-in module as the plain set runs them."""
        if product.__class__ is not Mat or role == "head" or product.weight.dtype != torch.float32:
            return self._plain.op(product, role)
        w, b = product
        if role == "add":
            fn = self._binary

            def add(x: torch.Tensor, residual: torch.Tensor, *args) -> torch.Tensor:
                return fn(rows_bucket(x), rows_bucket(residual), *args)[:x.shape[0]]  # (R, out)
            return Op(add, (w, b, "add"), True)
        fn = self._unary

        def run(x: torch.Tensor, *args) -> torch.Tensor:
            return fn(rows_bucket(x), *args)[:x.shape[0]]  # (R, out)
        if role == "gelu":
            return Op(run, (w, b, "gelu", [], "tanh"), True)
        return Op(run, (w, b, "none", [], ""))


def forced() -> str | None:
    name = os.environ.get(ENV)
    return check_kernel(name) if name else None


def default_kernel() -> str:
    kernel = DEFAULTS[kernel_choice.family()]
    return kernel if not _why_not(kernel, torch.device("cpu")) else "torch"


def choose(weight: torch.Tensor, bias: torch.Tensor | None, *, fresh: bool = False,
           rounds: int = kernel_choice.ROUNDS) -> kernel_choice.Choice:
    """How products of many float32 rows run here: GPT2KIT_PROMPT_KERNEL when set; else this process's
    choice, the one stored for this machine, or interleaved rounds of F.linear + GELU against oneDNN's
    fused product on `weight` (the model's MLP c_fc, (4C, C)) at PROBE_ROWS rows, decided by
    kernel_choice against the family default; a measured choice is stored."""
    key = tuple(weight.shape)
    if forced():
        choice = kernel_choice.Choice(forced(), "forced", f"{ENV} is set")
        kernel_choice.REGISTRY.set("prompt", key, choice)
        return choice
    if ("prompt", key) in _CHOSEN and not fresh:
        return kernel_choice.REGISTRY.decisions("prompt")[key]
    bucket = f"prompt f32 cpu {PROBE_ROWS} rows {key[0]}x{key[1]} threads={torch.get_num_threads()}"

    def still_right(kernel: str) -> bool:
        return kernel in KERNELS and not _why_not(kernel, torch.device("cpu"))

    return kernel_choice.REGISTRY.settle(
        "prompt", key, bucket, still_right,
        lambda: kernel_choice.measured(lambda: sample(weight, bias, rounds), default_kernel()), fresh=fresh)


def sample(weight: torch.Tensor, bias: torch.Tensor | None, rounds: int) -> dict[str, list[float]]:
    """Seconds per product (x (PROBE_ROWS, in) @ W^T + b, then the tanh-GELU) for each kernel that runs
    here, in `rounds` interleaved rounds (GPT2KIT_KERNEL_TIMINGS replaces the timings)."""
    cands = [k for k in KERNELS if _why_not(k, torch.device("cpu")) is None]
    timings = kernel_choice.forced_timings()
    if timings is not None:
        return {k: v for k, v in timings.items() if k in cands}
    x = torch.randn(PROBE_ROWS, weight.shape[1])
    fns = {"torch": lambda: F.gelu(F.linear(x, weight, bias), approximate="tanh")}
    if "onednn" in cands:
        op = DnnKernels(PlainKernels()).op(Mat(weight, bias), "gelu")
        fns["onednn"] = lambda: op.fn(x, *op.args)
    out: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round warms up
            for k in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                fns[k]()
                if r:
                    out[k].append(time.perf_counter() - t0)
    return out


def decisions() -> dict[tuple, kernel_choice.Choice]:
    """How each matrix shape's prompt kernel was chosen in this process."""
    return kernel_choice.REGISTRY.decisions("prompt")
