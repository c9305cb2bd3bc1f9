"""Interventions: change what the network computes at a trace name while the input runs.

Zero and mean ablation (mean over the input's positions, or over a reference text's), replacement
by a given value, addition of a scaled vector (steering), or a user function. Each may select one
head of a per-head tensor (q, k, v, z) and some positions. They run as gpt2kit.trace.points'
hooks on the network's own modules: a hook replaces one tensor a module computed (or is given),
and every later module runs as it would on that value. Legend: B batch, T tokens, P selected
positions, W a name's width (C, or 4C for mlp.pre/post), nh heads, hs head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpt2kit._io import check_input
from gpt2kit.trace.points import PER_HEAD, resolve
from gpt2kit.trace.vectors import check_fits, read_meta

KINDS = ("zero", "mean", "replace", "add", "fn")


@dataclass(frozen=True)
class Intervention:
    """One change at one name. kind: zero | mean | replace (value) | add (scale * value) | fn
    (fn(x) gets the name's tensor as the trace shows it, no batch axis, and returns a replacement
    of the same shape or None). head: one head of q/k/v/z (or a `.head.N` name); positions: the
    ones to change (default all; negative counts from the end)."""

    name: str
    kind: str = "zero"
    head: int | None = None
    positions: tuple[int, ...] | None = None
    value: Any = None  # replace / add: the slice at one position, or one per selected position
    scale: float = 1.0
    fn: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    made_on: dict | None = None  # a saved vector's metadata (gpt2kit.trace.vectors): the model it fits

    def label(self) -> str:
        at = self.name + (f".head.{self.head}" if self.head is not None and ".head." not in self.name else "")
        at += f"@{','.join(map(str, self.positions))}" if self.positions is not None else ""
        return {"zero": f"zero {at}", "mean": f"mean {at}", "replace": f"replace {at}",
                "add": f"add {self.scale:g} x vector at {at}", "fn": f"function at {at}"}[self.kind]


def ablate(name: str, *, mean: bool = False, head: int | None = None,
           positions: Sequence[int] | None = None) -> Intervention:
    return Intervention(name, "mean" if mean else "zero", head, _tuple(positions))


def steer(name: str, vector, scale: float = 1.0, *, head: int | None = None,
          positions: Sequence[int] | None = None) -> Intervention:
    return Intervention(name, "add", head, _tuple(positions), vector, float(scale))


def replace(name: str, value, *, head: int | None = None, positions: Sequence[int] | None = None) -> Intervention:
    return Intervention(name, "replace", head, _tuple(positions), value)


def hook(name: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> Intervention:
    return Intervention(name, "fn", fn=fn)


def _tuple(positions) -> tuple[int, ...] | None:
    return None if positions is None else tuple(int(p) for p in positions)


# --- the command line's forms: NAME[@POS,POS][:ARG] ----------------------------------------------
def _name_positions(spec: str) -> tuple[str, tuple[int, ...] | None]:
    name, _, pos = spec.partition("@")
    if not pos:
        return name, None
    try:
        return name, tuple(int(p) for p in pos.split(","))
    except ValueError:
        raise ValueError(f"{spec!r}: positions after @ are integers, e.g. NAME@3 or NAME@3,-1") from None


def parse_ablate(spec: str) -> Intervention:
    """`NAME[@POS,...][:zero|:mean]`, e.g. h.5.attn.head.3, h.7.mlp:mean, resid.2@4."""
    head, _, how = spec.partition(":")
    if how not in ("", "zero", "mean"):
        raise ValueError(f"--ablate {spec!r}: the form is NAME[@POS][:zero|:mean], not :{how}")
    name, pos = _name_positions(head)
    return Intervention(name, how or "zero", positions=pos)


_EXPECTED = ("a 1-D float .npy (numpy.save) of the name's width, n_embd for a residual stream "
             "(or one row per selected position)")
FLOAT32_MAX = float(np.finfo(np.float32).max)


def finite_float32(values, where: str) -> np.ndarray:
    """values as a float32 array; ValueError naming `where` if any entry is NaN, infinite or beyond
    float32's range (the network runs in float32, where 1e39 is inf)."""
    try:
        orig = np.asarray(values)
        with np.errstate(over="ignore", invalid="ignore"):
            out = orig.astype(np.float32)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: not an array of numbers ({e})") from None
    bad = np.argwhere(~np.isfinite(out))
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        raise ValueError(f"{where}: {len(bad)} entr{'ies are' if len(bad) > 1 else 'y is'} not a finite float32 "
                         f"(the first, {orig[at].item()!r}, at index {at}); every entry must be finite with "
                         "|x| <= 3.4e38")
    return out


