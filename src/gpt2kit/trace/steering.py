"""Interventions while generating or scoring: the trace's ablations, steering vectors and replacements,
and SAE feature clamps, applied at every forward of a generation, to the prompt's positions, the
generated tokens' or both, each row of a batch with its own.

`prepare(model, interventions)` checks them against the model once and gives an :class:`Edits`, which
a row of the engine carries (gpt2kit.engine.rows.Row.edits). A forward holding such rows runs on the
model's own modules inside :func:`batch_hooks`: one hook per named point (gpt2kit.trace.points), which
changes each row's slice by that row's edits at the tokens its `on` selects, and leaves every other
row's numbers as they were (a plain row's slice is never written). The keys and values the cache
keeps are computed from the changed tensors, as they are without a cache.

An SAE clamp (:class:`Clamp`) encodes what the SAE reads at its hook point (SAE.read: its centring
too), sets the features, and adds decode(clamped) - decode(features) to the network's tensor: the
clamped reconstruction with the error term kept (sae-lens's use_error_term), so a feature clamped to
its own value changes nothing.
Legend: B rows, T tokens of a forward, D an SAE's d_in, K clamped features, nh heads, hs head size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpt2kit.trace.intervene import Intervention, _value, _width, finite_float32
from gpt2kit.trace.points import PER_HEAD, edit_hooks, point, resolve
from gpt2kit.trace.sae import SAE, load_sae
from gpt2kit.trace.vectors import check_fits

ON = ("both", "prompt", "generated")


@dataclass(frozen=True)
class Clamp:
    """Set SAE features to values where the SAE reads (its hook point). sae: a loaded SAE or its directory."""

    sae: SAE | str | os.PathLike
    features: tuple[tuple[int, float], ...]

    def label(self) -> str:
        where = self.sae.hook_name if isinstance(self.sae, SAE) else str(self.sae)
        return f"clamp {', '.join(f'{f}={v:g}' for f, v in self.features)} of the SAE at {where}"


def clamp(sae: SAE | str | os.PathLike, features: dict[int, float] | Sequence[tuple[int, float]]) -> Clamp:
    items = features.items() if isinstance(features, dict) else features
    return Clamp(sae, tuple((int(f), float(v)) for f, v in items))


@dataclass(frozen=True)
class Interventions:
    """What to change while generating, and where: on "both" (every position), "prompt" (the prompt's
    positions only) or "generated" (the fed generated tokens' positions only)."""

    items: tuple[Intervention | Clamp, ...]
    on: str = "both"


@dataclass(frozen=True, eq=False)
class _Edit:
    name: str  # ours
    kind: str  # zero | replace | add | clamp
    head: int | None = None
    per_head: bool = False
    value: torch.Tensor | None = None  # replace / add: the slice at one position
    scale: float = 1.0
    sae: SAE | None = None
    features: torch.Tensor | None = None  # clamp: (K,) ids and (K,) values
    values: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Edits:
    """Interventions checked against one model (prepare): what a row carries (engine RowEdits)."""

    edits: tuple[_Edit, ...]
    on: str
    labels: tuple[str, ...]

    def hooks(self, model, rows: Sequence[Edits | None], prompt: torch.Tensor):
        """The hooks for one forward whose batch rows carry `rows` (prompt (B, T): which tokens are
        prompt tokens): batch_hooks."""
        return batch_hooks(model, rows, prompt)


def prepare(model, interventions: Interventions | Sequence[Intervention | Clamp] | Edits | None) -> Edits | None:
    """Interventions (or a list of them: on every position) checked against the model; None for none.
    ValueError naming the intervention for a point no module computes, a wrong width, a kind that
    needs a reference run (a mean ablation, positions: use trace), or a feature the SAE lacks."""
    if interventions is None or isinstance(interventions, Edits):
        return interventions
    if not isinstance(interventions, Interventions):
        interventions = Interventions(tuple(interventions))
    if interventions.on not in ON:
        raise ValueError(f"intervene on {interventions.on!r}? choose from {', '.join(ON)}")
    if not interventions.items:
        return None
    edits = tuple(_resolve_clamp(model, iv) if isinstance(iv, Clamp) else _resolve(model, iv)
                  for iv in interventions.items)
    return Edits(edits, interventions.on, tuple(iv.label() for iv in interventions.items))


def _resolve(model, iv: Intervention) -> _Edit:
    if not isinstance(iv, Intervention):
        raise ValueError(f"an intervention is an Intervention (ablate, steer, replace) or a Clamp, not {iv!r}")
    if iv.kind in ("mean", "fn"):
        raise ValueError(f"{iv.label()}: a {'mean ablation' if iv.kind == 'mean' else 'user function'} is for one "
                         "forward pass (gpt2kit.trace.trace / run_with_hooks), not for generation")
    if iv.positions is not None:
        raise ValueError(f"{iv.label()}: positions (@) are not taken while generating; choose the prompt's "
                         f"positions, the generated ones or both ({', '.join(ON)})")
    cfg = model.config
    name, head = resolve(iv.name, cfg.n_layer, cfg.n_head)
    if iv.head is not None:
        if head is not None and head != iv.head:
            raise ValueError(f"{iv.name!r} names head {head}, and head={iv.head} was given too")
        _, head = resolve(f"{name}.head.{iv.head}", cfg.n_layer, cfg.n_head)
    _point(model, name, iv.label())
    check_fits(iv.made_on, model, iv.label())
    per_head = name.split(".", 2)[-1] in PER_HEAD
    hs = cfg.n_embd // cfg.n_head
    shape = (hs,) if head is not None else (cfg.n_head, hs) if per_head else (_width(model, name),)
    value = None
    if iv.kind in ("replace", "add"):
        value = _value(iv)
        if tuple(value.shape) != shape:
            raise ValueError(f"{iv.label()}: the vector has shape {tuple(value.shape)}; {name} takes {shape}")
    return _Edit(name, iv.kind, head, per_head, value, iv.scale)


def _point(model, name: str, label: str) -> None:
    if name == "embed.pos":  # wpe's output is shared by the batch's rows in a ragged prefill
        raise ValueError(f"{label}: intervene at resid.0 (the embeddings' sum), not embed.pos, while generating")
    try:
        point(model, name)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None


_SAE_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


def _resolve_clamp(model, c: Clamp) -> _Edit:
    cfg = model.config
    sae = c.sae if isinstance(c.sae, SAE) else load_sae(c.sae, cfg.n_layer, cfg.n_head)
    _point(model, sae.name, c.label())
    width = _width(model, sae.name)
    if sae.d_in != width:
        raise ValueError(f"{c.label()}: the SAE's d_in is {sae.d_in}, but {sae.name} is {width} wide: an SAE for "
                         "another model?")
    if not c.features:
        raise ValueError(f"{c.label()}: no features to clamp (FEATURE=VALUE)")
    for f, v in c.features:
        if not 0 <= f < sae.d_sae:
            raise ValueError(f"{c.label()}: feature {f} is outside the SAE's features [0, {sae.d_sae})")
        finite_float32([v], f"{c.label()}: the value of feature {f}")
    device = model.wte.weight.device
    feats = torch.tensor([f for f, _ in c.features], dtype=torch.long, device=device)
    vals = torch.tensor([v for _, v in c.features], dtype=torch.float32, device=device)
    sae = dataclasses.replace(sae, **{k: getattr(sae, k).to(device) for k in _SAE_TENSORS
                                      if getattr(sae, k) is not None})  # on the model's device
    return _Edit(sae.name, "clamp", per_head=sae.name.split(".", 2)[-1] in PER_HEAD, sae=sae, features=feats,
                 values=vals)


# --- one forward's hooks -------------------------------------------------------------------------
def selected(prompt: torch.Tensor, on: str) -> torch.Tensor:
    """Which tokens of a row (prompt (T,) bool) an edit changes."""
    return torch.ones_like(prompt) if on == "both" else prompt if on == "prompt" else ~prompt


@contextlib.contextmanager
def batch_hooks(model, rows: Sequence[Edits | None], prompt: torch.Tensor) -> Iterator[None]:
    """While inside: each row b with edits (rows[b]) has them applied at the tokens of prompt[b] (B, T)
    its `on` selects; rows without are untouched. One hook per point (gpt2kit.trace.points.edit_hooks),
    removed on leaving, an error too."""
    names = sorted({e.name for r in rows if r is not None for e in r.edits})
    with edit_hooks(model, [(n, _point_fn(n, rows, prompt)) for n in names]):
        yield


def _point_fn(name: str, rows: Sequence[Edits | None], prompt: torch.Tensor):
    todo = []  # (row, its edits here, its tokens (T,) bool)
    for b, r in enumerate(rows):
        here = [] if r is None else [e for e in r.edits if e.name == name]
        if here:
            sel = selected(prompt[b], r.on)
            if bool(sel.any()):
                todo.append((b, here, sel))

    def fn(x: torch.Tensor) -> torch.Tensor | None:  # (B, T, W) or per head (B, nh, T, hs)
        if not todo:
            return None
        out = x.clone()
        for b, here, sel in todo:
            for e in here:
                _apply(out[b:b + 1], e, sel.to(x.device))
        return out
    return fn


def _apply(x: torch.Tensor, e: _Edit, sel: torch.Tensor) -> None:
    """Change one row's tensor x (1, T, W) or (1, nh, T, hs) in place at the tokens sel (T,)."""
    v = x.transpose(1, 2) if e.per_head else x  # (1, T, nh, hs) or (1, T, W)
    if e.kind == "clamp":
        xin = e.sae.read(x)[:, sel]  # (1, k, D)
        delta = e.sae.clamp_delta(xin, e.features, e.values)
        v[:, sel] = v[:, sel] + delta.view(v[:, sel].shape).to(x.dtype)
        return
    if e.head is not None:
        v = v[:, :, e.head]  # (1, T, hs)
    if e.kind == "zero":
        v[:, sel] = 0
    elif e.kind == "replace":
        v[:, sel] = e.value.to(v)
    else:
        v[:, sel] = v[:, sel] + e.scale * e.value.to(v)


@contextlib.contextmanager
def applied(model, edits: Edits | None, n_tokens: int, *, prompt: bool = True) -> Iterator[None]:
    """edits on one row's forward of n_tokens tokens, all of them prompt tokens (or all generated)."""
    if edits is None:
        yield
        return
    with batch_hooks(model, [edits], torch.full((1, n_tokens), prompt, dtype=torch.bool)):
        yield


# --- the request form: spec strings naming server-side vectors and SAEs ---------------------------
_FILEISH = re.compile(r"[/\\]|\.(npy|npz|json|safetensors)$", re.I)


def parse_spec(spec: str, vectors: dict[str, np.ndarray], saes: dict[str, SAE]) -> Intervention | Clamp:
    """One intervention as a request writes it: `NAME` or `NAME:zero` (ablate), `NAME:VECTOR[*SCALE]`
    (add SCALE x a vector the server was given by that name), `clamp:SAE:FEATURE=VALUE[,...]` (an SAE it
    was given). A file path is never read: ValueError for one, and for an unknown vector or SAE."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"an intervention is a non-empty string, not {spec!r}")
    head, _, arg = spec.partition(":")
    if head == "clamp":
        return _parse_clamp(spec, arg, saes)
    if "@" in head:
        raise ValueError(f"{spec!r}: positions (@) are not taken while generating")
    if arg in ("", "zero"):
        return Intervention(head)
    if arg == "mean":
        raise ValueError(f"{spec!r}: a mean ablation is for one forward pass (gpt2kit trace)")
    name, _, scale = arg.partition("*")
    if _FILEISH.search(name):
        raise ValueError(f"{spec!r}: names a file; a request names a vector the server was given "
                         f"({', '.join(sorted(vectors)) or 'none'})")
    if name not in vectors:
        raise ValueError(f"{spec!r}: unknown vector {name!r}; the server has {', '.join(sorted(vectors)) or 'none'}")
    try:
        s = float(scale) if scale else 1.0
    except ValueError:
        raise ValueError(f"{spec!r}: the scale after * is a number, not {scale!r}") from None
    if not math.isfinite(s):
        raise ValueError(f"{spec!r}: the scale {s!r} is not finite")
    return Intervention(head, "add", value=vectors[name], scale=s)


def _parse_clamp(spec: str, arg: str, saes: dict[str, SAE]) -> Clamp:
    name, _, feats = arg.partition(":")
    if _FILEISH.search(name):
        raise ValueError(f"{spec!r}: names a file; a request names an SAE the server was given "
                         f"({', '.join(sorted(saes)) or 'none'})")
    if name not in saes:
        raise ValueError(f"{spec!r}: unknown SAE {name!r}; the server has {', '.join(sorted(saes)) or 'none'}")
    return Clamp(saes[name], parse_clamps(feats.split(",") if feats else [], spec))


def parse_clamps(items: Sequence[str], where: str = "--clamp") -> tuple[tuple[int, float], ...]:
    """`FEATURE=VALUE` strings -> ((feature, value), ...)."""
    out = []
    for item in items:
        f, eq, v = item.partition("=")
        try:
            if not eq:
                raise ValueError
            out.append((int(f), float(v)))
        except ValueError:
            raise ValueError(f"{where}: {item!r} is not FEATURE=VALUE (an integer and a number)") from None
    if not out:
        raise ValueError(f"{where}: no FEATURE=VALUE given")
    return tuple(out)
