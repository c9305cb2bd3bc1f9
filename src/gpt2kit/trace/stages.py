"""One block, stage by stage, for one position and one head: what `gpt2kit explore` steps through.

Every stage is read from a Trace (the recorded tensors of gpt2kit.trace.record), in the order of
openai/gpt-2's src/model.py, each named by the function there that computes it. The few stages the
network never materialises are formed from recorded tensors with the same operations as the trace
(LayerNorm's mean and variance from the block's input; the fused QKV as q, k and v side by side
again; Q·Kᵀ before the scale, as attention_from_qk forms it). Shapes in the spec's notation (no
batch axis): T tokens, C n_embd, nh heads, d_h = C / nh, V vocab.
"""

from __future__ import annotations

import math

import torch

# (key, title, model.py function, symbolic shape, what it does)
STAGES: list[tuple[str, str, str, str, str]] = [
    ("input", "block input H", "block", "(T, C)", "the residual stream entering the block"),
    ("ln_1.mean", "LN₁: mean μ", "norm", "(T, 1)", "u = mean(x, axis=-1): one number per position"),
    ("ln_1.var", "LN₁: variance σ²", "norm", "(T, 1)", "s = mean((x - u)², axis=-1)"),
    ("ln_1.norm", "LN₁: normalised", "norm", "(T, C)", "(x - u) / sqrt(s + ε), ε = 1e-5"),
    ("ln_1", "LN₁: scale and shift", "norm", "(T, C)", "x̂ · g + b"),
    ("qkv", "fused QKV", "conv1d", "(T, 3C)", "c_attn: one product gives q, k and v side by side"),
    ("q", "Q, split into heads", "split_heads", "(nh, T, d_h)", "this head's slice of the first C columns"),
    ("k", "K, split into heads", "split_heads", "(nh, T, d_h)", "this head's slice of the middle C columns"),
    ("v", "V, split into heads", "split_heads", "(nh, T, d_h)", "this head's slice of the last C columns"),
    ("qk", "Q·Kᵀ", "multihead_attn", "(nh, T, T)", "w = matmul(q, k, transpose_b=True)"),
    ("scaled", "scaled by 1/√d_h", "multihead_attn", "(nh, T, T)", "w = w * rsqrt(d_h)"),
    ("masked", "causal mask", "mask_attn_weights", "(nh, T, T)",
     "a key after the query is removed (−∞ here; model.py subtracts 1e10)"),
    ("probs", "softmax", "multihead_attn", "(nh, T, T)", "each row sums to 1: how much the query reads from each key"),
    ("z", "weighted sum of V", "multihead_attn", "(nh, T, d_h)", "a = matmul(w, v)"),
    ("merged", "heads merged", "merge_heads", "(T, C)", "the heads side by side again"),
    ("attn.out", "attention projection", "conv1d", "(T, C)", "c_proj of attn"),
    ("resid_mid", "residual add", "block", "(T, C)", "x = x + a"),
    ("ln_2", "LN₂", "norm", "(T, C)", "the same normalisation, its own g and b"),
    ("mlp.pre", "c_fc", "conv1d", "(T, 4C)", "the MLP widens to 4C"),
    ("mlp.post", "tanh-GELU", "gelu", "(T, 4C)", "0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))"),
    ("mlp.out", "MLP projection", "conv1d", "(T, C)", "c_proj of mlp: back to C"),
    ("output", "residual add", "block", "(T, C)", "x = x + m: the block's output, the next block's input"),
    ("ln_f", "final LayerNorm", "model", "(T, C)", "ln_f after the last block"),
    ("logits", "tied head", "model", "(T, V)", "logits = matmul(h, wte, transpose_b=True): no separate matrix"),
    ("next", "softmax", "model", "(V,)", "the next-token distribution (model.py returns the logits; "
     "sample.py takes the softmax)"),
]


def _merge(t: torch.Tensor) -> torch.Tensor:
    """(nh, T, d_h) -> (T, C): the heads side by side."""
    nh, T, hs = t.shape
    return t.transpose(0, 1).reshape(T, nh * hs)


