"""Activation patching of the residual stream (causal tracing, Meng et al. 2022).

A clean and a corrupted input of equal token length. For each residual layer l (H^(0) .. H^(L))
and position p, the corrupted input runs with H^(l)[p] replaced by the clean run's; the metric is
the logit difference answer - foil at the last position, and each cell reports the fraction of the
clean-vs-corrupted difference the patch restores: (m_patched - m_corrupt) / (m_clean - m_corrupt).

The patch is a forward hook on the module whose output is H^(l) (`drop` for H^(0), block l-1
otherwise) that overwrites rows of that output; the rest of the network runs unchanged.
Legend: B patched runs in one batch, T tokens, C n_embd, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from gpt2kit.trace.record import parse_layers, run_hooked


@dataclass(frozen=True)
class PatchResult:
    layers: list[int]  # residual layers l (H^(l)); 0 = the embeddings
    restored: list[list[float | None]]  # (len(layers), T): fraction restored (None where nothing to patch)
    metric: list[list[float]]  # (len(layers), T): the patched run's logit difference
    clean_metric: float
    corrupt_metric: float
    answer: int
    foil: int | None  # None: the metric is the answer's logit alone
    corrupt_ids: list[int]
    corrupt_tokens: list[str]

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("layers", "restored", "metric", "clean_metric", "corrupt_metric",
                                               "answer", "foil", "corrupt_ids", "corrupt_tokens")}


def _resid_module(model, layer: int):
    return model.drop if layer == 0 else model.h[layer - 1]


@torch.no_grad()
def run_with_patches(model, ids: Sequence[int] | torch.Tensor,
                     patches: Iterable[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
    """Logits (B, T, V) of ids (T,) or (B, T) with H^(l)[b, p] set to a value for each (b, l, p, value (C,))."""
    idx = torch.as_tensor(ids, device=model.wte.weight.device)
    idx = idx[None] if idx.dim() == 1 else idx
    by_layer: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for b, layer, p, value in patches:
        by_layer.setdefault(layer, []).append((b, p, value))
    handles = []

    def make_hook(items):
        def hook(mod, args, out):
            x = out[0] if isinstance(out, tuple) else out  # (B, T, C); a tuple if a block returns more
            x = x.clone()
            for b, p, value in items:
                x[b, p] = value
            return (x, *out[1:]) if isinstance(out, tuple) else x
        return hook

    try:
        for layer, items in by_layer.items():
            handles.append(_resid_module(model, layer).register_forward_hook(make_hook(items)))
        return model(idx).logits
    finally:
        for h in handles:
            h.remove()


def _resid_all(model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    L = model.config.n_layer
    rec = run_hooked(model, ids, tuple(range(L)), frozenset({"resid"}))
    return [rec[f"resid.{layer}"] for layer in range(L + 1)], rec["logits"]


def _metric(logits: torch.Tensor, answer: int, foil: int | None) -> torch.Tensor:
    """(..., V) -> (...): answer's logit minus foil's (or the answer's logit alone)."""
    m = logits[..., answer].double()
    return m - logits[..., foil].double() if foil is not None else m


@torch.no_grad()
def patch_residual(model, clean_ids: list[int], corrupt_ids: list[int], *, layers: str | Iterable[int] | None = None,
                   answer: int | None = None, foil: int | None = None, batch_size: int = 16,
                   tokens: list[str] | None = None) -> PatchResult:
    """The causal-tracing grid: layers (residual layers 0..L; default all) x positions."""
    if len(clean_ids) != len(corrupt_ids):
        raise ValueError(f"patching needs inputs of equal token length: the text has {len(clean_ids)} tokens, "
                         f"the comparison {len(corrupt_ids)}")
    L, V = model.config.n_layer, model.config.n_vocab
    sel = list(range(L + 1)) if layers is None else list(parse_layers(layers, L + 1))
    clean_res, clean_logits = _resid_all(model, clean_ids)
    corrupt_res, corrupt_logits = _resid_all(model, corrupt_ids)
    answer = int(clean_logits[-1].argmax()) if answer is None else int(answer)
    if foil is None:
        foil = int(corrupt_logits[-1].argmax())
        foil = None if foil == answer else foil
    for name, t in (("answer", answer), ("foil", foil)):
        if t is not None and not 0 <= t < V:
            raise ValueError(f"{name} token {t} is outside the vocabulary [0, {V})")
    m_clean = float(_metric(clean_logits[-1], answer, foil))
    m_corrupt = float(_metric(corrupt_logits[-1], answer, foil))
    T = len(clean_ids)
    metric = [[m_corrupt] * T for _ in sel]
    # Rows equal in both runs (a shared prefix) leave the corrupted run as it is: nothing to run.
    todo = [(r, layer, p) for r, layer in enumerate(sel) for p in range(T)
            if not torch.equal(clean_res[layer][p], corrupt_res[layer][p])]
    for s in range(0, len(todo), batch_size):
        chunk = todo[s:s + batch_size]
        patches = [(b, layer, p, clean_res[layer][p]) for b, (_, layer, p) in enumerate(chunk)]
        ids = torch.tensor([corrupt_ids] * len(chunk))
        out = run_with_patches(model, ids, patches)[:, -1]  # (B, V)
        for (r, _, p), m in zip(chunk, _metric(out, answer, foil).tolist(), strict=True):
            metric[r][p] = m
    done = {(r, p) for r, _, p in todo}
    denom = m_clean - m_corrupt
    restored = [[((metric[r][p] - m_corrupt) / denom if denom != 0 else 0.0) if (r, p) in done else None
                 for p in range(T)] for r in range(len(sel))]
    return PatchResult(layers=sel, restored=restored, metric=metric, clean_metric=m_clean, corrupt_metric=m_corrupt,
                       answer=answer, foil=foil, corrupt_ids=list(corrupt_ids),
                       corrupt_tokens=tokens or [f"<{i}>" for i in corrupt_ids])
