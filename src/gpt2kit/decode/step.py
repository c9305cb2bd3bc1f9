"""Prefill and the one-token decode step, the two model calls of generation.

decode_step is the network's step written flat for one new token per row: no module calls or
dropout, the mask and positions built once, q/k/v as views of the fused c_attn output, the products
by a kernel set (decode.kernels' plain ones, or decode.packed's prepacked ones), on the model's
tensors as the kernel set bound them (decode.bind: resolved once, checked each step with plain dict
reads, re-bound when the model changed), so a token makes no module attribute lookups. It computes what
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

import gpt2kit.decode.f32 as f32
import gpt2kit.decode.native_step as native_step
from gpt2kit.decode.kernels import PLAIN, PlainKernels, choose_half_kernels
from gpt2kit.decode.packed import PackedWeights, packed_weights
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2, attention_mask_for

Kernels = PlainKernels | PackedWeights


@torch.inference_mode()
def prefill(model: GPT2, idx: torch.Tensor, attention_mask: torch.Tensor | None, cache: KVCache,
            kernels: Kernels | None = None) -> torch.Tensor:
    """Encode idx (B, T) into the cache after the tokens it holds (a prompt in chunks: the engine's
    chunked prefill); logits of the last position (B, V). kernels: a kernel set (kernels_for) runs
    the flat network on it (decode_tokens, logits at the last position only); None: the model's
    own forward."""
    if kernels is not None:
        return decode_tokens(model, idx, cache, attention_mask, kernels, last=[idx.shape[1] - 1] * idx.shape[0])
    return model(idx, attention_mask=attention_mask, cache=cache, last_logits_only=True).logits[:, -1]


def prefill_ragged(model: GPT2, idx: torch.Tensor, last: list[int], cache: KVCache,
                   kernels: Kernels | None = None) -> torch.Tensor:
    """Encode rows of different lengths in one forward: row b's tokens are idx[b, :last[b] + 1],
    right-padded to T (B, T), after the P tokens the cache holds for every row; logits at each row's
    last token (B, V). Causal attention keeps a row's tokens from seeing the padding after them, so
    each row's keys, values and logits are the ones it gets alone; the padding's own keys and values
    land in the cache past the row's length (columns a row never reads before they are rewritten:
    the engine's slots track that). kernels: the flat network on that kernel set (decode_tokens,
    the LM head at each row's last token only), e.g. prepacked matrices; None: the same modules as
    the model's forward (hooks on them fire), only the logits taken at each row's own last position
    instead of the last column; rows of one length go through the model's forward itself (prefill)."""
    B, T = idx.shape
    if kernels is not None:
        return decode_tokens(model, idx, cache, None, kernels, last=last)
    if all(n == T - 1 for n in last):
        return prefill(model, idx, None, cache)
    P = cache.length
    x = model.drop(model.wte(idx) + model.wpe(torch.arange(P, P + T, device=idx.device)))  # (B, T, C)
    mask = attention_mask_for(None, P, T, idx.device)
    for i, block in enumerate(model.h):
        x = block(x, mask, cache, i)
    cache.length = P + T
    x = x[torch.arange(B, device=idx.device), torch.tensor(last, device=idx.device)]  # (B, C)
    return model.lm_head(model.ln_f(x))  # (B, V)


def kernels_for(model: GPT2, batch_size: int, pack: bool | None = None) -> Kernels | None:
    """The kernel set for decode steps of batch_size rows: None (the model's own forward) when the
    model is training or has hooks, else the packed matrices where packing applies (pack=None:
    where it is faster and the copy fits; gpt2kit.decode.packed), else the plain kernels. The set
    keeps the model's tensors bound between steps (re-bound when one is replaced: decode.bind)."""
    if model.training or _has_hooks(model):
        return None
    largest = _largest_matrix(model)
    if largest is not None:
        choose_half_kernels(largest)
    k_set = packed_weights(model, batch_size, pack) or PlainKernels()  # one per generation: it keeps the binding
    k_set.use_f32(f32_kernel(model))  # single float32 rows (a batch of 1, or one finished down to 1)
    return k_set


F32_MIN_BYTES = 64 << 20  # smaller models' matrices stay in cache: no single-row choice is made for them