def check_scale(scale: float, where: str) -> float:
    if not (math.isfinite(scale) and abs(scale) <= FLOAT32_MAX):
        raise ValueError(f"{where}: the scale {scale!r} is not a finite float32 number (|scale| <= 3.4e38)")
    return scale


def _load_vector(path: str) -> np.ndarray:
    try:
        check_input(path)
    except (OSError, ValueError) as e:  # missing, a directory, a FIFO or a device: never opened
        raise ValueError(f"{e} (a vector file: {_EXPECTED})") from None
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a .npy array ({e}); expected {_EXPECTED}") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive of named arrays
        names = ", ".join(arr.files)
        arr.close()
        raise ValueError(f"{path}: an .npz archive (arrays: {names or 'none'}), not one array; expected {_EXPECTED}")
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{path}: holds {arr.dtype} values, not numbers; expected {_EXPECTED}")
    if arr.ndim == 0:
        raise ValueError(f"{path}: holds a single number (shape ()); expected {_EXPECTED}")
    return finite_float32(arr, path)


def parse_steer(spec: str) -> Intervention:
    """`NAME[@POS,...]:VEC.npy[*SCALE]`: add SCALE x the vector."""
    head, _, arg = spec.partition(":")
    if not arg:
        raise ValueError(f"--steer {spec!r}: the form is NAME[@POS]:VEC.npy[*SCALE]")
    path, _, scale = arg.rpartition("*") if "*" in arg else (arg, "", "1")
    try:
        s = float(scale)
    except ValueError:
        raise ValueError(f"--steer {spec!r}: the scale after * is a number, not {scale!r}") from None
    check_scale(s, f"--steer {spec!r}")
    name, pos = _name_positions(head)
    iv = Intervention(name, "add", positions=pos, value=_load_vector(path), scale=s, made_on=read_meta(path))
    _value(iv)  # scale x vector overflowing float32 fails here, before the model loads
    return iv


def parse_replace(spec: str) -> Intervention:
    """`NAME[@POS,...]:VALUE.npy`: set the tensor there to the array."""
    head, _, path = spec.partition(":")
    if not path:
        raise ValueError(f"--replace {spec!r}: the form is NAME[@POS]:VALUE.npy")
    name, pos = _name_positions(head)
    return Intervention(name, "replace", positions=pos, value=_load_vector(path))


# --- resolving and running -----------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    iv: Intervention
    name: str  # ours
    head: int | None
    positions: list[int] | None
    per_head: bool
    slice_shape: tuple[int, ...]  # the changed part at one position
    value: torch.Tensor | None  # (*slice) or (P, *slice)


def _width(model, name: str) -> int:
    C = model.config.n_embd
    return 4 * C if name.endswith(("mlp.pre", "mlp.post")) else C


def _value(iv: Intervention) -> torch.Tensor:
    """The intervention's array as float32, refused if any entry (or, for a steer, scale x entry) is not
    a finite float32: a NaN or inf would only show up as NaN logits."""
    v = iv.value.detach().cpu().float().numpy() if isinstance(iv.value, torch.Tensor) else iv.value
    value = finite_float32(v, f"{iv.label()}: the {'vector' if iv.kind == 'add' else 'value'}")
    if iv.kind == "add":
        finite_float32(check_scale(iv.scale, iv.label()) * value.astype(np.float64),
                       f"{iv.label()}: {iv.scale:g} x the vector overflows float32")
    return torch.from_numpy(value)


