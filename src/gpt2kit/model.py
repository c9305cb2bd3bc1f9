"""The GPT-2 network, as openai/gpt-2's src/model.py builds it.

token + learned position embeddings (offset by the cache length) -> n_layer pre-norm blocks
(ln_1 -> fused c_attn -> causal attention / sqrt(hs) -> c_proj, residual; ln_2 -> c_fc -> tanh-GELU
-> c_proj, residual) -> ln_f -> tied LM head (logits = h @ wte^T, no bias).

Parameter names are GPT-2's own (wte, wpe, h.{i}.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj, ln_f), so a checkpoint loads by a rename and a transpose (see checkpoint/keymap.py).

Legend: B batch, T new tokens, P cached (past) tokens, S = P + T keys, C n_embd, nh heads,
hs head size, L layers, V vocab.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kit.config import GPT2Config
from gpt2kit.kv_cache import KVCache
from gpt2kit.packed import PackedWeights

# Passed as the attention mask when the plain causal mask applies (no cache, no padding), so
# SDPA can use its is_causal fast path instead of a materialised (T, S) mask.
_CAUSAL = "causal"


class GPT2Output(NamedTuple):
    logits: torch.Tensor  # (B, T, V), or (B, 1, V) with last_logits_only
    present: torch.Tensor | None = None  # (B, L, 2, nh, S, hs), when use_cache or past was given
    loss: torch.Tensor | None = None  # mean next-token cross-entropy, when targets were given


# Decoding pushes a handful of rows through each weight matrix, so the weights' bytes are the whole
# cost and the GEMM kernel's handling of a tiny M decides the speed. For bfloat16/float16 on CPU,
# x @ W^T (F.linear) is slow there, while W @ x^T (torch.mv for one row) reads a row-major W
# 1.3-1.5x faster for 1-16 rows on a 2-core Xeon (docs/benchmarks.md). float32 keeps F.linear:
# MKL is fastest when W is stored (in, out), the layout generation puts it in (decode_layout).
_FEW_ROWS = 16


def _matmul_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x (..., in), weight (out, in) -> (..., out)."""
    rows = x.numel() // x.shape[-1]
    if (rows > _FEW_ROWS or x.device.type != "cpu" or weight.dtype == torch.float32
            or not weight.is_contiguous()):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])  # (R, in)
    if rows == 1:
        y = (torch.mv(weight, x2[0]) if bias is None else torch.addmv(bias, weight, x2[0]))[None]  # (1, out)
    elif bias is not None:
        y = torch.addmm(bias[:, None], weight, x2.t()).t()  # (R, out)
    else:
        y = torch.mm(weight, x2.t()).t()  # (R, out)
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return _matmul_t(x, layer.weight, layer.bias)


