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
    stand for (gpt2kit.quant.modules; its `weight` holds the int8 codes)."""
    dequantize = getattr(module, "dequantize", None)
    return dequantize() if dequantize is not None else module.weight


def _next_ids(tr) -> torch.Tensor:
    return torch.tensor(tr.ids[1:], dtype=torch.long, device=tr.logits.device)  # (T - 1,): ids even when empty


def _scan(logits: torch.Tensor, targets: torch.Tensor, k: int, scratch: torch.Tensor) -> tuple:
    """What the report reads from each row of (R, V) logits without keeping a (R, V) result: the
    top-k ids and log-probs, the target's log-prob and rank (1 + how many tokens score strictly
    higher). The logits are read, never written; the one (R, V) write is into scratch (reused across
    calls, so no fresh pages are faulted in per block). Log-probs as log_softmax forms them:
    (x - max) - log(sum(exp(x - max))); the max is the top-1. Counting in float32 is exact (< 2^24)."""
    top_l, top_i = logits.topk(k, dim=-1)  # (R, K)
    m = top_l[:, :1]  # (R, 1): the row's max
    tl = logits.gather(-1, targets[:, None])  # (R, 1)
    torch.gt(logits, tl, out=scratch)  # 1.0 where a token scores strictly higher than the target
    rank = scratch.sum(-1).long() + 1  # (R,)
    torch.sub(logits, m, out=scratch).exp_()
    log_z = scratch.sum(-1, keepdim=True).log_()  # (R, 1)
    return top_i, top_l - m - log_z, (tl - m - log_z)[:, 0], rank


def _scratch(rows: int, V: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows, V, dtype=torch.float32, device=like.device)


@torch.no_grad()
def next_token_stats(tr, k: int = 10) -> dict:
    """Per position t: the top-k next tokens and, for t < T-1, the actual next token's log-prob
    (nats), surprisal (bits) and rank. Index t predicts token t + 1. Also whether each position's
    logits are all finite, and the mean surprisal over the positions whose logits are."""
    logits = tr.logits.float()  # (T, V)
    k = min(k, logits.shape[-1])
    targets = torch.cat([_next_ids(tr), _next_ids(tr).new_zeros(1)])  # (T,): a stand-in at the end
    top_i, top_lp, lp, rank = _scan(logits, targets, k, _scratch(*logits.shape, logits))
    lp = lp[:-1]  # (T - 1,)
    finite = torch.isfinite(logits).all(-1)  # (T,): NaN or inf logits (an intervention, a hook, bad weights)
    bits = (-lp / LN2)[finite[:-1]]
    return {"top_ids": top_i.tolist(), "top_probs": top_lp.exp().tolist(), "next_logprob": lp.tolist(),
            "surprisal_bits": (-lp / LN2).tolist(), "next_rank": rank[:-1].tolist(), "finite_logits": finite.tolist(),
            "mean_surprisal_bits": float(bits.mean()) if len(bits) else None}


def lens_layers(tr) -> list[int]:
    L = tr.config.n_layer
    return [layer for layer in range(L + 1) if f"resid.{layer}" in tr.tensors]


@torch.no_grad()
def lens_logits(tr, layer: int) -> torch.Tensor:
    """H^(layer) through ln_f and the tied head: (T, V). At layer L this is the model's own logits."""
    return unembed(tr.model, tr.model.ln_f(tr[f"resid.{layer}"]))


# Rows of lens logits per product: a (rows, V) float32 block and its scratch, at most 2**28 bytes each,
# so the products stay large (fewer passes over wte) while memory stays bounded for long inputs.
_LENS_BLOCK_BYTES = 2**28


