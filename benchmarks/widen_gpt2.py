"""Widen a GPT-2 checkpoint to twice its width, computing the same function (Net2Net-style growth):
the start of a bigger benchmark target when this machine cannot train one from scratch in time.

    python benchmarks/widen_gpt2.py SRC OUT [--noise 1e-4] [--seed 0]

OUT gets n_embd 2C and n_head 2nh (the same head size), with SRC's layers, context and vocabulary.
The residual stream is SRC's duplicated ([x, x]); LayerNorm of a duplicated vector is the
duplicated LayerNorm (same mean and variance), every head is present twice, every MLP unit twice,
and each product's input side is halved so the duplicate halves sum to SRC's product; ln_f's gain
and bias are halved so the tied head (wte = [wte, wte]) gives SRC's logits. With --noise 0 the
logits are SRC's to float rounding (tests/test_widen_gpt2.py); --noise adds N(0, noise) to every
matrix so that training can tell the copies apart (exact copies get equal gradients forever).
The weights' bytes are what a decode step reads, so OUT decodes at the speed of a model of its
shape, whatever SRC's quality.

Legend: C SRC's n_embd, H SRC's MLP width (4C), V vocab rows, T n_ctx.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model
from gpt2kit.model import GPT2


def _dup(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t, t], dim=dim)


def _widen_linear(w: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """nn.Linear weight (out, in) of a product on the duplicated input -> (2 out, 2 in): the output
    rows of each of `parts` blocks (q, k, v for c_attn) duplicated in place, the input columns
    duplicated and halved."""
    rows = torch.cat([_dup(p, 0) for p in w.chunk(parts, 0)], 0)  # (2 out, in)
    return _dup(rows, 1) / 2  # (2 out, 2 in)


def _widen_bias(b: torch.Tensor, parts: int = 1) -> torch.Tensor:
    return torch.cat([_dup(p, 0) for p in b.chunk(parts, 0)], 0)


def widen(model: GPT2, noise: float = 0.0, seed: int = 0) -> GPT2:
    """A new GPT2 of twice model's width and heads computing model's function (plus `noise`)."""
    cfg = model.config
    wide = GPT2(dataclasses.replace(cfg, n_embd=2 * cfg.n_embd, n_head=2 * cfg.n_head))
    src = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for k, v in src.items():
        if k in ("wte.weight", "wpe.weight", "lm_head.weight"):
            out[k] = _dup(v, 1)  # (V or T, 2C)
        elif k.startswith("ln_f."):
            out[k] = _dup(v, 0) / 2  # the tied head reads [x, x] against [wte, wte]
        elif ".ln_" in k:
            out[k] = _dup(v, 0)
        elif k.endswith("attn.c_attn.weight"):
            out[k] = _widen_linear(v, 3)
        elif k.endswith("attn.c_attn.bias"):
            out[k] = _widen_bias(v, 3)
        elif k.endswith(".weight") and v.dim() == 2:
            out[k] = _widen_linear(v)  # c_proj (both), c_fc
        elif k.endswith(".bias"):
            out[k] = _widen_bias(v)
        else:
            raise ValueError(f"widen: no rule for {k} {tuple(v.shape)}")
    if noise:
        g = torch.Generator().manual_seed(seed)
        for k, v in out.items():
            if v.dim() == 2 and k != "lm_head.weight":  # lm_head is wte (tied)
                v += torch.randn(v.shape, generator=g) * noise
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["wte.weight"]  # one tensor (tied), noise and all
    wide.load_state_dict(out, strict=True)
    return wide.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="a checkpoint directory (or published name) to widen")
    ap.add_argument("out", help="the directory to write (HF format, with SRC's tokenizer)")
    ap.add_argument("--noise", type=float, default=1e-4, help="std of the noise added to every matrix")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    wide = widen(load_model(args.src), args.noise, args.seed)
    save_model(wide, args.out, tokenizer=load_tokenizer(args.src))
    c = wide.config
    print(f"{args.out}: {c.n_layer} layers x {c.n_embd} ({c.n_head} heads), {wide.num_parameters() / 1e6:.1f}M "
          f"parameters, noise {args.noise}")


if __name__ == "__main__":
    main()
