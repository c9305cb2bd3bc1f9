"""The forward pass of an int8-quantized GPT2, every layer called as a module.

The same computation as GPT2.forward in eval mode (openai/gpt-2's graph), with the matrices and
the tied LM head computed by their modules (QuantLinear, QuantEmbedding, or the float ones), so
the int8 products run wherever a matrix was swapped. One function serves prefill (T tokens into an
empty KVCache), the one-token decode step (T = 1 at cache.length) and scoring (no cache).

Why it exists beside model.py: the model's forward and decode_step read `layer.weight` directly
for their float kernels (and the LM head as ``wte.weight``), so a swapped module's int8 weight
would reach a float kernel. This path is proven equal to the spec by tests/test_quant.py (on the
dequantized weights, to float rounding).

Legend: B batch, T new tokens, P cached tokens, S = P + T, C n_embd, nh heads, hs head size, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gpt2kit.kv_cache import KVCache
from gpt2kit.quant import lm_head_logits


def _causal_mask(attention_mask: torch.Tensor | None, P: int, T: int, device: torch.device):
    """None (no mask needed), "causal" (SDPA's is_causal) or a boolean mask (B|1, 1, T, S), as the spec builds it."""
    if attention_mask is None:
        if T == 1:
            return None
        if P == 0:
            return "causal"
    S = P + T
    allowed = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=P)  # (T, S)
    if attention_mask is None:
        return allowed
    allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    diag = torch.zeros(T, S, dtype=torch.bool, device=device)
    diag[:, P:] = torch.eye(T, dtype=torch.bool, device=device)  # a padding query sees itself (no NaN)
    return allowed | diag


@torch.inference_mode()
def forward(model, idx: torch.Tensor, *, cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
            last_logits_only: bool = False) -> torch.Tensor:
    """Logits (B, T, V) (or (B, 1, V) with last_logits_only) for ids idx (B, T) after cache.length
    cached tokens; attention_mask (B, P + T) as in GPT2.forward. Writes the cache and advances it."""
    cfg = model.config
    B, T = idx.shape
    C, nh = cfg.n_embd, cfg.n_head
    hs = C // nh
    P = cache.length if cache is not None else 0
    if attention_mask is None:
        pos = torch.arange(P, P + T, device=idx.device)  # (T,)
    else:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)[:, P:]  # (B, T)
    x = model.wte(idx) + model.wpe(pos)  # (B, T, C)
    mask = _causal_mask(attention_mask, P, T, idx.device)
    for i, block in enumerate(model.h):
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(i, k, v)  # (B, nh, S, hs)
        if isinstance(mask, str):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        h = F.gelu(block.mlp.c_fc(block.ln_2(x)), approximate="tanh")  # (B, T, 4C)
        x = x + block.mlp.c_proj(h)
    if cache is not None:
        cache.length = P + T
    if last_logits_only:
        x = x[:, -1:]
    return lm_head_logits(model, model.ln_f(x))  # (B, T, V)


@torch.inference_mode()
def quality(float_model, quant_model, windows: torch.Tensor) -> dict[str, float]:
    """How much quantization changes the model on held-out text windows (N, T) of token ids:
    perplexity of each model (next-token, every position of every window), its relative rise, the
    share of positions whose greedy next token (argmax) is the same, and the mean per-position
    KL(float || quantized) in nats."""
    nll = {"float": 0.0, "int8": 0.0}
    agree = kl = n = 0
    for w in windows:
        ids = w[None]  # (1, T)
        lp_f = torch.log_softmax(float_model(ids).logits.float(), -1)[0, :-1]  # (T - 1, V)
        lp_q = torch.log_softmax(forward(quant_model, ids).float(), -1)[0, :-1]
        targets = w[1:, None]
        nll["float"] -= lp_f.gather(-1, targets).sum().item()
        nll["int8"] -= lp_q.gather(-1, targets).sum().item()
        agree += (lp_f.argmax(-1) == lp_q.argmax(-1)).sum().item()
        kl += (lp_f.exp() * (lp_f - lp_q)).sum().item()
        n += len(targets)
    ppl_f, ppl_q = math.exp(nll["float"] / n), math.exp(nll["int8"] / n)
    return {"ppl_float": ppl_f, "ppl_int8": ppl_q, "ppl_rise": ppl_q / ppl_f - 1, "agree": agree / n,
            "kl_mean": kl / n, "positions": n}