def _blocks(start: int, stop: int, most: int) -> list[tuple[int, int]]:
    """[start, stop) in the fewest blocks of at most `most` rows, of near-equal size."""
    n = -(-(stop - start) // most)
    size = -(-(stop - start) // n) if n else 0
    return [(s, min(s + size, stop)) for s in range(start, stop, size)] if n else []


def _lens_rows(tr, layers: list[int], k: int) -> dict[int, tuple[list, list, list, list]]:
    """The lens of these layers: {layer: (top ids, top probs, next prob, next rank)}, each a list per position.

    Every (layer, position) row is one row of a single stack, so the unembedding runs as a few large
    products over all layers at once; each product's (rows, V) logits are scanned once (_scan) and
    dropped. At the last layer the lens is the model's own output (tested equal): its rows are the
    recorded logits, not a product."""
    T, V, L = len(tr.ids), tr.config.n_vocab, tr.config.n_layer
    layers = [layer for layer in layers if layer != L] + [layer for layer in layers if layer == L]
    computed = layers[:-1] if layers and layers[-1] == L else layers
    h = torch.cat([tr.model.ln_f(tr[f"resid.{layer}"]) for layer in computed]) if computed else None  # (g T, C)
    nxt = _next_ids(tr)
    targets = torch.cat([nxt, nxt.new_zeros(1)]).repeat(len(layers))  # (n T,): a stand-in at each end
    rows, nc = len(layers) * T, len(computed) * T  # rows of the products first, then the last layer's
    per = max(1, min(rows, _LENS_BLOCK_BYTES // (4 * V)))
    scratch = _scratch(per, V, tr.logits)
    parts = []
    for s, e in _blocks(0, nc, per) + _blocks(nc, rows, per):
        block = unembed(tr.model, h[s:e]).float() if s < nc else tr.logits[s - nc:e - nc].float()  # (rows, V)
        parts.append(_scan(block, targets[s:e], k, scratch[:e - s]))
        del block
    if not parts:
        return {}
    n = len(layers)
    top_i, top_lp, next_lp, rank = (torch.cat(c).view(n, T, *c[0].shape[1:]) for c in zip(*parts, strict=True))
    cols = (top_i.tolist(), top_lp.exp().tolist(), next_lp[:, :-1].exp().tolist(), rank[:, :-1].tolist())
    return {layer: tuple(c[j] for c in cols) for j, layer in enumerate(layers)}


def _unchanged(tr, like, layer: int) -> bool:
    """Whether the residual at this layer (the logits at the last) is bit for bit the same in both traces."""
    name = "logits" if layer == tr.config.n_layer else f"resid.{layer}"
    return name in like.tensors and torch.equal(tr[name], like[name])


@torch.no_grad()
def logit_lens(tr, k: int = 5, like=None) -> dict:
    """Per recorded residual layer x position: top-k tokens and probabilities; the probability and
    rank of the actual next token (positions 0..T-2).

    like: another trace of the same ids and model (the intervened run, for the clean one): every
    layer whose residual is bit for bit like's takes its rows from like's lens (computed once and
    cached there) instead of another product — an intervention leaves the layers before it alone."""
    layers = lens_layers(tr)
    k = min(k, tr.config.n_vocab)
    out: dict[int, tuple] = {}
    if like is not None and like.ids == tr.ids and like.model is tr.model:
        theirs = like.logit_lens(k)
        for j, layer in enumerate(theirs["layers"]):
            if layer in layers and _unchanged(tr, like, layer):
                out[layer] = tuple(theirs[key][j] for key in ("top_ids", "top_probs", "next_prob", "next_rank"))
    out.update(_lens_rows(tr, [layer for layer in layers if layer not in out], k))
    return {"layers": layers, **{key: [out[layer][c] for layer in layers]
                                 for c, key in enumerate(("top_ids", "top_probs", "next_prob", "next_rank"))}}


def clean_lens(tr, k: int = 5) -> dict:
    """The logit lens of tr.clean (the run without interventions), reusing tr's rows where they agree."""
    return logit_lens(tr.clean, k, like=tr)


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
    x = torch.tensor(ids)
    m = torch.zeros(T, T, dtype=torch.bool)
    m[:, 1:] = x[None, :-1] == x[:, None]  # (T, T - 1): column j - 1 holds ids[j - 1] == ids[t]
    return m.tril_()  # j <= t


@torch.no_grad()
def attention_summary(tr) -> dict:
    """Per recorded block and head: mean attention to the previous token, to the first token, and
    (where the text repeats a token) to the token after its earlier occurrence (induction)."""
    layers = [i for i in tr.layers if f"h.{i}.attn.probs" in tr.tensors]
    T = len(tr.ids)
    ind = _induction_mask(tr.ids)
    rows = ind.any(-1)  # queries that have an induction target
    qi, ki = ind.nonzero(as_tuple=True)  # the (query, key) pairs of the mask
    out = {"layers": layers, "prev": [], "first": [], "induction": []}
    for i in layers:
        P = tr[f"h.{i}.attn.probs"].float().cpu()  # (nh, T, T)
        prev = P.diagonal(offset=-1, dim1=1, dim2=2).mean(-1) if T > 1 else torch.zeros(P.shape[0])
        out["prev"].append(prev.tolist())
        out["first"].append(P[:, :, 0].mean(-1).tolist())
        if rows.any():  # each query's attention summed over its induction targets, over the queries that have one
            per_query = P.new_zeros(P.shape[0], T).index_add_(1, qi, P[:, qi, ki])  # (nh, T)
            out["induction"].append(per_query[:, rows].mean(-1).tolist())
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
