"""GPT-2's pieces as plain functions of the reference weights, each with the common mistakes as
switches: the probes that name a mistake recompute a stage this way and see which variant the
learner's output equals. With every switch at its default each function is the spec's computation
(gpt2kit.model), which tests/test_check.py proves against the model itself.

Legend: B batch, T tokens, C n_embd, nh heads, hs head size, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-5  # GPT-2's LayerNorm epsilon


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = EPS, *, unbiased: bool = False,
               affine: bool = True, bias: bool = True, rms: bool = False, swap: bool = False) -> torch.Tensor:
    """LayerNorm over the last axis; unbiased: variance over C - 1 (torch.var's default); affine=False:
    gain and bias ignored; bias=False: no bias; rms: RMSNorm (no mean taken away); swap: gain and bias
    exchanged."""
    if swap:
        w, b = b, w
    mean = 0.0 if rms else x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) if rms else x.var(-1, keepdim=True, unbiased=unbiased)
    y = (x - mean) / torch.sqrt(var + eps)
    if not affine:
        return y
    return y * w + b if bias else y * w


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "tanh": gelu_tanh,  # GPT-2's
    "erf": F.gelu,
    "relu": F.relu,
    "sigmoid": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "none": lambda x: x,
}


def mlp(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor,
        act: str = "tanh") -> torch.Tensor:
    return F.linear(ACTIVATIONS[act](F.linear(x, w_fc, b_fc)), w_proj, b_proj)  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


def _heads(t: torch.Tensor, nh: int, split: str) -> torch.Tensor:
    """(B, T, C) -> (B, nh, T, hs): GPT-2's view(B, T, nh, hs).transpose(1, 2); "view": a plain
    view(B, nh, T, hs); "interleaved": view(B, T, hs, nh) (the head index running fastest)."""
    B, T, C = t.shape
    hs = C // nh
    if split == "view":
        return t.reshape(B, nh, T, hs)
    if split == "interleaved":
        return t.reshape(B, T, hs, nh).permute(0, 3, 1, 2)
    return t.reshape(B, T, nh, hs).transpose(1, 2)


def attention(x: torch.Tensor, w_attn: torch.Tensor, b_attn: torch.Tensor, w_proj: torch.Tensor,
              b_proj: torch.Tensor, nh: int, *, scale: str = "head", mask: str = "causal", fill: float = -math.inf,
              softmax_dim: int = -1, split: str = "heads", merge: str = "heads", order: str = "qkv",
              proj_t: bool = False) -> torch.Tensor:
    """Causal self-attention (B, T, C) -> (B, T, C).

    scale: "head" 1/sqrt(hs) (GPT-2), "none", "embd" 1/sqrt(C), "hs" 1/hs. mask: "causal" (before the
    softmax, filled with fill), "none", "after" (future probabilities zeroed after the softmax), "next"
    (each query also sees the next key), "prev" (no query sees itself). order: the order c_attn's
    thirds are read as q, k, v. split/merge: see _heads; merge "view" reshapes (B, nh, T, hs) to
    (B, T, C) without the transpose back. proj_t: c_proj's matrix used transposed."""
    B, T, C = x.shape
    hs = C // nh
    parts = dict(zip(order, F.linear(x, w_attn, b_attn).split(C, dim=2), strict=True))  # 3 x (B, T, C)
    q, k, v = (_heads(parts[name], nh, split) for name in "qkv")  # (B, nh, T, hs)
    factor = {"head": 1 / math.sqrt(hs), "none": 1.0, "embd": 1 / math.sqrt(C), "hs": 1 / hs}[scale]
    att = (q @ k.transpose(-2, -1)) * factor  # (B, nh, T, T)
    diagonal = {"next": 1, "prev": -1}.get(mask, 0)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(diagonal)  # (T, T)
    if mask in ("causal", "next", "prev"):
        att = att.masked_fill(~allowed, fill)
    att = torch.softmax(att, dim=softmax_dim)
    if mask == "after":
        att = att.masked_fill(~allowed, 0.0)
    y = att @ v  # (B, nh, T, hs)
    y = y.reshape(B, T, C) if merge == "view" else y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    return F.linear(y, w_proj.t() if proj_t else w_proj, b_proj)


def sinusoids(T: int, C: int, offset: int = 0) -> torch.Tensor:
    """The 2017 Transformer's fixed position encodings (T, C)."""
    pos = torch.arange(offset, offset + T, dtype=torch.float32)[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, C, 2, dtype=torch.float32) * (-math.log(10000.0) / C))  # (C/2,)
    pe = torch.zeros(T, C)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : C // 2]
    return pe
