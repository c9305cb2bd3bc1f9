"""Models for the generation tests whose greedy output is not one token repeated.

GPT-2's own init (N(0, 0.02), tied embeddings) makes a random model echo its last token forever,
which would let a broken sampler pass. Larger weights give varied, input-dependent sequences.
"""

from __future__ import annotations

import math

import torch

from gpt2kit.config import GPT2Config
from gpt2kit.model import GPT2

# GPT-2's vocabulary (so the tokenizer can decode), tiny everything else.
SMALL = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2)


def varied_model(cfg: GPT2Config = SMALL, seed: int = 0, scale: float = 2.0) -> GPT2:
    torch.manual_seed(seed)
    m = GPT2(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("wte.weight", "wpe.weight"):
                p.normal_(0, scale)
            elif p.dim() == 2:
                p.normal_(0, scale / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return m
