"""Prefill and the decode step, the model calls of generation, on the path a decode.path.Kernels says.

The flat loop (_network) is the network written flat for B rows of T new tokens each: no module calls
or dropout, the positions and mask built once, q/k/v as views of the fused c_attn output, each product
an Op of the kernel set (decode.bind: the kernel called with the model's tensors as the set bound
them, resolved once and checked once per step by the Kernels), so a token makes no module attribute
lookups. decode_step (T = 1, a token per row), decode_tokens (a few tokens per row: a speculative
step's verify) and the prefills with a kernel set all run it. It computes what
``model(idx, cache=..., attention_mask=...)`` computes in eval mode: with the plain kernels in float32,
the same ops on the same values (tests prove the logits bit-identical; where only the last positions'
logits are read, the last block runs on those rows alone, equal to rounding); in bfloat16/float16 and with
packed kernels, the same math by other kernels (equal to rounding). With kernels=None (or the forward
path: a model in training mode or with hooks registered) the model's own forward runs, so dropout and
hooks behave as they do everywhere else; prefill given kernels=None takes the path
decode.path.prompt_kernels picks (the flat loop where it applies). A step of one unmasked row may
run whole in C instead (decode.native_step), where the Kernels bound one.

Legend: B rows, T new tokens a row, R = B * T, C n_embd, nh heads, hs head size, P cached tokens, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpt2kit.decode.path import PLAIN, Kernels, prompt_kernels
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2, attention_mask_for, check_inputs


@torch.inference_mode()
def prefill(model: GPT2, idx: torch.Tensor, attention_mask: torch.Tensor | None, cache: KVCache,
            kernels: Kernels | None = None) -> torch.Tensor:
    """Encode idx (B, T) into the cache after the tokens it holds (a prompt in chunks: the engine's
    chunked prefill); logits of the last position (B, V). kernels: a flat path (kernels_for) runs the
    flat loop (logits at the last position only); FORWARD: the model's own forward; None: the path
    decode.path.prompt_kernels picks (the forward for a model in training, with hooks, or not a
    float32 CPU model; else the flat loop, its products of many rows on the kernel decode.dnn chose)."""
    if kernels is None:
        idx = check_inputs(model, idx, attention_mask, cache)  # as the forward would: one clear ValueError
        kernels = prompt_kernels(model)
    if not kernels.forward:
        return _network(model, kernels, idx, cache, attention_mask, [idx.shape[1] - 1] * idx.shape[0])
    return model(idx, attention_mask=attention_mask, cache=cache, last_logits_only=True).logits[:, -1]


def prefill_ragged(model: GPT2, idx: torch.Tensor, last: list[int], cache: KVCache,
                   kernels: Kernels | None = None) -> torch.Tensor:
    """Encode rows of different lengths in one forward: row b's tokens are idx[b, :last[b] + 1],
    right-padded to T (B, T), after the P tokens the cache holds for every row; logits at each row's
    last token (B, V). Causal attention keeps a row's tokens from seeing the padding after them, so
    each row's keys, values and logits are the ones it gets alone; the padding's own keys and values
    land in the cache past the row's length (columns a row never reads before they are rewritten:
    the engine's slots track that). kernels: a flat path runs the flat loop, the final norm and LM
    head at each row's last token only; None (or the forward path): the model's forward (its hooks
    fire, once each), the final norm and head taken at each row's own last position instead of the
    last column."""
    B, T = idx.shape
    if kernels is not None and not kernels.forward:
        return decode_tokens(model, idx, cache, None, kernels, last=last)
    if all(n == T - 1 for n in last):
        return prefill(model, idx, None, cache)
    # The model's own forward, the final norm and head on each row's own last position: the last block's
    # output is caught and handed to ln_f in place of the last column, by hooks that live for this call
    # (ln_f's runs first among its pre-hooks), so every module runs once and its hooks with it.
    rows, cols = torch.arange(B, device=idx.device), torch.tensor(last, device=idx.device)
    caught: list[torch.Tensor] = []
    catch = model.h[-1].register_forward_hook(lambda module, args, out: caught.append(out))
    pick = model.ln_f.register_forward_pre_hook(lambda module, args: (caught[-1][rows, cols][:, None],),
                                                prepend=True)  # (B, 1, C): each row's last position
    try:
        return model(idx, cache=cache, last_logits_only=True).logits[:, -1]  # (B, V)
    finally:
        catch.remove()
        pick.remove()


def decode_step(model: GPT2, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                kernels: Kernels | None = PLAIN, *, head: bool = True) -> torch.Tensor | None:
    """One new token per row: idx (B, 1) at position P = cache.length -> logits (B, V).

    attention_mask (B, P + 1) as in forward, or None. No input checks: for callers whose ids, cache
    and mask are valid by construction (generation). head=False: only the cache is written (a
    speculative draft's last token, whose logits nobody reads), the final norm and LM head skipped;
    returns None (the model's own forward, kernels=None, still computes them). Runs in inference mode."""
    if not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            return decode_step(model, idx, cache, attention_mask, kernels, head=head)
    if kernels is None or kernels.forward:
        logits = model(idx, cache=cache, attention_mask=attention_mask, last_logits_only=True).logits[:, -1]
        return logits if head else None
    return _network(model, kernels, idx, cache, attention_mask, None, head)


def decode_tokens(model: GPT2, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                  kernels: Kernels | None = PLAIN, *, last: list[int] | None = None) -> torch.Tensor:
    """A few new tokens per row (a speculative step's [pending token, drafts...]): idx (B, T) at
    positions from P = cache.length -> logits (B, T, V) at every one of them; with last (B,) only
    at row b's position last[b] -> (B, V) (a prefill: the final norm and LM head on B rows, not B * T).

    The flat loop on B * T rows of products, so checking T drafts costs about one step of the kernel
    set (the weights read once) rather than a spec forward's general products. Attention is causal
    among the T tokens after the cached ones; attention_mask (B, P + T) as in forward (positions
    counted from it). Computes what ``model(idx, cache=..., attention_mask=...)`` computes (equal to
    float rounding; tests/test_model.py). kernels=None: the model's own forward. Runs in inference mode."""
    if not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            return decode_tokens(model, idx, cache, attention_mask, kernels, last=last)
    B, T = idx.shape
    if kernels is None or kernels.forward:
        logits = model(idx, cache=cache, attention_mask=attention_mask).logits
        return logits if last is None else logits[torch.arange(B, device=idx.device),
                                                  torch.tensor(last, device=idx.device)]
    logits = _network(model, kernels, idx, cache, attention_mask, last)
    return logits if last is not None else logits.view(B, T, -1)


def _network(model: GPT2, kernels: Kernels, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None,
             last: list[int] | None, head: bool = True) -> torch.Tensor | None:
    """The flat loop: idx (B, T) -> logits (R, V), or (B, V) at each row's position last[b]; None with
    head=False (the cache written, no final norm or head). In inference mode, the model in eval mode."""
    if model.training:
        raise ValueError("the flat decode loop is for inference: call model.eval() first (it skips dropout)")
    cfg = model.config
    B, T = idx.shape
    R, C, nh, eps, P = B * T, cfg.n_embd, cfg.n_head, cfg.layer_norm_eps, cache.length
    hs, one = C // nh, T == 1
    bound = kernels.bound(model, R, cache.kv)  # the step's one check that the bound tensors are current
    if attention_mask is None and one:
        pos, mask, causal = P, None, False  # one query a row sees every cached key
    else:
        pos, mask, causal = _positions(attention_mask, P, B, T, idx.device)
    ids = idx[:, 0] if one else idx.reshape(R)
    x = (bound.wte[ids] if bound.wte is not None else bound.wte_module(ids)) + bound.wpe[pos]  # (R, C)
    native = kernels.native
    if native is not None and R == 1 and mask is None and head:
        logits = native(x, cache)  # the whole step in C; None where this cache does not fit it
        if logits is not None:
            return logits if logits.shape[-1] == cfg.n_vocab else logits[:, :cfg.n_vocab]  # (1, V)
    layer_norm, sdpa, gelu, shape, cudnn = torch.layer_norm, F.scaled_dot_product_attention, F.gelu, (C,), kernels.cudnn
    # A plain cache (KVCache's layout, each new column written at P alone: `plain`) is written here as
    # its update_kv writes it, a Python call less per block; any other goes through update_kv.
    try:
        kv = cache.kv if cache.plain else None
    except AttributeError:  # a cache that does not say (engine.FirstChunkCache)
        kv = None
    # A prefill reads logits at one position a row: past the last block's keys and values (the cache),
    # only those rows go on (_last_rows), its attention, c_proj and MLP on B rows instead of B * T.
    cut = last is not None and T > 1 and head and bool(bound.blocks)  # (a decode step: no call spent here)
    for i, (ln_1w, ln_1b, attn, proj, ln_2w, ln_2b, fc, mlp) in enumerate(bound.blocks):
        h = layer_norm(x, shape, ln_1w, ln_1b, eps, cudnn)
        qkv = attn.fn(h, *attn.args)  # (R, 3C)
        qkv = qkv.view(B, 3, nh, 1, hs) if one else qkv.view(B, T, 3, nh, hs).permute(0, 2, 3, 1, 4)
        # qkv: (B, 3, nh, T, hs), q, k and v of each head
        if kv is None:
            k, v = cache.update_kv(i, qkv[:, 1:])  # (B, nh, P + T, hs)
        else:
            kv[i, :, :, :, P:P + T] = qkv[:, 1:]
            k, v = kv[i, :, 0, :, :P + T], kv[i, :, 1, :, :P + T]  # (B, nh, P + T, hs)
        q = qkv[:, 0]  # (B, nh, T, hs)
        if cut and i == len(bound.blocks) - 1:
            q, x, mask, causal = _last_rows(q, x, mask, last, P)  # (B, nh, 1, hs), (B, C)
            R, one = B, True
        y = sdpa(q, k, v, attn_mask=mask, is_causal=causal)  # (B, nh, T, hs)
        y = y.view(R, C) if one else y.transpose(1, 2).reshape(R, C)  # (R, C)
        x = proj.fn(y, x, *proj.args) if proj.fused else x + proj.fn(y, *proj.args)  # (R, C)
        h = layer_norm(x, shape, ln_2w, ln_2b, eps, cudnn)
        h = fc.fn(h, *fc.args) if fc.fused else gelu(fc.fn(h, *fc.args), approximate="tanh")  # (R, 4C)
        x = mlp.fn(h, x, *mlp.args) if mlp.fused else x + mlp.fn(h, *mlp.args)  # (R, C)
    cache.length = P + T
    if not head:
        return None
    if last is not None and not cut:  # each row's one position: (B, C)
        x = x.view(B, T, C)[torch.arange(B, device=idx.device), torch.tensor(last, device=idx.device)]
    x = layer_norm(x, shape, bound.ln_f_weight, bound.ln_f_bias, eps, cudnn)
    logits = bound.head.fn(x, *bound.head.args)  # (R, Vp) or (B, Vp): the tied head
    return logits if logits.shape[-1] == cfg.n_vocab else logits[:, :cfg.n_vocab]


def _last_rows(q: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, last: list[int], P: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """The last block's queries and residual rows at row b's position last[b] alone: q (B, nh, T, hs) ->
    (B, nh, 1, hs), x (R, C) -> (B, C); the mask those queries see (B, 1, 1, P + T), or None where each
    is its row's last token and sees every key (mask: the block's, None meaning causal); causal False."""
    B, _, T, _ = q.shape
    rows, at = torch.arange(B, device=q.device), torch.tensor(last, device=q.device)
    q = q[rows, :, at][:, :, None]  # (B, nh, 1, hs)
    x = x.view(B, T, -1)[rows, at]  # (B, C)
    if mask is None and all(n == T - 1 for n in last):
        return q, x, None, False
    S = P + T
    if mask is None:  # causal: query P + last[b] sees keys 0 .. P + last[b]
        seen = torch.arange(S, device=q.device)[None] <= (P + at)[:, None]  # (B, S)
    else:
        seen = mask.expand(B, 1, T, S)[rows, 0, at]  # (B, S): the rows of the block's mask
    return q, x, seen[:, None, None, :], False


def _positions(attention_mask: torch.Tensor | None, P: int, B: int, T: int, device: torch.device
               ) -> tuple[int | torch.Tensor, torch.Tensor | None, bool]:
    """What the flat loop looks positions up by (an int for one unmasked token a row, else (R,)), the
    mask SDPA is given (as forward gives it) and whether attention is causal instead (no mask)."""
    if T == 1:
        pos = (attention_mask.sum(-1) - 1).clamp_(min=0)  # (B,): real tokens before this one
        mask = attention_mask.bool()[:, None, None, :].clone()  # (B, 1, 1, P + 1)
        mask[..., P] = True  # the query sees itself even when its slot is padding (no NaN)
        return pos, mask, False
    if attention_mask is None:
        pos = torch.arange(P, P + T, device=device).expand(B, T)  # (B, T)
    else:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)[:, P:]  # (B, T), as forward counts them
    mask = attention_mask_for(attention_mask, P, T, device)  # what forward gives SDPA
    causal = isinstance(mask, str)
    return pos.reshape(B * T), None if causal else mask, causal
