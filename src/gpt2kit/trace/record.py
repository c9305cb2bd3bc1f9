"""Recording one forward pass: forward hooks on the network's own modules copy what each computed.

The hooks only read. The attention matrix, which SDPA never materialises, is derived inside the
c_attn hook from the recorded q and k (scaled, causally masked, softmaxed in float32), so q and k
need not outlive their block. Names and shapes: gpt2kit.trace's docstring and docs/trace.md.
Legend: T tokens, C n_embd, nh heads, hs head size, L layers, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from gpt2kit.trace.points import edit_hooks

KINDS: dict[str, tuple[str, ...]] = {
    "embed": ("embed.tok", "embed.pos"),  # not per block
    "resid": ("resid", "resid_mid"),
    "ln": ("ln_1", "ln_2"),  # ln_f is always kept (it is one (T, C) tensor)
    "qkv": ("attn.q", "attn.k", "attn.v"),
    "scores": ("attn.scores",),
    "probs": ("attn.probs",),
    "z": ("attn.z",),
    "attn_out": ("attn.out",),
    "mlp_pre": ("mlp.pre",),
    "mlp_post": ("mlp.post",),
    "mlp_out": ("mlp.out",),
}
GROUPS: dict[str, tuple[str, ...]] = {
    "all": tuple(KINDS),
    "attn": ("qkv", "scores", "probs", "z", "attn_out"),
    "mlp": ("mlp_pre", "mlp_post", "mlp_out"),
}
# Recording everything of gpt2-xl at 1024 tokens would need tens of GB; above this, ask for a selection.
DEFAULT_MAX_BYTES = 4 * 2**30


def parse_what(what: str | Iterable[str] | None) -> frozenset[str]:
    """A set of kinds from 'all', group names and kind names (comma-separated string or iterable)."""
    if what is None:
        return frozenset(KINDS)
    items = [w.strip() for w in what.split(",")] if isinstance(what, str) else [str(w).strip() for w in what]
    out: set[str] = set()
    for w in items:
        if w in GROUPS:
            out.update(GROUPS[w])
        elif w in KINDS:
            out.add(w)
        else:
            choices = ", ".join([*GROUPS, *KINDS])
            raise ValueError(f"unknown --what value {w!r}; choose from {choices}")
    if not out:
        raise ValueError("--what selects nothing; choose from " + ", ".join([*GROUPS, *KINDS]))
    return frozenset(out)


def parse_layers(layers: str | Iterable[int] | None, n_layer: int) -> tuple[int, ...]:
    """Block indices from 'all', '3', '0,5,11', '2-4', '-1' (last) or an iterable of ints."""
    if layers is None or layers == "all":
        return tuple(range(n_layer))
    if isinstance(layers, str):
        picked: list[int] = []
        for part in (p.strip() for p in layers.split(",")):
            try:
                if "-" in part[1:]:
                    a, b = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                    picked.extend(range(int(a), int(b) + 1))
                else:
                    picked.append(int(part))
            except ValueError:
                raise ValueError(f"unknown --layers value {part!r}; use 'all', N, N-M or a comma list") from None
    else:
        picked = [int(i) for i in layers]
    out = []
    for i in picked:
        j = i + n_layer if i < 0 else i
        if not 0 <= j < n_layer:
            raise ValueError(f"layer {i} is outside the model's blocks [0, {n_layer})")
        out.append(j)
    if not out:
        raise ValueError("--layers selects no block")
    return tuple(sorted(set(out)))


def estimate_bytes(config, T: int, what: frozenset[str], layers: Sequence[int], itemsize: int = 4) -> int:
    """Bytes the recorded tensors will take (the logits, ln_f and resid.L are always kept)."""
    C, nh, V = config.n_embd, config.n_head, config.n_vocab
    per_block = {"resid": 2 * T * C, "ln": 2 * T * C, "qkv": 3 * T * C, "scores": nh * T * T, "probs": nh * T * T,
                 "z": T * C, "attn_out": T * C, "mlp_pre": 4 * T * C, "mlp_post": 4 * T * C, "mlp_out": T * C}
    n = T * V + 2 * T * C + (2 * T * C if "embed" in what else 0)
    n += len(layers) * sum(v for k, v in per_block.items() if k in what)
    return n * itemsize


def attention_from_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (q k^T / sqrt(hs), -inf above the diagonal) and their softmax: (nh, T, hs) x2 -> (nh, T, T) x2."""
    T, hs = q.shape[-2], q.shape[-1]
    scores = (q.float() @ k.float().transpose(-1, -2)) * (1.0 / math.sqrt(hs))  # (nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)  # key j > query i
    scores = scores.masked_fill(future, float("-inf"))
    return scores, torch.softmax(scores, dim=-1)


