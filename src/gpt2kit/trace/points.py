"""Where each trace name lives in the network, and hooks that read or replace it there.

A name (see gpt2kit.trace's docstring) is the output or the input of one of the network's own
modules; `point` says which, and `edit_hooks` registers forward (pre-)hooks that hand the tensor to
a function in the name's layout and write back what it returns. Nothing here computes a block:
the hooks only read or replace what the modules compute. Aliases: our short forms (`h.{i}.mlp`,
`h.{i}.attn.head.{n}`, `h.{i}.resid`) and TransformerLens's hook names (ALIASES, docs/trace.md).
Legend: B batch, T tokens, C n_embd, nh heads, hs head size, L layers.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

BLOCK_NAMES = ("ln_1", "attn.q", "attn.k", "attn.v", "attn.scores", "attn.probs", "attn.z", "attn.out",
               "resid_mid", "ln_2", "mlp.pre", "mlp.post", "mlp.out")
PER_HEAD = ("attn.q", "attn.k", "attn.v", "attn.z")
DERIVED = ("attn.scores", "attn.probs")  # computed from q and k by the trace, not by a module
# TransformerLens hook name (with {i} the block) -> ours. Its bridge's LayerNorm `hook_normalized`
# is (x - mean) / scale before the gain and bias, which no module here outputs: `hook_out` is ours.
ALIASES: dict[str, str] = {
    "hook_embed": "embed.tok", "hook_pos_embed": "embed.pos", "ln_final.hook_out": "ln_f",
    "blocks.{i}.hook_resid_pre": "resid.{i}", "blocks.{i}.hook_resid_mid": "h.{i}.resid_mid",
    "blocks.{i}.hook_resid_post": "resid.{i+1}", "blocks.{i}.ln1.hook_out": "h.{i}.ln_1",
    "blocks.{i}.attn.hook_q": "h.{i}.attn.q", "blocks.{i}.attn.hook_k": "h.{i}.attn.k",
    "blocks.{i}.attn.hook_v": "h.{i}.attn.v", "blocks.{i}.attn.hook_attn_scores": "h.{i}.attn.scores",
    "blocks.{i}.attn.hook_pattern": "h.{i}.attn.probs", "blocks.{i}.attn.hook_z": "h.{i}.attn.z",
    "blocks.{i}.hook_attn_out": "h.{i}.attn.out", "blocks.{i}.ln2.hook_out": "h.{i}.ln_2",
    "blocks.{i}.mlp.hook_pre": "h.{i}.mlp.pre", "blocks.{i}.mlp.hook_post": "h.{i}.mlp.post",
    "blocks.{i}.hook_mlp_out": "h.{i}.mlp.out",
    # our short forms
    "h.{i}.resid": "resid.{i}", "h.{i}.attn": "h.{i}.attn.out", "h.{i}.mlp": "h.{i}.mlp.out",
}


def names(n_layer: int) -> list[str]:
    """Every name a trace of an n_layer model can record, in the forward pass's order."""
    out = ["embed.tok", "embed.pos", "resid.0"]
    for i in range(n_layer):
        out += [f"h.{i}.{s}" for s in BLOCK_NAMES] + [f"resid.{i + 1}"]
    return [*out, "ln_f", "logits"]


def _alias_names(n_layer: int) -> list[str]:
    return [a.replace("{i}", str(i)) for a in ALIASES for i in range(n_layer if "{i}" in a else 1)]


def resolve(name: str, n_layer: int, n_head: int) -> tuple[str, int | None]:
    """A name or alias, with an optional `.head.N` suffix, -> (our name, head or None)."""
    raw, head = name.strip(), None
    m = re.fullmatch(r"(.+?)\.head\.(-?\d+)", raw)
    if m:
        raw, head = m.group(1), int(m.group(2))
        if raw.endswith(".attn"):  # h.{i}.attn.head.{n}: the head's weighted values
            raw += ".z"
    canon = raw
    for alias, ours in ALIASES.items():
        pat = re.escape(alias).replace(r"\{i\}", r"(\d+)")
        am = re.fullmatch(pat, raw)
        if am:
            i = int(am.group(1)) if am.groups() else 0
            canon = ours.replace("{i+1}", str(i + 1)).replace("{i}", str(i))
            break
    bm = re.fullmatch(r"h\.(\d+)\..+", canon) or re.fullmatch(r"resid\.(\d+)", canon)
    if bm and int(bm.group(1)) > n_layer - canon.startswith("h."):
        what = f"block {bm.group(1)} is outside the model's blocks [0, {n_layer})" if canon.startswith("h.") else \
            f"residual layer {bm.group(1)} is outside [0, {n_layer}]"
        raise ValueError(f"{name!r}: {what}")
    if canon not in names(n_layer):
        close = difflib.get_close_matches(raw, names(n_layer) + _alias_names(n_layer), n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see docs/trace.md for the names"
        raise ValueError(f"unknown name {name!r}{hint}")
    if head is not None:
        if canon.split(".", 2)[-1] not in PER_HEAD:
            raise ValueError(f"{name!r}: only the per-head tensors {', '.join(PER_HEAD)} have heads")
        if not 0 <= head < n_head:
            raise ValueError(f"{name!r}: head {head} is outside the model's heads [0, {n_head})")
    return canon, head


@dataclass(frozen=True)
class Point:
    """Where a name's tensor is: a module's output (or its input when pre), maybe one third of it."""

    module: torch.nn.Module
    pre: bool = False
    part: int | None = None  # q, k, v: which C-wide third of c_attn's output
    per_head: bool = False
    block: torch.nn.Module | None = None  # resid_mid: the block whose input H is added to A


def point(model, name: str) -> Point:
    """The module a (resolved) name is read at; ValueError for the ones no module computes."""
    if name in ("embed.tok", "embed.pos", "resid.0", "ln_f"):
        return Point({"embed.tok": model.wte, "embed.pos": model.wpe, "resid.0": model.drop, "ln_f": model.ln_f}[name])
    if name.startswith("resid."):
        return Point(model.h[int(name.split(".")[1]) - 1])
    if name == "logits":
        raise ValueError("the logits are the model's output: intervene at ln_f or earlier")
    _, i, tail = name.split(".", 2)
    blk = model.h[int(i)]
    if tail in DERIVED:
        raise ValueError(f"{name!r} is derived from q and k by the trace (PyTorch's fused attention never forms "
                         "it), so no module computes it: intervene at attn.q, attn.k or attn.z instead")
    table = {"ln_1": Point(blk.ln_1), "attn.z": Point(blk.attn.c_proj, pre=True, per_head=True),
             "attn.out": Point(blk.attn.c_proj), "resid_mid": Point(blk.attn, block=blk), "ln_2": Point(blk.ln_2),
             "mlp.pre": Point(blk.mlp.c_fc), "mlp.post": Point(blk.mlp.c_proj, pre=True),
             "mlp.out": Point(blk.mlp.c_proj)}
    if tail in ("attn.q", "attn.k", "attn.v"):
        return Point(blk.attn.c_attn, part="qkv".index(tail[-1]), per_head=True)
    return table[tail]


def _split(x: torch.Tensor, pt: Point, nh: int) -> torch.Tensor:
    """A module's tensor (B, T, C') -> the name's layout: (B, T, C) or per head (B, nh, T, hs)."""
    if pt.part is not None:
        C = x.shape[-1] // 3
        x = x[..., pt.part * C:(pt.part + 1) * C]
    if pt.per_head:
        B, T, C = x.shape
        x = x.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
    return x


def _merge(full: torch.Tensor, new: torch.Tensor, pt: Point) -> torch.Tensor:
    """Write the name's tensor back into the module's (a new tensor; the module's stays as it was)."""
    if pt.per_head:
        B, nh, T, hs = new.shape
        new = new.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, C)
    if pt.part is None:
        return new.to(full.dtype).contiguous()
    out = full.clone()
    C = full.shape[-1] // 3
    out[..., pt.part * C:(pt.part + 1) * C] = new
    return out


