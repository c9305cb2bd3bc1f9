"""The GPT-2 network, as openai/gpt-2's src/model.py builds it. This file is the spec.

    H^(0) = wte[X] + wpe[pos]                         token + learned position embeddings
    for each block l = 1..L (pre-norm):
        A  = attn(ln_1(H))                            fused c_attn -> q, k, v; softmax(q k^T / sqrt(hs)
                                                      + causal mask) v per head; heads merged -> c_proj
        H' = H + A                                    residual
        M  = mlp(ln_2(H'))                            c_fc -> tanh-GELU -> c_proj
        H^(l) = H' + M                                residual
    logits = ln_f(H^(L)) wte^T                        tied LM head, no bias

Positions are offset by the cache length (or counted from the attention mask when rows are padded),
so a sequence fed in pieces gives the logits of one pass. Parameter names are GPT-2's own (wte, wpe,
h.{i}.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f), so a checkpoint loads by a
rename and a transpose (checkpoint/keymap.py). Every submodule is called as a module, so forward hooks
and module swaps (a quantized linear, an adapter) see and change what runs. The fast CPU decode step
lives beside this file in gpt2kit/decode/, proven equal to it by tests.

Legend: B batch, T new tokens, P cached (past) tokens, S = P + T keys, C n_embd, nh heads,
hs head size, L layers, V vocab, Vp padded vocab (embedding rows).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kit.config import GPT2Config
from gpt2kit.kv_cache import KVCache

# Passed as the attention mask when the plain causal mask applies (no cache, no padding), so
# SDPA can use its is_causal fast path instead of a materialised (T, S) mask.
CAUSAL = "causal"


@runtime_checkable
class HeadEmbedding(Protocol):
    """A token embedding that runs the tied LM head's product itself: lm_head(x (..., C)) -> (..., Vp).
    int8 rows (gpt2kit.quant.modules.QuantEmbedding) and trained rows (gpt2kit.lora.TrainableTokens)
    are; GPT2.lm_head asks a wte of this shape (checked structurally) for the product."""

    def lm_head(self, x: torch.Tensor) -> torch.Tensor: ...


class GPT2Output(NamedTuple):
    logits: torch.Tensor  # (B, T, V), or (B, 1, V) with last_logits_only
    present: torch.Tensor | None = None  # (B, L, 2, nh, S, hs), when use_cache or past was given
    loss: torch.Tensor | None = None  # mean next-token cross-entropy, when targets were given


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one product
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | str | None, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs): the cached keys and values, then these
        # softmax(q k^T / sqrt(hs) + mask) v, per head
        dropout_p = self.dropout if self.training else 0.0
        if isinstance(mask, str):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        # GPT-2's gelu is the tanh approximation, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))).
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | str | None, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache, layer)  # H' = H + A
        x = x + self.mlp(self.ln_2(x))  # H^(l) = H' + M
        return x


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.embedding_rows, config.n_embd)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, N(0, 0.01) positions (OpenAI's code), zero
        biases, unit LayerNorm gains, residual projections scaled by 1/sqrt(2 * n_layer) (the paper)."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.startswith("wpe."):
                nn.init.normal_(p, std=0.01)
            elif ".ln_" in name or name.startswith("ln_f."):
                nn.init.ones_(p) if name.endswith(".weight") else nn.init.zeros_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=resid_std)
            else:
                nn.init.normal_(p, std=0.02)
        self.wte.weight[self.config.n_vocab:].zero_()  # padded rows are never produced

    @classmethod
    def from_name(cls, name: str, **overrides) -> GPT2:
        """A randomly initialised model of a preset's size (checkpoints: gpt2kit.load_model)."""
        return cls(GPT2Config.from_name(name, **overrides))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, *, past: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                use_cache: bool = False, cache: KVCache | None = None,
                last_logits_only: bool = False, ignore_index: int = -100) -> GPT2Output:
        """Logits for token ids idx (B, T).

        past: the official stacked cache (B, L, 2, nh, P, hs) of earlier tokens; present (returned
            when past is given or use_cache) holds past plus this call's keys and values.
        cache: alternatively, a preallocated KVCache written in place (generation uses this).
        attention_mask: (B, P + T), 1 for real tokens and 0 for padding; positions are counted
            from it, so a left-padded row gives the logits of the same row unpadded.
        targets: (B, T) next-token ids; gives the mean cross-entropy, skipping ignore_index.
        """
        idx, P = _check_inputs(self, idx, past, attention_mask, targets, cache, ignore_index)
        B, T = idx.shape
        if past is not None:
            cache = KVCache.from_present(past, max_len=P + T)  # the official API, on the one cache form
        elif use_cache and cache is None:
            cache = KVCache.for_model(self, B, T)

        if attention_mask is None:
            pos = torch.arange(P, P + T, device=idx.device)  # (T,)
        else:
            # Count only real tokens, so padding does not shift the positions of what follows.
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)[:, P:]  # (B, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C): H^(0)
        mask = attention_mask_for(attention_mask, P, T, idx.device)
        for i, block in enumerate(self.h):
            x = block(x, mask, cache, i)  # (B, T, C): H^(i+1)
        if cache is not None:
            cache.length = P + T
        if last_logits_only:
            x = x[:, -1:]  # (B, 1, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).long(),
                                   ignore_index=ignore_index)
        present = cache.to_present() if use_cache or past is not None else None  # (B, L, 2, nh, S, hs)
        return GPT2Output(logits, present, loss)

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[GPT2]:
        """`with model.disable_adapter():` the base model (peft's disable_adapter): every swapped-in
        module with an adapter (gpt2kit.lora) off in the block, merged ones unmerged and merged
        again after. Biases an adapter trained (bias "all" / "lora_only") are the model's own and stay."""
        with contextlib.ExitStack() as stack:
            for m in self.modules():
                if hasattr(m, "adapter_off"):
                    stack.enter_context(m.adapter_off())
            yield self

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """The tied head: x (..., C) @ wte^T -> logits (..., V). With a padded vocabulary the product
        runs on all Vp rows (the faster shape) and the padding columns are cut from its result. A
        swapped-in wte that computes the product itself (a HeadEmbedding) is asked for it."""
        wte = self.wte
        own = type(wte) is not nn.Embedding and isinstance(wte, HeadEmbedding)
        logits = wte.lm_head(x) if own else F.linear(x, wte.weight)  # (..., Vp)
        V = self.config.n_vocab
        return logits if logits.shape[-1] == V else logits[..., :V]


