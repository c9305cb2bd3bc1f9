"""Where a CPU model's weight matrices sit in memory for fast decoding: one explicit, documented call.

Decoding streams every matrix once per step, and on CPU the GEMM kernels for a handful of rows
stream some layouts much faster than others (docs/benchmarks.md): float32 matrices go column-major,
i.e. stored (in, out) as transformers' Conv1D (MKL then runs the products of a few rows faster);
bfloat16/float16 ones row-major (their mat-vec kernels read rows). Values, shapes and names do not
change. load_model applies it to the models it returns (HF and TF checkpoints arrive column-major
already); a model built in Python can be given it with use_decode_layout(model). Generation never
changes a model's layout itself. Training makes its parameters contiguous (row-major) first.
"""

from __future__ import annotations

import torch
from torch import nn


def use_decode_layout(model: nn.Module) -> nn.Module:
    """Store a CPU model's weight matrices in the layout its decode kernels read fastest, in place
    (a no-op where they already are, and for a model on another device). Returns the model."""
    if next(model.parameters()).device.type != "cpu":
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or name == "wpe.weight":
                continue
            if p.dtype == torch.float32 and p.stride() != (1, p.shape[0]):
                p.data = p.data.t().contiguous().t()  # (out, in) view of an (in, out) tensor
            elif p.dtype != torch.float32 and not p.is_contiguous():
                p.data = p.data.contiguous()
    return model
