"""Prefill and the one-token decode step, the two model calls of generation.

decode_step is the network's step written flat for one new token per row: no module calls or
dropout, the mask and positions built once, q/k/v as views of the fused c_attn output, the products
by a kernel set (decode.kernels' plain ones, or decode.packed's prepacked ones). It computes what
``model(idx, cache=..., attention_mask=..., last_logits_only=True)`` computes in eval mode: with the
plain kernels in float32, the same ops on the same values (tests prove the logits bit-identical);
in bfloat16/float16 and with packed kernels, the same math by other kernels (equal to rounding).
With kernels=None it runs the model's own forward: what generation uses for a model in training
mode or with hooks registered, so dropout and hooks behave as they do everywhere else.

Legend: B rows, C n_embd, nh heads, hs head size, P cached tokens, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from gpt2kit.decode.kernels import PLAIN, PlainKernels, choose_half_kernels
from gpt2kit.decode.packed import PackedWeights, packed_weights
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2

Kernels = PlainKernels | PackedWeights


@torch.inference_mode()
def prefill(model: GPT2, idx: torch.Tensor, attention_mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
    """Encode idx (B, T) into an empty cache; logits of the last position (B, V)."""
    assert cache.length == 0
    return model(idx, attention_mask=attention_mask, cache=cache, last_logits_only=True).logits[:, -1]


def kernels_for(model: GPT2, batch_size: int, pack: bool | None = None) -> Kernels | None:
    """The kernel set for decode steps of batch_size rows: None (the model's own forward) when the
    model is training or has hooks, else the packed matrices where packing applies (pack=None:
    where it is faster and the copy fits; gpt2kit.decode.packed), else the plain kernels."""
    if model.training or _has_hooks(model):
        return None
    choose_half_kernels(_largest_matrix(model))
    return packed_weights(model, batch_size, pack) or PLAIN


@torch.inference_mode()
def decode_step(model: GPT2, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                kernels: Kernels | None = PLAIN) -> torch.Tensor:
    """One new token per row: idx (B, 1) at position P = cache.length -> logits (B, V).

    attention_mask (B, P + 1) as in forward, or None. No input checks: for callers whose ids, cache
    and mask are valid by construction (generation)."""
    if kernels is None:
        return model(idx, cache=cache, attention_mask=attention_mask, last_logits_only=True).logits[:, -1]
    if model.training:
        raise ValueError("decode_step with kernels is for inference: call model.eval() first (it skips dropout)")
    cfg = model.config
    B, C, nh, eps = idx.shape[0], cfg.n_embd, cfg.n_head, cfg.layer_norm_eps
    hs = C // nh
    P = cache.length
    if attention_mask is None:
        pos, mask = P, None
    else:
        pos = (attention_mask.sum(-1) - 1).clamp_(min=0)  # (B,): real tokens before this one
        mask = attention_mask.bool()[:, None, None, :].clone()  # (B, 1, 1, P + 1)
        mask[..., P] = True  # the query sees itself even when its slot is padding (no NaN)
    x = F.embedding(idx[:, 0], model.wte.weight) + model.wpe.weight[pos]  # (B, C)
    k_set = kernels if kernels.covers(B, x.dtype) else PLAIN
    for i, block in enumerate(model.h):
        attn, mlp = block.attn, block.mlp
        h = F.layer_norm(x, (C,), block.ln_1.weight, block.ln_1.bias, eps)
        qkv = k_set.linear(h, attn.c_attn).view(B, 3, nh, 1, hs)  # q, k, v of each head
        k, v = cache.update_kv(i, qkv[:, 1:])  # (B, nh, P + 1, hs)
        y = F.scaled_dot_product_attention(qkv[:, 0], k, v, attn_mask=mask)  # (B, nh, 1, hs)
        x = k_set.linear_add(y.view(B, C), attn.c_proj, x)  # (B, C)
        h = F.layer_norm(x, (C,), block.ln_2.weight, block.ln_2.bias, eps)
        x = k_set.linear_add(k_set.linear_gelu(h, mlp.c_fc), mlp.c_proj, x)  # (B, C)
    cache.length = P + 1
    x = F.layer_norm(x, (C,), model.ln_f.weight, model.ln_f.bias, eps)
    return k_set.lm_head(x, model.wte.weight, cfg.n_vocab)  # (B, V): tied LM head


def _has_hooks(model: nn.Module) -> bool:
    """Whether any forward hook would fire in the model's forward (the flat step would skip it)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())


def _largest_matrix(model: GPT2) -> torch.Tensor:
    fc = model.h[0].mlp.c_fc
    return fc.weight if type(fc) is nn.Linear else model.wte.weight