def attention_mask_for(attention_mask: torch.Tensor | None, P: int, T: int,
                       device: torch.device) -> torch.Tensor | str | None:
    """What SDPA is given: CAUSAL (no cache, no padding), None (one new query sees every cached key),
    or a boolean mask (T, S) / (B, 1, T, S) where True means "may attend"."""
    if attention_mask is None:
        if T == 1:
            return None
        if P == 0:
            return CAUSAL
    S = P + T
    # Query i (absolute position P + i) may see keys 0 .. P + i.
    allowed = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=P)  # (T, S)
    if attention_mask is None:
        return allowed
    allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    # A padding query would see no key at all (softmax of nothing is NaN); let it see itself.
    diag = torch.zeros(T, S, dtype=torch.bool, device=device)
    diag[:, P:] = torch.eye(T, dtype=torch.bool, device=device)
    return allowed | diag


def check_inputs(model: GPT2, idx: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 cache: KVCache | None = None) -> torch.Tensor:
    """forward's checks of idx, attention_mask and cache (a ValueError naming what is wrong), for a
    caller that runs the network another way (decode.prefill); idx as int64 (or int32) ids."""
    return _check_inputs(model, idx, None, attention_mask, None, cache, -100)[0]


def _check_inputs(model: GPT2, idx: torch.Tensor, past: torch.Tensor | None, attention_mask: torch.Tensor | None,
                  targets: torch.Tensor | None, cache: KVCache | None, ignore_index: int) -> tuple[torch.Tensor, int]:
    """Validate forward's inputs; returns idx as int64 (or int32) ids and P, the cached length.

    Shapes and dtypes are always checked. Values (id ranges, mask values, targets) are read only
    where that costs no device sync: on CPU tensors, outside torch.compile. Training data is checked
    when its shards load, generation and scoring check their prompts on the host."""
    cfg = model.config
    values = isinstance(idx, torch.Tensor) and idx.device.type == "cpu" and not torch.compiler.is_compiling()
    idx = _check_ids(idx, cfg.n_vocab, values)
    B, T = idx.shape
    P = _cached_length(model, B, T, past, cache)
    if attention_mask is not None:
        _check_mask(attention_mask, B, P + T, values)
    if targets is not None:
        _check_targets(targets, B, T, cfg.n_vocab, ignore_index, values)
    return idx, P


