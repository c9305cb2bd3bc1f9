"""Activation patching (causal tracing, Meng et al. 2022; per head and sublayer as in Wang et al. 2022).

Clean and corrupted inputs of equal token length. For each cell of a grid the corrupted input runs
with one activation taken from the clean run, and a metric (gpt2kit.trace.metrics) is read at the
last position. Modes, the grid's rows x columns and the tensor patched:
  resid      residual layer l (H^(0)..H^(L)) x position   resid.{l} at that position
  attn, mlp  block i x position                           h.{i}.attn.out / h.{i}.mlp.out there
  heads      block i x head n (all positions)             head n of h.{i}.attn.z
  heads-pos  block i.head n x position                    head n of h.{i}.attn.z at that position
Each cell reports the fraction of the clean-vs-corrupted metric difference the patch restores,
(m_patched - m_corrupt) / (m_clean - m_corrupt), averaged over pairs with its spread (standard
deviation). Where that denominator is tiny against the metric's scale (`tiny`), the fraction would
be amplified noise: such pairs are left out of it, and when all are, the grid shows the metric's
change m_patched - m_corrupt instead, saying so. Cells where the clean and corrupted activations are
equal in every pair are left blank without running. The patches are gpt2kit.trace.points' hooks
on the network's own modules. Legend: B patched runs in one batch, T tokens, C n_embd, V vocab.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gpt2kit.trace.attribution import agreement, attribute
from gpt2kit.trace.metrics import Metric
from gpt2kit.trace.points import at_cell, capture_run, edit_hooks
from gpt2kit.trace.record import parse_layers

MODES = ("resid", "attn", "mlp", "heads", "heads-pos")
TINY_FRACTION = 0.05  # a denominator under 5% of the metric's scale is "tiny"


@dataclass(frozen=True)
class PatchResult:
    mode: str
    rows: list[str]
    columns: list[str]
    layers: list[int]  # each row's layer (resid: residual layer l; otherwise the block)
    restored: list[list[float | None]]  # mean fraction restored (None: not patched, or no usable pair)
    spread: list[list[float | None]]  # its standard deviation over pairs (None for one pair)
    metric: list[list[float | None]]  # mean patched metric
    change: list[list[float | None]]  # mean m_patched - m_corrupt
    clean_metric: float  # means over pairs
    corrupt_metric: float
    metric_name: str
    shown: str  # "restored" or "change" (the fallback)
    warning: str | None
    n_pairs: int
    answer: int
    foil: int | None
    corrupt_ids: list[int]
    corrupt_tokens: list[str]
    attribution: dict | None = field(default=None)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def grid(mode: str, L: int, nh: int, T: int, layers) -> tuple[list[str], list[str], list[int], list[tuple]]:
    """Rows, columns, each row's layer, and the cells: (row, col, name, head or None, position or None)."""
    if mode not in MODES:
        raise ValueError(f"unknown patching mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "resid":
        sel = list(range(L + 1)) if layers is None else list(parse_layers(layers, L + 1))
        return ([f"H({lay})" for lay in sel], [str(p) for p in range(T)], sel,
                [(r, p, f"resid.{lay}", None, p) for r, lay in enumerate(sel) for p in range(T)])
    sel = list(range(L)) if layers is None else list(parse_layers(layers, L))
    if mode in ("attn", "mlp"):
        tail = "attn.out" if mode == "attn" else "mlp.out"
        return ([f"h.{i}.{mode}" for i in sel], [str(p) for p in range(T)], sel,
                [(r, p, f"h.{i}.{tail}", None, p) for r, i in enumerate(sel) for p in range(T)])
    if mode == "heads":
        return ([f"h.{i}" for i in sel], [f"head {h}" for h in range(nh)], sel,
                [(r, h, f"h.{i}.attn.z", h, None) for r, i in enumerate(sel) for h in range(nh)])
    rows = [(i, h) for i in sel for h in range(nh)]
    return ([f"h.{i}.head.{h}" for i, h in rows], [str(p) for p in range(T)], [i for i, _ in rows],
            [(r, p, f"h.{i}.attn.z", h, p) for r, (i, h) in enumerate(rows) for p in range(T)])


@torch.no_grad()
def run_patched(model, corrupt_ids: Sequence[int], cells: list[tuple[str, int | None, int | None, torch.Tensor]]
                ) -> torch.Tensor:
    """Last-position logits (B, V): row b is the corrupted input with cells[b]'s (name, head, position)
    set to its value (the slice _at selects)."""
    by_name: dict[str, list[tuple[int, int | None, int | None, torch.Tensor]]] = {}
    for b, (name, head, pos, value) in enumerate(cells):
        by_name.setdefault(name, []).append((b, head, pos, value))

    def setter(items):
        def fn(x):  # (B, ...) in the name's layout
            x = x.clone()
            for b, head, pos, value in items:
                at_cell(x[b], head, pos).copy_(value)
            return x
        return fn

    idx = torch.tensor([list(corrupt_ids)] * len(cells), device=model.wte.weight.device)
    with edit_hooks(model, [(n, setter(items)) for n, items in by_name.items()]):
        return model(idx).logits[:, -1]


@torch.no_grad()
def run_with_patches(model, ids: Sequence[int] | torch.Tensor,
                     patches: Iterable[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
    """Logits (B, T, V) of ids (T,) or (B, T) with H^(l)[b, p] set to a value for each (b, l, p, value (C,))."""
    idx = torch.as_tensor(ids, device=model.wte.weight.device)
    idx = idx[None] if idx.dim() == 1 else idx
    by_layer: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for b, layer, p, value in patches:
        by_layer.setdefault(layer, []).append((b, p, value))

    def setter(items):
        def fn(x):  # (B, T, C)
            x = x.clone()
            for b, p, value in items:
                x[b, p] = value
            return x
        return fn

    with edit_hooks(model, [(f"resid.{layer}", setter(items)) for layer, items in by_layer.items()]):
        return model(idx).logits


def tiny(m_clean: float, m_corrupt: float, kind: str) -> bool:
    """Whether the clean - corrupted difference is under TINY_FRACTION of the metric's scale
    (the larger of |m_clean|, |m_corrupt| and a floor: 1 logit unit, or 0.01 for a probability)."""
    floor = 0.01 if kind == "prob" else 1.0
    return abs(m_clean - m_corrupt) < TINY_FRACTION * max(abs(m_clean), abs(m_corrupt), floor)


def _sd(xs: list[float]) -> float | None:
    return statistics.pstdev(xs) if len(xs) > 1 else None


def _check_pairs(model, pairs) -> int:
    if not pairs:
        raise ValueError("patching needs at least one (clean, corrupt) pair")
    T = len(pairs[0][0])
    for n, (clean, corrupt, mt) in enumerate(pairs):
        if len(clean) != len(corrupt):
            raise ValueError(f"patching needs inputs of equal token length: the text has {len(clean)} tokens, "
                             f"the comparison {len(corrupt)}" + (f" (pair {n + 1})" if len(pairs) > 1 else ""))
        if len(clean) != T:
            raise ValueError(f"pair {n + 1} has {len(clean)} tokens, pair 1 has {T}: the grid needs one length")
        for what, t in (("answer", mt.answer), ("wrong", mt.wrong)):
            if t is not None and not 0 <= t < model.config.n_vocab:
                raise ValueError(f"{what} token {t} is outside the vocabulary [0, {model.config.n_vocab})")
    return T


def _run_pair(model, clean, corrupt, mt: Metric, cells, batch_size: int) -> tuple[float, float, dict]:
    """(m_clean, m_corrupt, {(row, col): m_patched}) for the cells whose activations differ."""
    names = {c[2] for c in cells}
    acts_c, logit_c = capture_run(model, clean, names)
    acts_x, logit_x = capture_run(model, corrupt, names)
    todo = [c for c in cells if not torch.equal(at_cell(acts_c[c[2]], c[3], c[4]), at_cell(acts_x[c[2]], c[3], c[4]))]
    got = {}
    for s in range(0, len(todo), batch_size):
        chunk = todo[s:s + batch_size]
        out = run_patched(model, corrupt, [(n, h, p, at_cell(acts_c[n], h, p)) for _, _, n, h, p in chunk])
        for (r, c, *_), m in zip(chunk, mt(out).tolist(), strict=True):
            got[(r, c)] = m
    return float(mt(logit_c[None])[0]), float(mt(logit_x[None])[0]), got


def _aggregate(per_pair, n_rows: int, n_cols: int, kind: str) -> dict:
    """Means and spreads over pairs; fractions only over pairs whose denominator is not tiny."""
    usable = [k for k, (mc, mx, _) in enumerate(per_pair) if not tiny(mc, mx, kind)]
    out = {k: [[None] * n_cols for _ in range(n_rows)] for k in ("restored", "spread", "metric", "change", "change_sd")}
    for r, c in set().union(*(g.keys() for _, _, g in per_pair)):
        ms = [g.get((r, c), mx) for _, mx, g in per_pair]  # an unpatched (equal) cell is the corrupted run
        ch = [m - mx for m, (_, mx, _) in zip(ms, per_pair, strict=True)]
        out["metric"][r][c] = statistics.fmean(ms)
        out["change"][r][c], out["change_sd"][r][c] = statistics.fmean(ch), _sd(ch)
        fr = [ch[k] / (per_pair[k][0] - per_pair[k][1]) for k in usable]
        if fr:
            out["restored"][r][c], out["spread"][r][c] = statistics.fmean(fr), _sd(fr)
    out["n_tiny"] = len(per_pair) - len(usable)
    return out


def patch(model, pairs: Sequence[tuple[Sequence[int], Sequence[int], Metric]], *, mode: str = "resid",
          layers: str | Iterable[int] | None = None, batch_size: int = 16, tokens: list[str] | None = None,
          describe=lambda i: f"<{i}>", attribution: bool = False) -> PatchResult:
    """The patching grid over (clean ids, corrupt ids, metric) pairs of one token length; with
    attribution, the gradient estimate of every cell beside it (gpt2kit.trace.attribution)."""
    T = _check_pairs(model, pairs)
    cfg = model.config
    rows, cols, row_layers, cells = grid(mode, cfg.n_layer, cfg.n_head, T, layers)
    per_pair = [_run_pair(model, clean, corrupt, mt, cells, batch_size) for clean, corrupt, mt in pairs]
    kind, mt0 = pairs[0][2].kind, pairs[0][2]
    agg = _aggregate(per_pair, len(rows), len(cols), kind)
    m_clean = statistics.fmean(p[0] for p in per_pair)
    m_corrupt = statistics.fmean(p[1] for p in per_pair)
    name = mt0.describe(describe) if all(p[2] == mt0 for p in pairs) else \
        {"logit-diff": "logit difference answer − wrong", "logit": "logit of the answer", "prob": "p(answer)",
         "loss": "loss −log p(answer)"}[kind] + " (each pair's own tokens) at the last position"
    warning, shown, spread = None, "restored", agg["spread"]
    if agg["n_tiny"] == len(pairs):
        shown, spread = "change", agg["change_sd"]
        warning = (f"the clean and corrupted {name} differ by only {m_clean - m_corrupt:+.4g} (clean {m_clean:.4g}, "
                   f"corrupted {m_corrupt:.4g}), under {TINY_FRACTION:.0%} of its scale: a fraction restored would be "
                   "amplified noise, so the cells show the metric's change m_patched − m_corrupt instead"
                   + ("; pick answer tokens the two runs disagree on" if kind != "loss" else ""))
    elif agg["n_tiny"]:
        warning = (f"{agg['n_tiny']} of {len(pairs)} pairs have a clean − corrupted difference under "
                   f"{TINY_FRACTION:.0%} of the metric's scale and are left out of the fractions")
    att = None
    if attribution:
        att = attribute(model, pairs, cells, (len(rows), len(cols)))
        att["agreement"] = agreement(agg["change"], att["estimate"])
    first = pairs[0]
    return PatchResult(mode=mode, rows=rows, columns=cols, layers=row_layers, restored=agg["restored"], spread=spread,
                       metric=agg["metric"], change=agg["change"], clean_metric=m_clean, corrupt_metric=m_corrupt,
                       metric_name=name, shown=shown, warning=warning, n_pairs=len(pairs), answer=first[2].answer,
                       foil=first[2].wrong, corrupt_ids=list(first[1]),
                       corrupt_tokens=tokens or [f"<{i}>" for i in first[1]], attribution=att)


def default_metric(model, clean_ids: Sequence[int], corrupt_ids: Sequence[int], answer: int | None = None,
                   foil: int | None = None) -> Metric:
    """Without a stated metric: the logit difference clean top-1 − corrupted top-1 (or the given
    answer and foil); when the two top-1s agree, the answer's logit alone."""
    with torch.no_grad():
        idx = torch.tensor([list(clean_ids), list(corrupt_ids)], device=model.wte.weight.device)
        last = model(idx).logits[:, -1]
    a = int(last[0].argmax()) if answer is None else int(answer)
    f = int(last[1].argmax()) if foil is None else int(foil)
    return Metric("logit", a) if f == a else Metric("logit-diff", a, f)


def patch_residual(model, clean_ids: list[int], corrupt_ids: list[int], *, layers: str | Iterable[int] | None = None,
                   answer: int | None = None, foil: int | None = None, batch_size: int = 16,
                   tokens: list[str] | None = None) -> PatchResult:
    """The causal-tracing grid of one pair: residual layers (0..L; default all) x positions."""
    if len(clean_ids) != len(corrupt_ids):
        raise ValueError(f"patching needs inputs of equal token length: the text has {len(clean_ids)} tokens, "
                         f"the comparison {len(corrupt_ids)}")
    mt = default_metric(model, clean_ids, corrupt_ids, answer, foil)
    return patch(model, [(clean_ids, corrupt_ids, mt)], mode="resid", layers=layers, batch_size=batch_size,
                 tokens=tokens)
