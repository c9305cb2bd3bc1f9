"""The forward pass made visible, exactly: `trace(model, tokenizer, text_or_ids)` -> `Trace`.

Every intermediate is recorded by forward hooks on the network's own modules (wte, wpe, drop, each
block's ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, the block itself, ln_f), so
the numbers are the ones the forward pass computed; the hooks only read. The one thing the network
does not materialise is the attention matrix (SDPA fuses it away), so scores and probabilities are
derived from the recorded q and k: q k^T / sqrt(hs), causal mask, softmax (proven equal to
transformers' eager attention in tests/test_trace.py).

Names (spec notation in docs/trace.md; one input, so no batch axis):
  embed.tok (T, C) wte[X]                      embed.pos (T, C) wpe[pos]
  resid.{l} (T, C) H^(l), l = 0..L (resid.0 = wte[X] + wpe[pos]; resid.{i+1} = block i's output)
  h.{i}.ln_1 (T, C)   h.{i}.attn.q/k/v (nh, T, hs)   h.{i}.attn.scores/probs (nh, T, T)
  h.{i}.attn.z (nh, T, hs) = P V per head      h.{i}.attn.out (T, C) A = c_proj(merge(z))
  h.{i}.resid_mid (T, C) H' = H + A            h.{i}.ln_2 (T, C)
  h.{i}.mlp.pre (T, 4C) c_fc   h.{i}.mlp.post (T, 4C) GELU   h.{i}.mlp.out (T, C) M
  ln_f (T, C)   logits (T, V)

Legend: T tokens, C n_embd, nh heads, hs head size, L layers, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Kinds a `what` selection may name, and the tensors of each (per block unless noted).
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


@dataclass
class Trace:
    """Every recorded intermediate of one forward pass, by name (see the module docstring)."""

    ids: list[int]
    tokens: list[str]  # each id decoded on its own
    tensors: dict[str, torch.Tensor]
    model: Any = field(repr=False)  # the GPT2 (views use its ln_f, wte and c_proj)
    layers: tuple[int, ...] = ()
    what: frozenset[str] = frozenset()
    top_k: int = 10
    name: str = ""  # the model's name, for the report
    patching: Any = None  # a PatchResult when patch_from was given
    tokenizer: Any = field(default=None, repr=False)  # decodes the token ids views name
    _views: dict = field(default_factory=dict, repr=False)  # computed views, by name and arguments

    def _view(self, fn, *args):
        key = (fn.__name__, *args)
        if key not in self._views:
            self._views[key] = fn(self, *args)
        return self._views[key]

    # --- access ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} was not recorded (recorded: {len(self.tensors)} tensors; "
                           "widen the layers/what selection)") from None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.tensors.items()}

    @property
    def config(self):
        return self.model.config

    @property
    def logits(self) -> torch.Tensor:
        return self.tensors["logits"]

    # --- derived views (gpt2kit.trace.views) ----------------------------------------------------
    def next_token_stats(self) -> dict:
        from gpt2kit.trace.views import next_token_stats

        return self._view(next_token_stats, self.top_k)

    def logit_lens(self, k: int = 5) -> dict:
        from gpt2kit.trace.views import logit_lens

        return self._view(logit_lens, k)

    def direct_logit_attribution(self, position: int | None = None, token: int | None = None) -> dict:
        from gpt2kit.trace.views import direct_logit_attribution

        return self._view(direct_logit_attribution, position, token)

    def residual_norms(self) -> torch.Tensor:
        from gpt2kit.trace.views import residual_norms

        return residual_norms(self)

    def attention_summary(self) -> dict:
        from gpt2kit.trace.views import attention_summary

        return self._view(attention_summary)

    # --- outputs --------------------------------------------------------------------------------
    def to_json(self, *, attention: bool = True) -> dict:
        """The report's data at full precision (views, not the raw tensors: those go to save_npz)."""
        from gpt2kit.trace.report import report_data

        return report_data(self, attention_encoding="list" if attention else None)

    def save_npz(self, path) -> None:
        """Every recorded tensor (float32) plus ids, under the trace's names."""
        import io

        import numpy as np

        from gpt2kit._io import atomic_write

        arrays = {k: v.detach().float().cpu().numpy() for k, v in self.tensors.items()}
        arrays["ids"] = np.asarray(self.ids, dtype=np.int64)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        _write_bytes(path, buf.getvalue(), atomic_write)

    def to_html(self) -> str:
        from gpt2kit.trace.report import render_html

        return render_html(self)

    def save_html(self, path) -> None:
        from gpt2kit._io import atomic_write

        _write_bytes(path, self.to_html().encode("utf-8"), atomic_write)

    def _repr_html_(self) -> str:
        # An iframe keeps the report's script and styles to itself inside Jupyter or VS Code.
        import html

        return (f'<iframe srcdoc="{html.escape(self.to_html(), quote=True)}" '
                'style="width:100%;height:720px;border:1px solid #ccc" sandbox="allow-scripts"></iframe>')

    def __repr__(self) -> str:
        return f"Trace({len(self.ids)} tokens, {len(self.tensors)} tensors, layers={list(self.layers)})"