EditFn = Callable[[torch.Tensor], torch.Tensor | None]


def _register(pt: Point, fn: EditFn, nh: int) -> list:
    """The hook handles that give fn the tensor at pt and write back what it returns."""
    if pt.block is not None:  # H' = H + A is no module's output: A is edited to (H' edited) - H
        held: list[torch.Tensor] = []

        def keep(mod, args):
            held.append(args[0])  # the block's input H

        def on_attn(mod, args, out):
            h = held.pop()
            new = fn(h + out)
            return None if new is None else (new - h).to(out.dtype)
        return [pt.block.register_forward_pre_hook(keep), pt.module.register_forward_hook(on_attn)]
    if pt.pre:
        def on_input(mod, args):
            x = args[0]  # (B, T, C) or (B, T, 4C)
            new = fn(_split(x, pt, nh))
            return None if new is None else (_merge(x, new, pt), *args[1:])
        return [pt.module.register_forward_pre_hook(on_input)]

    def on_output(mod, args, out):
        x = out[None] if out.dim() == 2 else out  # wpe's output has no batch axis
        new = fn(_split(x, pt, nh))
        return None if new is None else _merge(x, new, pt)
    return [pt.module.register_forward_hook(on_output)]


@contextlib.contextmanager
def edit_hooks(model, edits: list[tuple[str, EditFn]]) -> Iterator[None]:
    """While inside: at each (resolved name, fn), fn gets the name's tensor with a batch axis and
    returns a replacement of the same shape (or None to leave it). Several fns at one name run in
    order. Register before any reading hook, so the readers see the edited tensors."""
    handles: list = []
    try:
        for name, fn in edits:
            handles += _register(point(model, name), fn, model.config.n_head)
        yield
    finally:
        for h in handles:
            h.remove()


def at_cell(x: torch.Tensor, head: int | None, pos: int | None) -> torch.Tensor:
    """The patched slice of a (B, ...) or (...) tensor without batch: per head (nh, T, hs) else (T, C)."""
    if head is not None:
        x = x[head]
    return x if pos is None else x[pos]


@torch.no_grad()
def capture_run(model, ids: Sequence[int], names: Iterable[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One plain run: ({name: tensor without batch axis}, last-position logits (V,))."""
    got: dict[str, torch.Tensor] = {}

    def keeper(name):
        def keep(x):
            got[name] = x[0].detach().clone()
        return keep

    idx = torch.tensor([list(ids)], device=model.wte.weight.device)
    with edit_hooks(model, [(n, keeper(n)) for n in sorted(set(names))]):
        logits = model(idx).logits[0, -1]
    return got, logits


@torch.no_grad()
def run_with_hooks(model, ids, hooks: dict[str, EditFn] | list[tuple[str, EditFn]]) -> torch.Tensor:
    """Logits (B, T, V) of ids (T,) or (B, T) with a user function at each name (TransformerLens's
    run_with_hooks): fn(x) gets the name's tensor with a batch axis, (B, T, C) or per head
    (B, nh, T, hs), and returns a replacement of the same shape, or None to only read it."""
    items = list(hooks.items()) if isinstance(hooks, dict) else list(hooks)
    cfg = model.config
    edits = [(resolve(n, cfg.n_layer, cfg.n_head)[0], fn) for n, fn in items]
    idx = torch.as_tensor(ids, device=model.wte.weight.device)
    idx = idx[None] if idx.dim() == 1 else idx
    with edit_hooks(model, edits):
        return model(idx).logits