class _Recorder:
    """Forward hooks that copy what each module computed into a dict (they never change it)."""

    def __init__(self, model, layers: tuple[int, ...], what: frozenset[str]) -> None:
        self.model, self.layers, self.what = model, layers, what
        self.out: dict[str, torch.Tensor] = {}
        self.handles: list = []
        self.silent: dict[int, str] = {}  # hooks that have not fired yet: key -> module name
        self.module_names = {id(mod): n for n, mod in model.named_modules()}

    def _hook(self, module, fn) -> None:
        key = len(self.handles)
        self.silent[key] = self.module_names.get(id(module), type(module).__name__)

        def fired(mod, args, out):
            self.silent.pop(key, None)
            return fn(mod, args, out)

        self.handles.append(module.register_forward_hook(fired))

    def __enter__(self) -> _Recorder:
        m, w, out = self.model, self.what, self.out
        L = m.config.n_layer
        if "embed" in w:
            self._hook(m.wte, lambda mod, a, o: out.__setitem__("embed.tok", o[0].detach()))
            self._hook(m.wpe, lambda mod, a, o: out.__setitem__("embed.pos", o.reshape(-1, o.shape[-1]).detach()))
        self._hook(m.drop, lambda mod, a, o: out.__setitem__("resid.0", o[0].detach()))
        for i in self.layers:
            self._hook_block(i)
        for i in range(L):
            if i in self.layers or i == L - 1:
                self._hook(m.h[i], lambda mod, a, o, i=i: out.__setitem__(f"resid.{i + 1}", o[0].detach()))

        def on_ln_f(mod, a, o):
            out["ln_f"] = o[0].detach()

        self._hook(m.ln_f, on_ln_f)
        return self

    def _hook_block(self, i: int) -> None:
        """The hooks inside block i for what was asked."""
        w, out = self.what, self.out
        blk, p = self.model.h[i], f"h.{i}."
        if "ln" in w:
            self._hook(blk.ln_1, lambda mod, a, o: out.__setitem__(p + "ln_1", o[0].detach()))
        self._hook_attention(blk.attn, p)

        def on_ln_2(mod, a, o):
            out[p + "resid_mid"] = a[0][0].detach()  # ln_2's input is H' = H + A
            out[p + "ln_2"] = o[0].detach()

        def on_mlp_proj(mod, a, o):
            out[p + "mlp.post"] = a[0][0].detach()  # c_proj's input is GELU(c_fc(x))
            out[p + "mlp.out"] = o[0].detach()

        if w & {"resid", "ln"}:
            self._hook(blk.ln_2, on_ln_2)
        if "mlp_pre" in w:
            self._hook(blk.mlp.c_fc, lambda mod, a, o: out.__setitem__(p + "mlp.pre", o[0].detach()))
        if w & {"mlp_post", "mlp_out"}:
            self._hook(blk.mlp.c_proj, on_mlp_proj)

    def _hook_attention(self, attn, p: str) -> None:
        w, out = self.what, self.out
        nh = self.model.config.n_head

        def heads(t: torch.Tensor) -> torch.Tensor:  # (1, T, C) -> (nh, T, hs)
            T, C = t.shape[1], t.shape[2]
            return t[0].reshape(T, nh, C // nh).transpose(0, 1).contiguous()

        def on_c_attn(mod, a, o):
            q, k, v = (heads(t) for t in o.detach().chunk(3, dim=-1))  # 3 x (nh, T, hs)
            if "qkv" in w:
                out[p + "attn.q"], out[p + "attn.k"], out[p + "attn.v"] = q, k, v
            if "scores" in w or "probs" in w:  # now, so q and k need not outlive their block
                scores, probs = attention_from_qk(q, k)
                if "scores" in w:
                    out[p + "attn.scores"] = scores
                if "probs" in w:
                    out[p + "attn.probs"] = probs

        def on_c_proj(mod, a, o):
            out[p + "attn.z"] = heads(a[0].detach())  # the per-head weighted values, merged for c_proj
            out[p + "attn.out"] = o[0].detach()

        if w & {"qkv", "scores", "probs"}:
            self._hook(attn.c_attn, on_c_attn)
        if w & {"z", "attn_out"}:
            self._hook(attn.c_proj, on_c_proj)

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _keep(name: str, what: frozenset[str], n_layer: int) -> bool:
    if name in ("logits", "ln_f", f"resid.{n_layer}"):
        return True
    if name.startswith("embed."):
        return "embed" in what
    if name.startswith("resid.") or name.endswith("resid_mid"):
        return "resid" in what
    tail = name.split(".", 2)[2]  # h.{i}.<tail>
    return any(tail in KINDS[k] for k in what if k not in ("embed", "resid"))


@torch.no_grad()
def run_hooked(model, ids: list[int], layers: tuple[int, ...], what: frozenset[str],
               edits: list | None = None) -> dict[str, torch.Tensor]:
    """One forward pass of ids with the recorder attached: {name: tensor} (logits included).
    edits: (name, fn) pairs for gpt2kit.trace.points.edit_hooks, registered before the recorder's
    hooks so what is recorded is what the edited network computed."""
    idx = torch.tensor([ids], device=model.wte.weight.device)  # (1, T)
    with edit_hooks(model, edits or []), _Recorder(model, layers, what) as rec:
        logits = model(idx).logits  # (1, T, V)
    raw = rec.out
    if rec.silent:
        raise RuntimeError(f"the forward pass did not call {next(iter(rec.silent.values()))!r} as a module, so "
                           "its hook did not fire; gpt2kit.trace needs a model whose submodules are called as modules")
    raw["logits"] = logits[0].detach()
    return {k: v for k, v in raw.items() if _keep(k, what, model.config.n_layer)}
