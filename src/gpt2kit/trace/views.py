"""Views derived from a Trace: next-token statistics, logit lens, direct logit attribution,
residual norms, attention-head summaries.

Each view reuses the network's own modules (ln_f, the tied head wte, attn.c_proj) on recorded
tensors; nothing here re-implements a block. Legend: T tokens, C n_embd, nh heads, hs head size,
L layers, V vocab, K top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LN2 = math.log(2.0)


def unembed(model, x: torch.Tensor) -> torch.Tensor:
    """The tied LM head: x (..., C) -> logits (..., V) (GPT-2 has no output bias)."""
    return F.linear(x, model.wte.weight[: model.config.n_vocab])


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


@torch.no_grad()
def logit_lens(tr, k: int = 5) -> dict:
    """Per recorded residual layer x position: top-k tokens and probabilities; the probability and
    rank of the actual next token (positions 0..T-2)."""
    layers = lens_layers(tr)
    nxt = _next_ids(tr)
    top_ids, top_probs, next_prob, next_rank = [], [], [], []
    for layer in layers:  # one (T, V) at a time: gpt2-xl at 1024 tokens would not fit all at once
        logits = lens_logits(tr, layer).float()
        probs = torch.softmax(logits, dim=-1)
        p, i = probs.topk(min(k, probs.shape[-1]), dim=-1)  # (T, K)
        top_ids.append(i.tolist())
        top_probs.append(p.tolist())
        next_prob.append(probs[:-1].gather(-1, nxt[:, None])[:, 0].tolist())
        next_rank.append(_rank(logits[:-1], nxt).tolist())
    return {"layers": layers, "top_ids": top_ids, "top_probs": top_probs, "next_prob": next_prob,
            "next_rank": next_rank}


def dla_targets(tr) -> list[int]:
    """The token each position's attribution explains: the actual next token, or the top-1 at the end."""
    return [*tr.ids[1:], int(tr.logits[-1].argmax())]


@torch.no_grad()
def dla_components(tr) -> tuple[list[str], torch.Tensor]:
    """The residual stream H^(L) split into the pieces that were added to it: labels and (n, T, C).

    embed.tok + embed.pos + sum_i (sum_h head_h + attn bias + mlp) = H^(L), up to rounding; a head's
    piece is its weighted values z_h through its slice of attn.c_proj.
    """
    L, nh = tr.config.n_layer, tr.config.n_head
    need = ["embed.tok", "embed.pos"] + [f"h.{i}.{s}" for i in range(L) for s in ("attn.z", "mlp.out")]
    missing = [n for n in need if n not in tr.tensors]
    if missing:
        raise ValueError(f"direct logit attribution needs every block's attn.z and mlp.out and the embeddings; "
                         f"{missing[0]!r} was not recorded (trace with layers='all' and what including "
                         "embed, z, mlp_out)")
    labels, parts = ["embed.tok", "embed.pos"], [tr["embed.tok"].double(), tr["embed.pos"].double()]
    for i in range(L):
        proj = tr.model.h[i].attn.c_proj
        W = proj.weight.double()  # (C, C): out x in, the input being the heads' z side by side
        z = tr[f"h.{i}.attn.z"].double()  # (nh, T, hs)
        hs = z.shape[-1]
        for h in range(nh):
            labels.append(f"h.{i}.attn.head.{h}")
            parts.append(z[h] @ W[:, h * hs:(h + 1) * hs].T)  # (T, C)
        labels.append(f"h.{i}.attn.bias")
        parts.append(proj.bias.double().expand_as(parts[0]))
        labels.append(f"h.{i}.mlp")
        parts.append(tr[f"h.{i}.mlp.out"].double())
    return labels, torch.stack(parts)  # (n, T, C)


@torch.no_grad()
def direct_logit_attribution(tr, position: int | None = None, token: int | None = None) -> dict:
    """How much each component adds to the logit of `token` at `position` through ln_f.

    ln_f(x) = (x - mean(x)) / sigma * g + b, with sigma the final residual's own (fixed), so
    logit = sum_c (c - mean(c)) / sigma . (g * wte[token]) + b . wte[token]: each component's term
    is linear in it, and the terms sum to the logit (within float rounding).
    position: default every position (-1 counts from the end); token: default the actual next
    token (the top-1 prediction at the last position).
    """
    T = len(tr.ids)
    labels, parts = dla_components(tr)  # (n, T, C)
    ln = tr.model.ln_f
    x = tr[f"resid.{tr.config.n_layer}"].double()  # (T, C)
    sigma = torch.sqrt(x.var(-1, unbiased=False) + ln.eps)  # (T,)
    targets = dla_targets(tr) if token is None else [token] * T
    W_U = tr.model.wte.weight[torch.tensor(targets)].double()  # (T, C)
    direction = ln.weight.double() * W_U  # (T, C)
    centred = parts - parts.mean(-1, keepdim=True)  # (n, T, C)
    values = (centred * direction).sum(-1) / sigma  # (n, T)
    values = torch.cat([values, (ln.bias.double() * W_U).sum(-1)[None]])  # + ln_f.bias term
    labels = [*labels, "ln_f.bias"]
    logit = tr.logits.double().gather(-1, torch.tensor(targets)[:, None])[:, 0]  # (T,)
    if position is not None:
        if not -T <= position < T:
            raise ValueError(f"position {position} is outside the input's {T} tokens")
        pos = position % T
        return {"position": pos, "token": targets[pos], "labels": labels, "values": values[:, pos].tolist(),
                "logit": float(logit[pos])}
    return {"tokens": targets, "labels": labels, "values": values.T.tolist(), "logit": logit.tolist()}


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