def _write_bytes(path, data: bytes, atomic_write) -> None:
    atomic_write(path, lambda f: f.write(data))


def _to_ids(tokenizer, text_or_ids, prepend_eot: bool) -> list[int]:
    if isinstance(text_or_ids, str):
        if not text_or_ids:
            raise ValueError("the text is empty: nothing to trace")
        ids = tokenizer.encode(text_or_ids)
    elif isinstance(text_or_ids, torch.Tensor):
        ids = [int(i) for i in text_or_ids.reshape(-1).tolist()]
    else:
        ids = [int(i) for i in text_or_ids]
    if prepend_eot:
        ids = [tokenizer.eot_token, *ids]
    if not ids:
        raise ValueError("the input has no tokens: nothing to trace")
    return ids


def _decode_tokens(tokenizer, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _check_ids(model, ids: list[int]) -> None:
    cfg = model.config
    if len(ids) > cfg.n_ctx:
        raise ValueError(f"the input has {len(ids)} tokens, more than the context n_ctx={cfg.n_ctx}")
    bad = [i for i in ids if not 0 <= i < cfg.n_vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.n_vocab})")


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
        nh = m.config.n_head
        L = m.config.n_layer

        def heads(t: torch.Tensor) -> torch.Tensor:  # (1, T, C) -> (nh, T, hs)
            T, C = t.shape[1], t.shape[2]
            return t[0].reshape(T, nh, C // nh).transpose(0, 1).contiguous()

        if "embed" in w:
            self._hook(m.wte, lambda mod, a, o: out.__setitem__("embed.tok", o[0].detach()))
            self._hook(m.wpe, lambda mod, a, o: out.__setitem__("embed.pos", o.reshape(-1, o.shape[-1]).detach()))
        self._hook(m.drop, lambda mod, a, o: out.__setitem__("resid.0", o[0].detach()))
        for i in self.layers:
            blk, p = m.h[i], f"h.{i}."
            if "ln" in w:
                self._hook(blk.ln_1, lambda mod, a, o, p=p: out.__setitem__(p + "ln_1", o[0].detach()))

            def on_c_attn(mod, a, o, p=p):
                q, k, v = (heads(t) for t in o.detach().chunk(3, dim=-1))  # 3 x (nh, T, hs)
                if "qkv" in w:
                    out[p + "attn.q"], out[p + "attn.k"], out[p + "attn.v"] = q, k, v
                if "scores" in w or "probs" in w:  # now, so q and k need not outlive their block
                    scores, probs = attention_from_qk(q, k)
                    if "scores" in w:
                        out[p + "attn.scores"] = scores
                    if "probs" in w:
                        out[p + "attn.probs"] = probs

            def on_c_proj(mod, a, o, p=p):
                out[p + "attn.z"] = heads(a[0].detach())  # the per-head weighted values, merged for c_proj
                out[p + "attn.out"] = o[0].detach()

            def on_ln_2(mod, a, o, p=p):
                out[p + "resid_mid"] = a[0][0].detach()  # ln_2's input is H' = H + A
                out[p + "ln_2"] = o[0].detach()

            def on_mlp_proj(mod, a, o, p=p):
                out[p + "mlp.post"] = a[0][0].detach()  # c_proj's input is GELU(c_fc(x))
                out[p + "mlp.out"] = o[0].detach()

            if w & {"qkv", "scores", "probs"}:
                self._hook(blk.attn.c_attn, on_c_attn)
            if w & {"z", "attn_out"}:
                self._hook(blk.attn.c_proj, on_c_proj)
            if w & {"resid", "ln"}:
                self._hook(blk.ln_2, on_ln_2)
            if "mlp_pre" in w:
                self._hook(blk.mlp.c_fc, lambda mod, a, o, p=p: out.__setitem__(p + "mlp.pre", o[0].detach()))
            if w & {"mlp_post", "mlp_out"}:
                self._hook(blk.mlp.c_proj, on_mlp_proj)
        for i in range(L):
            if i in self.layers or i == L - 1:
                self._hook(m.h[i], lambda mod, a, o, i=i: out.__setitem__(f"resid.{i + 1}", o[0].detach()))

        def on_ln_f(mod, a, o):
            out["ln_f"] = o[0].detach()

        self._hook(m.ln_f, on_ln_f)
        return self

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
def run_hooked(model, ids: list[int], layers: tuple[int, ...], what: frozenset[str]) -> dict[str, torch.Tensor]:
    """One forward pass of ids with the recorder attached: {name: tensor} (logits included)."""
    idx = torch.tensor([ids], device=model.wte.weight.device)  # (1, T)
    with _Recorder(model, layers, what) as rec:
        logits = model(idx).logits  # (1, T, V)
    raw = rec.out
    if rec.silent:
        raise RuntimeError(f"the forward pass did not call {next(iter(rec.silent.values()))!r} as a module, so "
                           "its hook did not fire; gpt2kit.trace needs a model whose submodules are called as modules")
    raw["logits"] = logits[0].detach()
    return {k: v for k, v in raw.items() if _keep(k, what, model.config.n_layer)}


def trace(model, tokenizer, text_or_ids: str | Sequence[int] | torch.Tensor, *, top_k: int = 10,
          layers: str | Iterable[int] | None = None, what: str | Iterable[str] | None = None,
          prepend_eot: bool = False, patch_from: str | Sequence[int] | None = None,
          patch_layers: str | Iterable[int] | None = None, answer: int | None = None, foil: int | None = None,
          max_bytes: int = DEFAULT_MAX_BYTES, name: str = "") -> Trace:
    """Run one input through the model and record its forward pass.

    text_or_ids: a text (encoded with tokenizer) or token ids. No <|endoftext|> is added unless
        prepend_eot. tokenizer may be None when ids are given (tokens are then shown as <id>).
    layers / what: which blocks and which kinds of tensor to keep (see KINDS, GROUPS); the
        embeddings, the final residual, ln_f and the logits are always kept.
    patch_from: a second input of the same token length, the corrupted run of an activation-
        patching experiment: each (residual layer, position) of this (clean) trace is patched
        into it, and trace.patching says how much of the clean-vs-corrupted logit difference each
        patch restores (gpt2kit.trace.patching). answer / foil: the token ids whose logit difference
        is measured at the last position (default: the clean and the corrupted top-1).
    """
    if model.training:
        raise ValueError("trace records inference: call model.eval() first (dropout would change the numbers)")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    ids = _to_ids(tokenizer, text_or_ids, prepend_eot)
    _check_ids(model, ids)
    sel_layers = parse_layers(layers, model.config.n_layer)
    sel_what = parse_what(what)
    itemsize = 4  # views and saved tensors are float32
    need = estimate_bytes(model.config, len(ids), sel_what, sel_layers, itemsize)
    if need > max_bytes:
        raise ValueError(f"recording {len(sel_layers)} blocks x {sorted(sel_what)} for {len(ids)} tokens needs "
                         f"~{need / 2**30:.1f} GiB, over the limit of {max_bytes / 2**30:.1f} GiB; "
                         "select fewer with layers=/--layers or what=/--what")
    tensors = run_hooked(model, ids, sel_layers, sel_what)
    tr = Trace(ids=ids, tokens=_decode_tokens(tokenizer, ids), tensors=tensors, model=model, layers=sel_layers,
               what=sel_what, top_k=top_k, name=name, tokenizer=tokenizer)
    if patch_from is not None:
        from gpt2kit.trace.patching import patch_residual

        corrupt = _to_ids(tokenizer, patch_from, prepend_eot)
        _check_ids(model, corrupt)
        tr.patching = patch_residual(model, ids, corrupt, layers=patch_layers, answer=answer, foil=foil,
                                     tokens=_decode_tokens(tokenizer, corrupt))
    return tr


__all__ = ["GROUPS", "KINDS", "Trace", "attention_from_qk", "parse_layers", "parse_what", "run_hooked", "trace"]
