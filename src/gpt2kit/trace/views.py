"""Views derived from a Trace: next-token statistics, logit lens, direct logit attribution,
residual norms, attention-head summaries.

Each view reuses the network's own modules (ln_f, the tied head wte, attn.c_proj) on recorded
tensors; nothing here re-implements a block. Legend: T tokens, C n_embd, nh heads, hs head size,
L layers, V vocab, K top-k.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def unembed(model, x: torch.Tensor) -> torch.Tensor:
    """The model's own tied head: x (..., C) -> logits (..., V)."""
    return model.lm_head(x)


def _matrix(module) -> torch.Tensor:
    """The float matrix a module multiplies by: its weight, or what an int8 module's codes and scales
    stand for (gpt2kit.quant; its `weight` holds the int8 codes)."""
    dequantize = getattr(module, "dequantize", None)
    return dequantize() if dequantize is not None else module.weight


def _rank(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 + how many tokens score strictly higher than the target: (T, V), (T,) -> (T,)."""
    tl = logits.gather(-1, target[:, None])  # (T, 1)
    return (logits > tl).sum(-1) + 1


def _next_ids(tr) -> torch.Tensor:
    return torch.tensor(tr.ids[1:], device=tr.logits.device)  # (T - 1,)


@torch.no_grad()
def next_token_stats(tr, k: int = 10) -> dict:
    """Per position t: the top-k next tokens and, for t < T-1, the actual next token's log-prob
    (nats), surprisal (bits) and rank. Index t predicts token t + 1."""
    logits = tr.logits.float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    k = min(k, logits.shape[-1])
    top_p, top_i = logp.exp().topk(k, dim=-1)  # (T, K)
    nxt = _next_ids(tr)
    lp = logp[:-1].gather(-1, nxt[:, None])[:, 0]  # (T - 1,)
    return {"top_ids": top_i.tolist(), "top_probs": top_p.tolist(), "next_logprob": lp.tolist(),
            "surprisal_bits": (-lp / LN2).tolist(), "next_rank": _rank(logits[:-1], nxt).tolist()}


def lens_layers(tr) -> list[int]:
    L = tr.config.n_layer
    return [layer for layer in range(L + 1) if f"resid.{layer}" in tr.tensors]


@torch.no_grad()
def lens_logits(tr, layer: int) -> torch.Tensor:
    """H^(layer) through ln_f and the tied head: (T, V). At layer L this is the model's own logits."""
    return unembed(tr.model, tr.model.ln_f(tr[f"resid.{layer}"]))


def _lens_rows(logits: torch.Tensor, nxt: torch.Tensor, k: int) -> tuple[list, list, list, list]:
    """Top-k ids and probabilities of every row of (g, T, V) logits, and the next token's probability
    and rank (positions 0..T-2). Reads the logits a few times and writes nothing their size (the
    probabilities are exp(logit - logsumexp), never a full log_softmax), so the lens holds one
    (g, T, V) block at a time instead of three."""
    g, T, V = logits.shape
    lse = torch.logsumexp(logits, dim=-1)  # (g, T)
    top_l, top_i = logits.topk(k, dim=-1)  # (g, T, K)
    top_p = (top_l - lse[..., None]).exp()
    target = nxt[None, :, None].expand(g, T - 1, 1)
    tl = logits[:, :-1].gather(-1, target)  # (g, T - 1, 1)
    next_p = (tl[..., 0] - lse[:, :-1]).exp()  # (g, T - 1)
    rank = torch.empty(g, T - 1, dtype=torch.long)
    for s in range(0, T - 1, 64):  # in row blocks: the comparison's mask stays small
        e = min(s + 64, T - 1)
        rank[:, s:e] = (logits[:, s:e] > tl[:, s:e]).sum(-1, dtype=torch.int32) + 1
    return top_i.tolist(), top_p.tolist(), next_p.tolist(), rank.tolist()


@torch.no_grad()
def logit_lens(tr, k: int = 5) -> dict:
    """Per recorded residual layer x position: top-k tokens and probabilities; the probability and
    rank of the actual next token (positions 0..T-2)."""
    layers = lens_layers(tr)
    T, V, L = len(tr.ids), tr.config.n_vocab, tr.config.n_layer
    nxt = _next_ids(tr)
    k = min(k, V)
    out: dict[int, tuple] = {}
    # At the last layer the lens is the model's own output (tested equal): reuse it.
    computed = [layer for layer in layers if layer != L]
    # Several layers per product (fewer, larger GEMMs), at most ~256 MB of (rows, V) logits at a time.
    per = max(1, (2**28 // 4) // max(1, T * V))
    for s in range(0, len(computed), per):
        group = computed[s:s + per]
        h = torch.cat([tr.model.ln_f(tr[f"resid.{layer}"]) for layer in group])  # (g T, C)
        logits = unembed(tr.model, h).float().reshape(len(group), T, V)  # (g, T, V)
        for layer, *rows in zip(group, *_lens_rows(logits, nxt, k), strict=True):
            out[layer] = rows
        del logits
    if L in layers:
        out[L] = [r[0] for r in _lens_rows(tr.logits.float()[None], nxt, k)]
    cols = list(zip(*(out[layer] for layer in layers), strict=True)) if layers else [(), (), (), ()]
    return {"layers": layers, "top_ids": list(cols[0]), "top_probs": list(cols[1]), "next_prob": list(cols[2]),
            "next_rank": list(cols[3])}


def dla_targets(tr) -> list[int]:
    """The token each position's attribution explains: the actual next token, or the top-1 at the end."""
    return [*tr.ids[1:], int(tr.logits[-1].argmax())]


def _need_components(tr) -> None:
    L = tr.config.n_layer
    need = ["embed.tok", "embed.pos"] + [f"h.{i}.{s}" for i in range(L) for s in ("attn.z", "mlp.out")]
    missing = [n for n in need if n not in tr.tensors]
    if missing:
        raise ValueError(f"direct logit attribution needs every block's attn.z and mlp.out and the embeddings; "
                         f"{missing[0]!r} was not recorded (trace with layers='all' and what including "
                         "embed, z, mlp_out)")


@torch.no_grad()
def direct_logit_attribution(tr, position: int | None = None, token: int | None = None) -> dict:
    """How much each piece added to the residual stream contributes to the logit of `token` at
    `position` through ln_f.

    The pieces: embed.tok + embed.pos + sum over blocks of (each head + the attention bias + the
    MLP) = H^(L); a head's piece is its weighted values z_h through its slice of attn.c_proj.
    ln_f(x) = (x - mean(x)) / sigma * g + b, with sigma the final residual's own (held fixed), so
    logit = sum_c (c - mean(c)) / sigma . (g * wte[token]) + b . wte[token]: each term is linear in
    its piece, and the terms sum to the logit (within float rounding; computed in float64).
    position: default every position (-1 counts from the end); token: default the actual next
    token (the top-1 prediction at the last position).
    """
    _need_components(tr)
    T, L, nh = len(tr.ids), tr.config.n_layer, tr.config.n_head
    ln = tr.model.ln_f
    x = tr[f"resid.{L}"].double()  # (T, C)
    sigma = torch.sqrt(x.var(-1, unbiased=False) + ln.eps)  # (T,)
    targets = dla_targets(tr) if token is None else [int(token)] * T
    W_U = _matrix(tr.model.wte)[torch.tensor(targets, device=x.device)].double()  # (T, C)
    d = ln.weight.double() * W_U  # (T, C): the direction a piece is read along
    # (c - mean(c)) . d = c . (d - mean(d)): centre the direction once instead of every piece.
    d = (d - d.mean(-1, keepdim=True)) / sigma[:, None]  # (T, C)

    def along(c: torch.Tensor) -> torch.Tensor:  # (T, C) -> (T,)
        return (c.double() * d).sum(-1)

    labels, cols = ["embed.tok", "embed.pos"], [along(tr["embed.tok"]), along(tr["embed.pos"])]
    for i in range(L):
        proj = tr.model.h[i].attn.c_proj
        z = tr[f"h.{i}.attn.z"].double()  # (nh, T, hs)
        hs = z.shape[-1]
        back = (d @ _matrix(proj).double()).view(T, nh, hs).transpose(0, 1)  # (nh, T, hs): d through c_proj
        heads = (z * back).sum(-1)  # (nh, T)
        labels += [f"h.{i}.attn.head.{h}" for h in range(nh)] + [f"h.{i}.attn.bias", f"h.{i}.mlp"]
        cols += [*heads, d @ proj.bias.double(), along(tr[f"h.{i}.mlp.out"])]
    labels.append("ln_f.bias")
    cols.append(W_U @ ln.bias.double())
    values = torch.stack(cols, dim=1)  # (T, n)
    # gather, then widen: only T numbers need float64, not all (T, V) logits
    logit = tr.logits.gather(-1, torch.tensor(targets, device=x.device)[:, None])[:, 0].double()  # (T,)
    if position is not None:
        if not -T <= position < T:
            raise ValueError(f"position {position} is outside the input's {T} tokens")
        pos = position % T
        return {"position": pos, "token": targets[pos], "labels": labels, "values": values[pos].tolist(),
                "logit": float(logit[pos])}
    return {"tokens": targets, "labels": labels, "values": values.tolist(), "logit": logit.tolist()}


@torch.no_grad()
def residual_norms(tr) -> torch.Tensor:
    """||H^(l)_t|| for each recorded residual layer l (rows, see lens_layers) and position t: (nL, T)."""
    return torch.stack([tr[f"resid.{layer}"].float().norm(dim=-1) for layer in lens_layers(tr)])


def _induction_mask(ids: list[int]) -> torch.Tensor:
    """(T, T) True at (t, j) when j follows an earlier occurrence of token t: ids[j - 1] == ids[t], j <= t."""
    T = len(ids)
    m = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for j in range(1, t + 1):
            if ids[j - 1] == ids[t]:
                m[t, j] = True
    return m


@torch.no_grad()
def attention_summary(tr) -> dict:
    """Per recorded block and head: mean attention to the previous token, to the first token, and
    (where the text repeats a token) to the token after its earlier occurrence (induction)."""
    layers = [i for i in tr.layers if f"h.{i}.attn.probs" in tr.tensors]
    T = len(tr.ids)
    ind = _induction_mask(tr.ids)
    rows = ind.any(-1)  # queries that have an induction target
    out = {"layers": layers, "prev": [], "first": [], "induction": []}
    for i in layers:
        P = tr[f"h.{i}.attn.probs"].float().cpu()  # (nh, T, T)
        prev = P.diagonal(offset=-1, dim1=1, dim2=2).mean(-1) if T > 1 else torch.zeros(P.shape[0])
        out["prev"].append(prev.tolist())
        out["first"].append(P[:, :, 0].mean(-1).tolist())
        if rows.any():
            out["induction"].append((P * ind).sum(-1)[:, rows].mean(-1).tolist())
        else:
            out["induction"].append(None)
    return out


@torch.no_grad()
def intervention_effect(tr, k: int = 5) -> dict:
    """tr (the intervened run) against tr.clean: per position KL(clean || intervened) in nats and
    the actual next token's log-prob in both; at the last position the union of both top-k with
    each one's probability in both runs (sorted by the clean probability)."""
    a = torch.log_softmax(tr.clean.logits.float(), dim=-1)  # (T, V)
    b = torch.log_softmax(tr.logits.float(), dim=-1)  # (T, V)
    kl = (a.exp() * (a - b)).sum(-1)  # (T,)
    nxt = _next_ids(tr)
    k = min(k, a.shape[-1])
    ids = list(dict.fromkeys(a[-1].topk(k).indices.tolist() + b[-1].topk(k).indices.tolist()))
    rows = sorted(([i, float(a[-1, i].exp()), float(b[-1, i].exp())] for i in ids), key=lambda r: -r[1])
    return {"interventions": list(tr.interventions), "kl": kl.tolist(),
            "clean_next_logprob": a[:-1].gather(-1, nxt[:, None])[:, 0].tolist(),
            "next_logprob": b[:-1].gather(-1, nxt[:, None])[:, 0].tolist(), "last": rows,
            "max_abs_logit_change": float((tr.logits.float() - tr.clean.logits.float()).abs().max())}