def f32_kernel(model: GPT2) -> str:
    """The kernel single float32 rows of this model run on (decode.f32): GPT2KIT_F32_KERNEL when set;
    else, for a CPU float32 model in the decode layout whose matrices are F32_MIN_BYTES or more, the
    choice decode.f32 makes (stored per machine and model shape; measured on the model's own matrices);
    else "torch"."""
    forced = f32.forced()  # the override, checked (ValueError naming the choices)
    if forced is not None:
        return forced
    mats = _f32_matrices(model)
    if not mats or sum(w.numel() * 4 for w, _ in mats) < F32_MIN_BYTES:
        return "torch"
    cfg = model.config
    shape = f"{cfg.n_embd}x{cfg.n_layer}x{model.wte.weight.shape[0]}"
    kernel = f32.chosen_kernel(shape)
    return kernel if kernel is not None else f32.decide_for(shape, mats).kernel


def _f32_matrices(model: GPT2) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of a single-row step's products in order, the tied head last, where every one
    is a plain float32 CPU nn.Linear in the decode layout (stored (in, out)); [] otherwise."""
    if type(model.wte) is not nn.Embedding:
        return []
    mats = []
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if type(layer) is not nn.Linear:
                return []
            mats.append((layer.weight, layer.bias))
    mats.append((model.wte.weight, None))
    ok = all(w.dtype == torch.float32 and w.is_cpu and w.stride(0) == 1 for w, _ in mats)
    return mats if ok else []


@torch.inference_mode()
def decode_step(model: GPT2, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                kernels: Kernels | None = PLAIN, *, head: bool = True) -> torch.Tensor | None:
    """One new token per row: idx (B, 1) at position P = cache.length -> logits (B, V).

    attention_mask (B, P + 1) as in forward, or None. No input checks: for callers whose ids, cache
    and mask are valid by construction (generation). head=False: only the cache is written (a
    speculative draft's last token, whose logits nobody reads), the final norm and LM head skipped;
    returns None (the model's own forward, kernels=None, still computes them)."""
    if kernels is None:
        logits = model(idx, cache=cache, attention_mask=attention_mask, last_logits_only=True).logits[:, -1]
        return logits if head else None
    if model.training:
        raise ValueError("decode_step with kernels is for inference: call model.eval() first (it skips dropout)")
    cfg = model.config
    B, C, nh, eps = idx.shape[0], cfg.n_embd, cfg.n_head, cfg.layer_norm_eps
    hs = C // nh
    P = cache.length
    k_set = kernels.for_step(B, cache.kv.dtype, cache.kv.is_cpu)
    bound = k_set.bind(model)  # the tensors, resolved once per kernel set (decode.bind)
    if attention_mask is None:
        pos, mask = P, None
    else:
        pos = (attention_mask.sum(-1) - 1).clamp_(min=0)  # (B,): real tokens before this one
        mask = attention_mask.bool()[:, None, None, :].clone()  # (B, 1, 1, P + 1)
        mask[..., P] = True  # the query sees itself even when its slot is padding (no NaN)
    # a swapped wte (int8 rows) looks its rows up
    tok = F.embedding(idx[:, 0], bound.wte) if bound.wte is not None else bound.wte_module(idx[:, 0])
    x = tok + bound.wpe[pos]  # (B, C)
    if B == 1 and mask is None and head and getattr(k_set, "keeps_binding", False):
        native = native_step.for_binding(model, bound, k_set.f32_kernel)  # the whole step in C, where it applies
        logits = native(x, cache) if native is not None else None
        if logits is not None:
            return logits if logits.shape[-1] == cfg.n_vocab else logits[:, :cfg.n_vocab]  # (1, V)
    cudnn = torch.backends.cudnn.enabled  # what F.layer_norm passes, read once
    for i, (ln_1w, ln_1b, c_attn, attn_proj, ln_2w, ln_2b, c_fc, mlp_proj) in enumerate(bound.blocks):
        h = torch.layer_norm(x, (C,), ln_1w, ln_1b, eps, cudnn)
        qkv = k_set.linear(h, c_attn).view(B, 3, nh, 1, hs)  # q, k, v of each head
        k, v = cache.update_kv(i, qkv[:, 1:])  # (B, nh, P + 1, hs)
        y = F.scaled_dot_product_attention(qkv[:, 0], k, v, attn_mask=mask)  # (B, nh, 1, hs)
        x = k_set.linear_add(y.view(B, C), attn_proj, x)  # (B, C)
        h = torch.layer_norm(x, (C,), ln_2w, ln_2b, eps, cudnn)
        x = k_set.linear_add(k_set.linear_gelu(h, c_fc), mlp_proj, x)  # (B, C)
    cache.length = P + 1
    if not head:
        return None
    x = torch.layer_norm(x, (C,), bound.ln_f_weight, bound.ln_f_bias, eps, cudnn)
    if bound.head is None:
        return model.lm_head(x)  # (B, V): the swapped embedding's own product (gpt2kit.quant.modules)
    return k_set.lm_head(x, bound.head, cfg.n_vocab)  # (B, V): tied LM head


@torch.inference_mode()
def decode_tokens(model: GPT2, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                  kernels: Kernels | None = PLAIN, *, last: list[int] | None = None) -> torch.Tensor:
    """A few new tokens per row (a speculative step's [pending token, drafts...]): idx (B, T) at
    positions from P = cache.length -> logits (B, T, V) at every one of them; with last (B,) only
    at row b's position last[b] -> (B, V) (a prefill: the final norm and LM head on B rows, not B * T).

    decode_step's flat network on B * T rows of products, so checking T drafts costs about one
    step of the kernel set (the weights read once) rather than a spec forward's general products.
    Attention is causal among the T tokens after the cached ones; attention_mask (B, P + T) as in
    forward (positions counted from it). Computes what ``model(idx, cache=..., attention_mask=...)``
    computes (equal to float rounding; tests/test_model.py). kernels=None: the model's own forward."""
    B, T = idx.shape
    if kernels is None:
        logits = model(idx, cache=cache, attention_mask=attention_mask).logits
        return logits if last is None else logits[torch.arange(B, device=idx.device),
                                                  torch.tensor(last, device=idx.device)]
    if T == 1:
        logits = decode_step(model, idx, cache, attention_mask, kernels)  # (B, V)
        return logits if last is not None else logits[:, None]  # (B, V) or (B, 1, V)
    if model.training:
        raise ValueError("decode_tokens with kernels is for inference: call model.eval() first (it skips dropout)")
    cfg = model.config
    C, nh, eps, R = cfg.n_embd, cfg.n_head, cfg.layer_norm_eps, B * T
    hs, P = C // nh, cache.length
    k_set = kernels.for_step(R, cache.kv.dtype, cache.kv.is_cpu)
    bound = k_set.bind(model)
    if attention_mask is None:
        pos = torch.arange(P, P + T, device=idx.device).expand(B, T)  # (B, T)
    else:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)[:, P:]  # (B, T), as forward counts them
    mask = attention_mask_for(attention_mask, P, T, idx.device)  # what forward gives SDPA
    causal = isinstance(mask, str)
    ids = idx.reshape(R)
    tok = F.embedding(ids, bound.wte) if bound.wte is not None else bound.wte_module(ids)
    x = tok + bound.wpe[pos.reshape(R)]  # (R, C)
    cudnn = torch.backends.cudnn.enabled
    for i, (ln_1w, ln_1b, c_attn, attn_proj, ln_2w, ln_2b, c_fc, mlp_proj) in enumerate(bound.blocks):
        h = torch.layer_norm(x, (C,), ln_1w, ln_1b, eps, cudnn)
        qkv = k_set.linear(h, c_attn).view(B, T, 3, nh, hs).permute(0, 2, 3, 1, 4)  # (B, 3, nh, T, hs)
        k, v = cache.update_kv(i, qkv[:, 1:])  # (B, nh, P + T, hs)
        y = F.scaled_dot_product_attention(qkv[:, 0], k, v, attn_mask=None if causal else mask,
                                           is_causal=causal)  # (B, nh, T, hs)
        x = k_set.linear_add(y.transpose(1, 2).reshape(R, C), attn_proj, x)  # (R, C)
        h = torch.layer_norm(x, (C,), ln_2w, ln_2b, eps, cudnn)
        x = k_set.linear_add(k_set.linear_gelu(h, c_fc), mlp_proj, x)  # (R, C)
    cache.length = P + T
    if last is not None:  # each row's one position: (B, C)
        x = x.view(B, T, C)[torch.arange(B, device=idx.device), torch.tensor(last, device=idx.device)]
    x = torch.layer_norm(x, (C,), bound.ln_f_weight, bound.ln_f_bias, eps, cudnn)
    logits = model.lm_head(x) if bound.head is None else k_set.lm_head(x, bound.head, cfg.n_vocab)  # (R, V)
    return logits if last is not None else logits.view(B, T, -1)


def _has_hooks(model: nn.Module) -> bool:
    """Whether any forward hook would fire in the model's forward (the flat step would skip it)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())


def _largest_matrix(model: GPT2) -> torch.Tensor | None:
    """A float matrix to measure the half-precision kernels on (None when all are swapped, e.g. int8)."""
    fc = model.h[0].mlp.c_fc
    if type(fc) is nn.Linear:
        return fc.weight
    return model.wte.weight if type(model.wte) is nn.Embedding else None