def _linear_gelu(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    # GPT-2's gelu is the tanh approximation, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))).
    return F.gelu(_linear(x, layer), approximate="tanh")


def _linear_add(x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    return residual + _linear(x, layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | str | None,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, layer: int = 0,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = _linear(x, self.c_attn).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs)
        elif past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)  # (B, nh, S, hs)
            v = torch.cat([past_kv[1], v], dim=2)
        dropout_p = self.dropout if self.training else 0.0
        if isinstance(mask, str):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_dropout(_linear(y, self.c_proj)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(_linear(_linear_gelu(x, self.c_fc), self.c_proj))


class Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | str | None,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, layer: int = 0,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        a, kv = self.attn(self.ln_1(x), mask, past_kv, cache, layer)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, kv


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

    # --- construction -----------------------------------------------------------------------

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
        """A randomly initialised model of a preset's size."""
        return cls(GPT2Config.from_name(name, **overrides))

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None) -> GPT2:
        """Load any published GPT-2 checkpoint: an HF directory or hub id, or OpenAI's TF release."""
        from gpt2kit.checkpoint import load_model

        return load_model(name_or_path, dtype=dtype, device=device)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write an HF-format directory (config.json, model.safetensors, tokenizer files)."""
        from gpt2kit.checkpoint import save_model

        save_model(self, directory)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # --- forward ----------------------------------------------------------------------------

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
        P = self._check_inputs(idx, past, attention_mask, targets, cache)
        return self._forward(idx, past=past, attention_mask=attention_mask, targets=targets,
                             use_cache=use_cache, cache=cache, last_logits_only=last_logits_only,
                             ignore_index=ignore_index, P=P)

    def _forward(self, idx: torch.Tensor, *, past: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 targets: torch.Tensor | None, use_cache: bool, cache: KVCache | None,
                 last_logits_only: bool, ignore_index: int, P: int) -> GPT2Output:
        """forward without input checks, for callers whose ids are valid by construction."""
        B, T = idx.shape
        device = idx.device
        if attention_mask is None:
            pos = torch.arange(P, P + T, device=device)  # (T,)
        else:
            # Count only real tokens, so padding does not shift the positions of what follows.
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)[:, P:]  # (B, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        mask = self._attention_mask(attention_mask, P, T, device)

        presents = []
        for i, block in enumerate(self.h):
            past_kv = (past[:, i, 0], past[:, i, 1]) if past is not None else None  # 2 x (B, nh, P, hs)
            x, kv = block(x, mask, past_kv, cache, i)
            if use_cache or past is not None:
                presents.append(torch.stack(kv, dim=1))  # (B, 2, nh, S, hs)
        if cache is not None:
            cache.length = P + T
        if last_logits_only:
            x = x[:, -1:]
        x = self.ln_f(x)  # (B, T, C)
        logits = _matmul_t(x, self.wte.weight[: self.config.n_vocab])  # (B, T, V): tied LM head
        present = torch.stack(presents, dim=1) if presents else None  # (B, L, 2, nh, S, hs)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=ignore_index)
        return GPT2Output(logits, present, loss)

    def decode_step(self, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                    packed: PackedWeights | None = None) -> torch.Tensor:
        """One new token per row: idx (B, 1) at position P = cache.length -> logits (B, V).

        attention_mask (B, P + 1) as in forward, or None. The same computation as
        ``forward(idx, cache=cache, attention_mask=attention_mask, last_logits_only=True)`` in
        eval mode (same ops on the same values, so the same logits), written flat: no module
        calls or dropout, the mask and positions built once, q/k/v as views of the fused c_attn
        output. A decode step streams every weight once, and the per-op Python overhead the
        flat form removes is 5-10% of a CPU step (docs/benchmarks.md). No input checks: for
        callers whose ids, cache and mask are valid by construction (generation).

        packed: oneDNN-prepacked matrices (gpt2kit.packed) to multiply by, with the GELU and the
        residual adds fused into the products; the same math on the same values through other
        kernels, so logits agree to rounding (float32 ~1e-6), not bit for bit.
        """
        if self.training:
            raise ValueError("decode_step is for inference: call model.eval() first (dropout would be skipped)")
        cfg = self.config
        B, C, nh, eps = idx.shape[0], cfg.n_embd, cfg.n_head, cfg.layer_norm_eps
        hs = C // nh
        P = cache.length
        if attention_mask is None:
            pos, mask = P, None
        else:
            pos = (attention_mask.sum(-1) - 1).clamp_(min=0)  # (B,): real tokens before this one
            mask = attention_mask.bool()[:, None, None, :].clone()  # (B, 1, 1, P + 1)
            mask[..., P] = True  # the query sees itself even when its slot is padding (no NaN)
        x = F.embedding(idx[:, 0], self.wte.weight) + self.wpe.weight[pos]  # (B, C)
        use_packed = packed is not None and packed.covers(B, x.dtype)
        if use_packed:
            linear, linear_gelu, linear_add = packed.linear, packed.linear_gelu, packed.linear_add
        else:
            linear, linear_gelu, linear_add = _linear, _linear_gelu, _linear_add
        for i, block in enumerate(self.h):
            attn, mlp = block.attn, block.mlp
            h = F.layer_norm(x, (C,), block.ln_1.weight, block.ln_1.bias, eps)
            qkv = linear(h, attn.c_attn).view(B, 3, nh, 1, hs)  # q, k, v of each head
            k, v = cache.update_kv(i, qkv[:, 1:])  # (B, nh, P + 1, hs)
            y = F.scaled_dot_product_attention(qkv[:, 0], k, v, attn_mask=mask)  # (B, nh, 1, hs)
            x = linear_add(y.view(B, C), attn.c_proj, x)
            h = F.layer_norm(x, (C,), block.ln_2.weight, block.ln_2.bias, eps)
            x = linear_add(linear_gelu(h, mlp.c_fc), mlp.c_proj, x)
        cache.length = P + 1
        x = F.layer_norm(x, (C,), self.ln_f.weight, self.ln_f.bias, eps)
        if use_packed:
            return packed.lm_head(x, self.wte.weight, cfg.n_vocab)  # (B, V)
        return _matmul_t(x, self.wte.weight[: cfg.n_vocab])  # (B, V): tied LM head

    @staticmethod
    def _attention_mask(attention_mask: torch.Tensor | None, P: int, T: int,
                        device: torch.device) -> torch.Tensor | str | None:
        if attention_mask is None:
            if T == 1:
                return None  # one new query sees every cached key
            if P == 0:
                return _CAUSAL
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

    def _check_inputs(self, idx: torch.Tensor, past: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      targets: torch.Tensor | None, cache: KVCache | None) -> int:
        cfg = self.config
        if not isinstance(idx, torch.Tensor):
            raise ValueError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"idx must hold at least one token, got shape {tuple(idx.shape)}")
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= cfg.n_vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.n_vocab})")
        if past is not None and cache is not None:
            raise ValueError("pass either past or cache, not both")
        P = 0
        if past is not None:
            want = (B, cfg.n_layer, 2, cfg.n_head, past.shape[-2] if past.dim() == 6 else -1, cfg.head_dim)
            if past.dim() != 6 or tuple(past.shape) != want:
                raise ValueError(f"past must have shape (B, L, 2, nh, P, hs) = {want}, got {tuple(past.shape)}")
            P = past.shape[4]
        if cache is not None:
            if cache.batch_size != B:
                raise ValueError(f"cache holds batch size {cache.batch_size}, idx has {B}")
            P = cache.length
            if P + T > cache.max_len:
                raise ValueError(f"cache length {P} + {T} new tokens exceeds the cache size {cache.max_len}")
        if P + T > cfg.n_ctx:
            raise ValueError(f"cache length {P} + {T} new tokens = {P + T} exceeds the context n_ctx={cfg.n_ctx}")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, P + T):
            raise ValueError(
                f"attention_mask must have shape (batch, past + time) = {(B, P + T)}, "
                f"got {tuple(attention_mask.shape)}")
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(f"targets must have shape {(B, T)}, got {tuple(targets.shape)}")
        return P
