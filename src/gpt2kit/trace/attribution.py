"""Attribution patching (Nanda 2023): the gradient approximation of activation patching.

Patching activation a from clean into corrupted changes the metric by about
(a_clean - a_corrupt) . d metric / d a, the gradient taken on the corrupted run. One plain forward
of the clean input and one forward + backward of the corrupted input give it for every cell of a
patching grid at once (gpt2kit.trace.patching's modes: resid, attn, mlp, heads, heads-pos). The
gradient is read at the same hooks patching writes through (gpt2kit.trace.points), with
torch.autograd.grad, so no parameter's .grad is touched. Legend: T tokens, nh heads, hs head size.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from gpt2kit.trace.metrics import Metric
from gpt2kit.trace.points import at_cell, capture_run, edit_hooks


def _grads(model, ids: Sequence[int], names: list[str], metric: Metric) -> tuple[dict, dict, float]:
    """The corrupted run's activations, d metric / d activation at each name (no batch axis), the metric."""
    held: dict[str, torch.Tensor] = {}

    def grab(name):
        def fn(x):
            # the tensor the rest of the network reads from here on, so the gradient is the full one
            y = x.clone() if x.requires_grad else x.detach().clone().requires_grad_()
            held[name] = y
            return y
        return fn

    idx = torch.tensor([list(ids)], device=model.wte.weight.device)
    with torch.enable_grad(), edit_hooks(model, [(n, grab(n)) for n in names]):
        m = metric(model(idx).logits[:, -1])[0]
        grads = torch.autograd.grad(m, [held[n] for n in names])
    return ({n: held[n].detach()[0] for n in names}, {n: g[0] for n, g in zip(names, grads, strict=True)},
            float(m.detach()))


def attribute(model, pairs: Sequence[tuple[Sequence[int], Sequence[int], Metric]], cells: list[tuple],
              shape: tuple[int, int]) -> dict:
    """For each grid cell (row, col, name, head, position): the estimated metric change of patching
    it, mean over pairs, and the fraction of the clean - corrupted difference it would restore."""
    names = sorted({c[2] for c in cells})
    est = [[[] for _ in range(shape[1])] for _ in range(shape[0])]
    denoms = []
    for clean, corrupt, mt in pairs:
        acts_c, logit_c = capture_run(model, clean, names)
        acts_x, grads, m_corrupt = _grads(model, corrupt, names, mt)
        denoms.append(float(mt(logit_c[None])[0]) - m_corrupt)
        for r, c, name, head, pos in cells:
            delta = at_cell(acts_c[name], head, pos).double() - at_cell(acts_x[name], head, pos).double()
            est[r][c].append(float((delta * at_cell(grads[name], head, pos).double()).sum()))
    mean = [[statistics.fmean(v) if v else None for v in row] for row in est]
    frac = [[statistics.fmean(e / d for e, d in zip(v, denoms, strict=True)) if v and all(denoms) else None
             for v in row] for row in est]
    return {"estimate": mean, "restored_estimate": frac, "denominators": denoms}


def agreement(exact: list[list[float | None]], estimate: list[list[float | None]]) -> dict:
    """How well the estimate tracks exact patching over the cells both have: Pearson correlation,
    the largest absolute difference, and the share of cells whose signs agree."""
    pairs = [(a, b) for ra, rb in zip(exact, estimate, strict=True) for a, b in zip(ra, rb, strict=True)
             if a is not None and b is not None]
    if not pairs:
        return {"cells": 0, "correlation": None, "max_abs_difference": None, "sign_agreement": None}
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    sx, sy = statistics.pstdev(xs), statistics.pstdev(ys)
    corr = None
    if sx > 0 and sy > 0:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        corr = statistics.fmean((a - mx) * (b - my) for a, b in pairs) / (sx * sy)
    signs = statistics.fmean(float(math.copysign(1, a) == math.copysign(1, b)) for a, b in pairs)
    return {"cells": len(pairs), "correlation": corr, "max_abs_difference": max(abs(a - b) for a, b in pairs),
            "sign_agreement": signs}