def stage_tensors(tr, layer: int, head: int) -> dict[str, torch.Tensor]:
    """Each stage's tensor, 2-D (rows = query positions): per-head stages as this head's slice."""
    p = f"h.{layer}."
    x = tr[f"resid.{layer}"].float()  # (T, C)
    ln = tr.model.h[layer].ln_1
    mean = x.mean(-1, keepdim=True)  # (T, 1)
    var = (x - mean).pow(2).mean(-1, keepdim=True)  # (T, 1)
    q, k, v = (tr[p + f"attn.{n}"] for n in "qkv")  # (nh, T, d_h) each
    hs = q.shape[-1]
    qk = q[head].float() @ k[head].float().transpose(-1, -2)  # (T, T)
    return {
        "input": x, "ln_1.mean": mean, "ln_1.var": var, "ln_1.norm": (x - mean) / torch.sqrt(var + ln.eps),
        "ln_1": tr[p + "ln_1"], "qkv": torch.cat([_merge(q), _merge(k), _merge(v)], dim=-1),
        "q": q[head], "k": k[head], "v": v[head], "qk": qk, "scaled": qk * (1.0 / math.sqrt(hs)),
        "masked": tr[p + "attn.scores"][head], "probs": tr[p + "attn.probs"][head], "z": tr[p + "attn.z"][head],
        "merged": _merge(tr[p + "attn.z"]), "attn.out": tr[p + "attn.out"], "resid_mid": tr[p + "resid_mid"],
        "ln_2": tr[p + "ln_2"], "mlp.pre": tr[p + "mlp.pre"], "mlp.post": tr[p + "mlp.post"],
        "mlp.out": tr[p + "mlp.out"], "output": tr[f"resid.{layer + 1}"], "ln_f": tr["ln_f"], "logits": tr.logits,
    }


def _num(x: float) -> float | str:
    """JSON has no infinities: the masked scores travel as the strings '-inf' / 'inf' / 'nan'."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def _window(n: int, want: int, end: int | None) -> range:
    """`want` indices of [0, n): the first ones, or the ones ending at `end` (inclusive)."""
    if end is None:
        return range(min(want, n))
    return range(max(0, end - want + 1), end + 1)


def _dims(key: str, t: torch.Tensor, cfg) -> list[int]:
    if key in ("q", "k", "v", "z", "qk", "scaled", "masked", "probs"):
        return [cfg.n_head, *t.shape]
    return list(t.shape)


def block_stages(tr, layer: int, head: int, position: int, rows: int = 4, cols: int = 8, top: int = 10) -> dict:
    """The stages of block `layer` for query `position` and head `head`, each with its title, model.py
    function, symbolic and actual shape, and values: the `rows` positions up to `position` (rows
    ending at it) x the first `cols` columns (for the (T, T) stages, the `cols` keys ending at it)."""
    cfg, T = tr.config, len(tr.ids)
    for what, v, n in (("layer", layer, cfg.n_layer), ("head", head, cfg.n_head), ("position", position, T)):
        if not 0 <= v < n:
            raise ValueError(f"{what} {v} is outside [0, {n})")
    for what, v in (("rows", rows), ("cols", cols)):
        if not 1 <= v <= 4096:
            raise ValueError(f"{what} must be in [1, 4096], got {v}")
    tensors = stage_tensors(tr, layer, head)
    out = []
    for key, title, fn, shape, note in STAGES:
        entry = {"key": key, "title": title, "fn": fn, "shape": shape, "note": note}
        if key == "next":
            p = torch.softmax(tr.logits[position].float(), -1)
            pv, pi = p.topk(min(top, p.numel()))
            entry.update(dims=[cfg.n_vocab], top=[[int(i), float(q)] for i, q in zip(pi, pv, strict=True)])
        else:
            t = tensors[key].float()
            r = _window(T, rows, position)
            c = _window(t.shape[1], cols, position if t.shape[1] == T and key in ("qk", "scaled", "masked", "probs")
                        else None)
            block = t[r.start:r.stop, c.start:c.stop].tolist()
            entry.update(dims=_dims(key, t, cfg), rows=list(r), cols=list(c),
                         values=[[_num(x) for x in row] for row in block])
        out.append(entry)
    return {"layer": layer, "head": head, "position": position, "T": T, "stages": out}