def _check_ids(idx: torch.Tensor, n_vocab: int, values: bool) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        raise ValueError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
    if idx.dtype not in (torch.int64, torch.int32):
        idx = idx.long()  # uint8/int16/... ids: the embedding takes int64 or int32
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(f"idx must hold at least one token, got shape {tuple(idx.shape)}")
    if values:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n_vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
    return idx


def _cached_length(model: GPT2, B: int, T: int, past: torch.Tensor | None, cache: KVCache | None) -> int:
    """P, the length already cached in past or cache, checked against both and the context."""
    cfg = model.config
    if past is not None and cache is not None:
        raise ValueError("pass either past or cache, not both")
    P = 0
    if past is not None:
        want = (B, cfg.n_layer, 2, cfg.n_head, past.shape[-2] if past.dim() == 6 else -1, cfg.head_dim)
        if past.dim() != 6 or tuple(past.shape) != want:
            raise ValueError(f"past must have shape (B, L, 2, nh, P, hs) = {want}, got {tuple(past.shape)}")
        dtype = model.wpe.weight.dtype  # wpe: float in every model (wte may hold int8 codes)
        if past.dtype != dtype:
            raise ValueError(f"past has dtype {past.dtype}, the model computes in {dtype}")
        P = past.shape[4]
    if cache is not None:
        if cache.batch_size != B:
            raise ValueError(f"cache holds batch size {cache.batch_size}, idx has {B}")
        P = cache.length
        if P + T > cache.max_len:
            raise ValueError(f"cache length {P} + {T} new tokens exceeds the cache size {cache.max_len}")
    if P + T > cfg.n_ctx:
        raise ValueError(f"cache length {P} + {T} new tokens = {P + T} exceeds the context n_ctx={cfg.n_ctx}")
    return P


def _check_mask(attention_mask: torch.Tensor, B: int, S: int, values: bool) -> None:
    if tuple(attention_mask.shape) != (B, S):
        raise ValueError(
            f"attention_mask must have shape (batch, past + time) = {(B, S)}, "
            f"got {tuple(attention_mask.shape)}")
    if values and attention_mask.device.type == "cpu" and attention_mask.dtype != torch.bool:
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
        if bad.numel():
            raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got {bad[0].item()}")


def _check_targets(targets: torch.Tensor, B: int, T: int, n_vocab: int, ignore_index: int, values: bool) -> None:
    if tuple(targets.shape) != (B, T):
        raise ValueError(f"targets must have shape {(B, T)}, got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if values and targets.device.type == "cpu":
        real = targets[targets != ignore_index]
        if real.numel() == 0:
            raise ValueError(f"every target is ignore_index={ignore_index}: there is no token to compute a loss on")
        lo, hi = int(real.min()), int(real.max())
        if lo < 0 or hi >= n_vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target id {bad} is outside the vocabulary [0, {n_vocab}) "
                             f"(and is not ignore_index={ignore_index})")
