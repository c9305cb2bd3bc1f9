"""Model-FLOPs utilisation (MFU): the share of the machine's matrix-product rate that a training step's
arithmetic uses, as nanoGPT and llm.c report it beside tokens/s.

Model FLOPs per token (nanoGPT's `estimate_mfu`, after the PaLM paper's appendix B):

    6 N + 12 L T C

N the parameters that take part in products (every parameter but the position embedding, which is
only looked up; the tied token embedding counts once, as the head), 6 = a product's 2 FLOPs a
parameter forward and 4 backward (the input's gradient and the weight's); 12 L T C the attention's
scores and weighted sum, forward and backward, over the full T x T square as the formula has it. A
frozen matrix (a LoRA or --train-only run) skips its weight gradient: 4 FLOPs a parameter instead of 6.

The rate it is a share of: on a GPU whose bfloat16/float16 tensor-core peak is published, that peak
(dense, no sparsity); anywhere else — every CPU, and a float32 run on a GPU — the rate this machine's
product library reaches here, measured for the run's dtype on square products (up to 1024 on a CPU,
4096 on a GPU), so 100% is the best this machine does, not a data-sheet figure it never reaches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

# Dense bfloat16/float16 tensor-core peaks (FLOP/s) from the vendors' data sheets, by a name fragment
# torch.cuda.get_device_name reports; the first fragment that occurs in the name wins.
GPU_PEAKS = (
    ("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100", 989.4e12), ("GH200", 989.4e12),
    ("A100", 312.0e12), ("A10G", 70.0e12), ("A10", 125.0e12), ("L40S", 362.1e12), ("L4", 121.0e12),
    ("RTX 4090", 165.2e12), ("RTX 3090", 71.0e12),
)


@dataclass(frozen=True)
class PeakRate:
    flops: float  # FLOP/s
    source: str  # "measured" or the data sheet's device name

    def describe(self) -> str:
        if self.flops >= 1e12:
            return f"{self.flops / 1e12:,.1f} TFLOP/s ({self.source})"
        return f"{self.flops / 1e9:,.1f} GFLOP/s ({self.source})"


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Model FLOPs of one training token for `model` (a GPT2, or one wrapped: its `config` and named
    parameters are read) at sequence length `seq_len`; see the module docstring."""
    cfg = model.config
    total = 0.0
    for name, p in model.named_parameters():
        if name.endswith("wpe.weight"):
            continue
        total += (6 if p.requires_grad else 4) * p.numel()
    return total + 12 * cfg.n_layer * seq_len * cfg.n_embd


def peak_rate(device: torch.device, dtype: torch.dtype) -> PeakRate:
    """The rate MFU is a share of (see the module docstring): a published GPU peak for a half-precision
    run on a GPU this table knows, else the measured rate of square products in `dtype` on `device`."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for fragment, flops in GPU_PEAKS:
            if fragment in name:
                return PeakRate(flops, f"{name} data sheet, dense {str(dtype).removeprefix('torch.')}")
    return PeakRate(measured_gemm_rate(device, dtype), f"measured, {str(dtype).removeprefix('torch.')} products")


def measured_gemm_rate(device: torch.device, dtype: torch.dtype, size: int | None = None,
                       budget_s: float = 0.2) -> float:
    """FLOP/s of the best of a few (n, n) x (n, n) products in `dtype`: n = `size`, or the largest of
    256, 512, 1024 (4096 on a GPU) whose product takes under a tenth of `budget_s` — a machine that
    emulates the dtype slowly is measured on a smaller product rather than for seconds."""
    sizes = [size] if size else [256, 512, 1024] + ([2048, 4096] if device.type == "cuda" else [])
    best, n = float("inf"), sizes[0]
    for n in sizes:
        gen = torch.Generator(device=device).manual_seed(0)  # its own: the run's random state is untouched
        a = torch.randn(n, n, device=device, generator=gen).to(dtype)
        b = torch.randn(n, n, device=device, generator=gen).to(dtype)
        _timed_mm(a, b, device)  # warm-up
        best = _timed_mm(a, b, device)
        if best > budget_s / 10:
            break
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s / 2:
        best = min(best, _timed_mm(a, b, device))
    return 2.0 * n ** 3 / best


def _timed_mm(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(tokens_per_s: float, per_token: float, peak: PeakRate, world_size: int = 1) -> float:
    """The share (0..1) of `world_size` devices' peak that `tokens_per_s` (the whole run's) uses."""
    return tokens_per_s * per_token / (peak.flops * world_size)