def resolve_all(model, interventions: Sequence[Intervention], T: int) -> list[Resolved]:
    cfg = model.config
    out = []
    for iv in interventions:
        if iv.kind not in KINDS:
            raise ValueError(f"unknown intervention kind {iv.kind!r}; choose from {', '.join(KINDS)}")
        name, head = resolve(iv.name, cfg.n_layer, cfg.n_head)
        if iv.head is not None:
            if head is not None and head != iv.head:
                raise ValueError(f"{iv.name!r} names head {head}, and head={iv.head} was given too")
            _, head = resolve(f"{name}.head.{iv.head}", cfg.n_layer, cfg.n_head)
        check_fits(iv.made_on, model, iv.label())
        positions = None
        if iv.positions is not None:
            bad = [p for p in iv.positions if not -T <= p < T]
            if bad:
                raise ValueError(f"{iv.label()}: position {bad[0]} is outside the input's {T} tokens")
            positions = sorted({p % T for p in iv.positions})
        per_head = name.split(".", 2)[-1] in PER_HEAD
        hs = cfg.n_embd // cfg.n_head
        shape = (hs,) if head is not None else (cfg.n_head, hs) if per_head else (_width(model, name),)
        value = None
        if iv.kind in ("replace", "add"):
            value = _value(iv)
            P = T if positions is None else len(positions)
            if tuple(value.shape) not in (shape, (P, *shape)):
                raise ValueError(f"{iv.label()}: the vector has shape {tuple(value.shape)}; {name} takes {shape} "
                                 f"(the same at every position) or {(P, *shape)} (one per position)")
        if iv.kind == "fn" and not callable(iv.fn):
            raise ValueError(f"{iv.label()}: kind 'fn' needs a callable fn")
        out.append(Resolved(iv, name, head, positions, per_head, shape, value))
    return out


def _view(x: torch.Tensor, r: Resolved) -> torch.Tensor:
    """A view of a (B, ...) tensor in the name's layout with positions on axis 1: (B, T, *slice)."""
    v = x.transpose(1, 2) if r.per_head else x  # per head: (B, nh, T, hs) -> (B, T, nh, hs)
    return v[:, :, r.head] if r.head is not None else v


def means_needed(resolved: list[Resolved]) -> list[str]:
    return sorted({r.name for r in resolved if r.iv.kind == "mean"})


def edits_for(resolved: list[Resolved], means: dict[str, torch.Tensor]):
    """The (name, fn) pairs for gpt2kit.trace.points.edit_hooks; means: {name: tensor without batch
    axis} of the run mean ablations average over (gpt2kit.trace.points.capture_run)."""
    out = []
    for r in resolved:
        mean = _view(means[r.name][None], r).float().mean(1)[0] if r.iv.kind == "mean" else None  # (*slice)

        def fn(x, r=r, mean=mean):
            if r.iv.kind == "fn":
                new = r.iv.fn(x[0].clone())  # as the trace shows it: no batch axis
                return None if new is None else torch.as_tensor(new, dtype=x.dtype, device=x.device)[None]
            out = x.clone()
            v = _view(out, r)
            idx = slice(None) if r.positions is None else torch.tensor(r.positions, device=x.device)
            cur = v[:, idx]  # (B, P, *slice)
            if r.iv.kind == "zero":
                new = torch.zeros_like(cur)
            elif r.iv.kind == "mean":
                new = mean.to(cur).expand_as(cur)
            elif r.iv.kind == "replace":
                new = r.value.to(cur).expand_as(cur)
            else:
                new = cur + r.iv.scale * r.value.to(cur)
            v[:, idx] = new
            return out
        out.append((r.name, fn))
    return out
