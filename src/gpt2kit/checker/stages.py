"""The stages compared, where each is read in both models, and the comparison.

Reference: gpt2kit's own hook points (gpt2kit.trace.points: resid.0, h.{i}.ln_1, h.{i}.attn.out,
h.{i}.resid_mid, h.{i}.ln_2, h.{i}.mlp.out, resid.{i+1}, ln_f), read by forward hooks that only read.
Learner: forward hooks on its modules, found by the weights they hold (the module holding ln_1's gain
is its LN1; the smallest module holding all of a block's attention matrices is its attention, and so
on) and read where their output has the stage's shape (B, T, C). A stage no module computes is read
where it is an input: the first residual is what the learner's LN2 takes, the embeddings what its
first block takes. Legend: B batch, T tokens, C n_embd, L layers, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpt2kit.checker.mapping import WeightMap
from gpt2kit.trace.points import edit_hooks


@dataclass(frozen=True)
class StageSpec:
    label: str  # what the report calls it
    keys: tuple[str, ...]  # where the learner's value is read, first found wins
    ref: str  # gpt2kit's hook-point name (gpt2kit.trace)


def stage_table(n_layer: int) -> list[StageSpec]:
    rows = [StageSpec("embeddings + positions", ("h.0.block.in", "h.0.ln_1.in", "h.0.attn.in"), "resid.0")]
    for i in range(n_layer):
        after = (f"h.{i + 1}.block.in", f"h.{i + 1}.ln_1.in") if i + 1 < n_layer else ("ln_f.in",)
        rows += [StageSpec(f"block {i} ln_1", (f"h.{i}.ln_1.out",), f"h.{i}.ln_1"),
                 StageSpec(f"block {i} attention", (f"h.{i}.attn.out",), f"h.{i}.attn.out"),
                 StageSpec(f"block {i} residual 1", (f"h.{i}.ln_2.in",), f"h.{i}.resid_mid"),
                 StageSpec(f"block {i} ln_2", (f"h.{i}.ln_2.out",), f"h.{i}.ln_2"),
                 StageSpec(f"block {i} mlp", (f"h.{i}.mlp.out",), f"h.{i}.mlp.out"),
                 StageSpec(f"block {i} residual 2", (f"h.{i}.block.out", *after), f"resid.{i + 1}")]
    return [*rows, StageSpec("final norm", ("ln_f.out",), "ln_f"), StageSpec("logits", ("logits",), "logits")]


# --- where the learner's stages are ----------------------------------------------------------------

def _lca(paths: list[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _inside(path: str, outer: str) -> bool:
    """path is strictly inside the module at outer."""
    return path != outer and (outer == "" or path.startswith(outer + "."))


def _sublayer(owned: dict[str, str], block: str | None, projection: str | None) -> str:
    """The attention's (or MLP's) module, from where its tensors are (target -> owning module path): the
    block's one child that holds them all, unless that child is one of the Linears itself; else the
    module holding its output projection (read at that projection's output)."""
    if not owned:
        return ""
    paths = list(owned.values())
    if block is None:
        return _lca(paths)
    depth = len(block.split(".")) + 1
    children = {".".join(p.split(".")[:depth]) for p in paths}
    if len(children) == 1:
        child = children.pop()
        holds_all = child == projection and any(p == child for t, p in owned.items() if ".c_proj." not in t)
        if child not in paths or holds_all:
            return child
    return projection or ""


def find_points(wm: WeightMap, n_layer: int) -> dict[str, str]:
    """Stage module -> the learner's module path: h.{i}.block|ln_1|attn|ln_2|mlp and ln_f."""
    owners = wm.owners
    points: dict[str, str] = {}
    for i in range(n_layer):
        mine = {t: p for t, p in owners.items() if t.startswith(f"h.{i}.")}
        if not mine:
            continue
        block = _lca(list(mine.values()))
        others = [p for t, p in owners.items() if not t.startswith(f"h.{i}.")]
        if block and not any(p == block or _inside(p, block) for p in others):
            points[f"h.{i}.block"] = block
        else:
            block = None
        for role in ("ln_1", "attn", "ln_2", "mlp"):
            owned = {t: p for t, p in mine.items() if t.startswith(f"h.{i}.{role}.")}
            if role in ("attn", "mlp"):
                path = _sublayer(owned, block, mine.get(f"h.{i}.{role}.c_proj.weight"))
            else:
                path = _lca(list(owned.values())) if owned else ""
            if path and (block is None or _inside(path, block)):
                points[f"h.{i}.{role}"] = path
    ln_f = owners.get("ln_f.weight") or owners.get("ln_f.bias")
    if ln_f:
        points["ln_f"] = ln_f
    return points


def first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return next((t for t in x if isinstance(t, torch.Tensor)), None)
    return None


class Recorder:
    """Forward hooks that keep what each learner stage module takes in (KEY.in) and gives out (KEY.out),
    on its first call in each forward; clear() before each forward."""

    def __init__(self, model: nn.Module, points: dict[str, str]) -> None:
        self.model, self.points = model, points
        self.data: dict[str, torch.Tensor] = {}
        self.handles: list = []

    def clear(self) -> None:
        self.data = {}

    def _keep(self, key: str, x: Any) -> None:
        t = first_tensor(x)
        if t is not None and key not in self.data:
            self.data[key] = t.detach().float().clone()

    def __enter__(self) -> Recorder:
        for key, path in self.points.items():
            module = self.model.get_submodule(path)
            self.handles.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, key=key: self._keep(f"{key}.in", list(args) + list(kwargs.values())),
                with_kwargs=True))
            self.handles.append(module.register_forward_hook(lambda mod, args, out, key=key: self._keep(
                f"{key}.out", out)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# --- the reference's stages ------------------------------------------------------------------------

@torch.no_grad()
def reference_stages(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference's value at every stage's hook point, and its logits, for ids (B, T)."""
    names = ["resid.0", "ln_f"]
    for i in range(model.config.n_layer):
        names += [f"h.{i}.ln_1", f"h.{i}.attn.out", f"h.{i}.resid_mid", f"h.{i}.ln_2", f"h.{i}.mlp.out",
                  f"resid.{i + 1}"]
    got: dict[str, torch.Tensor] = {}

    def keeper(name: str):
        def keep(x: torch.Tensor) -> None:
            got[name] = x.detach().float().clone()
        return keep

    with edit_hooks(model, [(n, keeper(n)) for n in names]):
        got["logits"] = model(ids).logits.float()
    return got


# --- comparing -------------------------------------------------------------------------------------

def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|; positions where both hold the same inf or both NaN count as equal, a non-finite
    value facing a finite one makes it NaN."""
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = (a - b).abs().masked_fill(same, 0.0)
    if torch.isnan(d).any():
        return math.nan
    return float(d.max()) if d.numel() else 0.0


def close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float) -> bool:
    return a is not None and b is not None and a.shape == b.shape and max_abs(a, b) <= tol


def fit(x: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """x in the stage's shape: as it is, or (B*T, C) / a batch-less (T, C) made (B, T, C); else None."""
    if x is None:
        return None
    if tuple(x.shape) == shape:
        return x
    if x.numel() == math.prod(shape) and x.dim() == 2:
        return x.reshape(shape)
    if x.dim() == len(shape) - 1 and tuple(x.shape) == shape[1:]:
        return x.expand(shape)
    return None


@dataclass
class StageResult:
    label: str
    diff: float | None  # max abs difference; None when the stage was not observed
    ok: bool | None  # None: not observed
    key: str | None = None  # where the learner's value came from
    ref: str = ""
    note: str = ""


def compare(spec: StageSpec, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float
            ) -> StageResult:
    want = ref[spec.ref]
    for key in spec.keys:
        if key not in got:
            continue
        mine = fit(got[key], tuple(want.shape))
        if mine is None:
            return StageResult(spec.label, math.nan, False, key, spec.ref,
                               f"shape {tuple(got[key].shape)}, GPT-2's is {tuple(want.shape)}")
        d = max_abs(mine, want)
        return StageResult(spec.label, d, d <= tol, key, spec.ref)
    return StageResult(spec.label, None, None, None, spec.ref, "not observed (no module of yours computes it alone)")


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's global RNG set to seed inside, and restored after (the learner's dropout draws from it)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
