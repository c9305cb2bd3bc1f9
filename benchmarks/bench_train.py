"""Training throughput: gpt2kit vs transformers' GPT2LMHeadModel, side by side, as ratios.

Both models get the same config, the same initial weights, the same batches (GPT-2 tokens of the
Python standard library's own .py files, so it runs offline) and the same step: forward, mean
next-token cross-entropy, backward, grad-norm clip 1.0, AdamW (fused, betas (0.9, 0.95), weight
decay 0.1 on 2-D weights), warmup + cosine learning rate. The contenders take their steps in turn,
round-robin, so a busy machine slows them alike; tokens/s is the median step time over the rounds
that every contender took part in (after --warmup untimed steps).

    python benchmarks/bench_train.py                 # CPU: gpt2-mini (6 x 384), batch 8 x 256, 2 threads
    python benchmarks/bench_train.py --quick         # fewer steps, a couple of minutes
    python benchmarks/bench_train.py --device cuda --preset gpt2 --batch-size 16 --seq-len 1024   # + MFU

Checks: gpt2kit bfloat16's loss after --steps steps is within 2% of gpt2kit float32's (the same
loss curve), and transformers' float32 loss curve matches gpt2kit's (the same computation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2kit.checkpoint.keymap import to_hf_state
from gpt2kit.config import GPT2Config
from gpt2kit.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.train import flops
from gpt2kit.train.optim import ADAM_BETAS, ADAM_EPS, lr_factor, param_groups


def stdlib_tokens(n: int) -> torch.Tensor:
    """The first n GPT-2 tokens of the standard library's top-level .py files, in name order."""
    tok = Tokenizer.default()
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_path("stdlib")).glob("*.py")):
        ids.append(tok.eot_token)
        ids.extend(tok.encode(path.read_text(encoding="utf-8", errors="replace")))
        if len(ids) >= n:
            return torch.tensor(ids[:n], dtype=torch.long)
    raise SystemExit(f"the standard library holds only {len(ids)} tokens, {n} needed")


def to_hf(model: GPT2, attn: str):
    """transformers' GPT2LMHeadModel with our weights (Conv1D matrices transposed)."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(HFConfig(**model.config.to_hf(), attn_implementation=attn))
    state = to_hf_state(model.state_dict(), model.config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" or k.endswith(".attn.bias") for k in missing), missing
    hf.tie_weights()
    return hf


@dataclass
class Contender:
    name: str
    model: torch.nn.Module
    loss_fn: object  # (model, x, y) -> loss
    bf16: bool
    steps: int
    optimizer: torch.optim.Optimizer = None
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def __post_init__(self):
        groups = param_groups(self.model, weight_decay=0.1)
        self.optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS, fused=True)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, sync) -> None:
        t0 = time.perf_counter()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        sync()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(value)


def ours_loss(model, x, y):
    return model(x, targets=y).loss


def hf_loss(model, x, y):
    logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))  # what labels= computes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-mini")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50, help="gpt2kit steps (the loss-curve check is at the last one)")
    ap.add_argument("--hf-steps", type=int, default=20, help="transformers steps (timing and the curve check)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps of each contender")
    ap.add_argument("--quick", action="store_true", help="--steps 20 --hf-steps 8: a couple of minutes on a CPU")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-hf-bf16", action="store_true", help="skip transformers with bf16 autocast")
    ap.add_argument("--compile", action="store_true", help="also time gpt2kit under torch.compile (bf16)")
    ap.add_argument("--times", action="store_true", help="print every step's time")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the peak MFU is a share of (default: gpt2kit.train.flops: a known GPU's data sheet for "
                         "bfloat16, else the rate measured here)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.hf_steps = 20, 8
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    cfg = GPT2Config.from_name(args.preset)
    B, T = args.batch_size, args.seq_len
    torch.manual_seed(0)
    init = GPT2(cfg)
    tokens = stdlib_tokens(args.steps * B * T + 1)

    def fresh_ours() -> GPT2:
        m = GPT2(cfg)
        m.load_state_dict(init.state_dict())
        return m.to(device).train()

    contenders = [
        Contender("transformers float32", to_hf(init, "sdpa").to(device).train(), hf_loss, False, args.hf_steps),
        Contender("gpt2kit float32", fresh_ours(), ours_loss, False, args.steps),
        Contender("gpt2kit bfloat16 autocast", fresh_ours(), ours_loss, True, args.steps),
    ]
    if not args.no_hf_bf16:
        contenders.append(Contender("transformers bfloat16 autocast", to_hf(init, "sdpa").to(device).train(),
                                    hf_loss, True, args.hf_steps))
    if args.compile:
        contenders.append(Contender("gpt2kit bfloat16 + compile", torch.compile(fresh_ours()), ours_loss, True,
                                    args.steps))

    n_params = sum(p.numel() for p in init.parameters())
    print(f"# {args.preset}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {n_params / 1e6:.1f}M parameters; "
          f"batch {B} x {T} = {B * T} tokens/step; {args.steps} steps (transformers {args.hf_steps})")
    print(f"# {describe_cpu()}, {args.threads} threads, {device}, "
          f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"load average {os.getloadavg()[0]:.2f}")
    t_start = time.perf_counter()
    for step in range(args.steps):
        lo = step * B * T
        x = tokens[lo: lo + B * T].view(B, T).to(device)  # (B, T)
        y = tokens[lo + 1: lo + B * T + 1].view(B, T).to(device)  # (B, T)
        lr = args.lr * lr_factor(step, schedule="cosine", warmup_steps=max(1, args.steps // 10),
                                 max_steps=args.steps, min_lr_ratio=0.1)
        for c in contenders:
            if step < c.steps:
                c.step(x, y, lr, sync)
        if step in (0, args.steps - 1) or (step + 1) % 10 == 0:
            print(f"  step {step + 1}: " + ", ".join(f"{c.name} {c.losses[-1]:.4f}" for c in contenders
                                                     if len(c.losses) == step + 1), file=sys.stderr, flush=True)
    report(contenders, args, B * T, flops.flops_per_token(init, T), device, time.perf_counter() - t_start)


def peak(device: torch.device, bf16: bool, override: float | None) -> flops.PeakRate:
    if override:
        return flops.PeakRate(override * 1e12, "--peak-tflops")
    return flops.peak_rate(device, torch.bfloat16 if bf16 else torch.float32)


def report(contenders, args, tokens_per_step, flops_per_token, device, wall) -> None:
    # Only the rounds every contender took part in: the same moments of a busy machine for all.
    common = min(len(c.times) for c in contenders)
    window = slice(args.warmup, common) if common > args.warmup else slice(0, common)
    rate = {c.name: tokens_per_step / statistics.median(c.times[window]) for c in contenders}
    best = {c.name: tokens_per_step / min(c.times[window]) for c in contenders}
    base, best_base = rate["transformers float32"], best["transformers float32"]
    peaks = {bf16: peak(device, bf16, args.peak_tflops) for bf16 in (False, True)}
    print()
    print("| run | tokens/s (median step) | vs transformers float32 | tokens/s (fastest step) | "
          "vs transformers float32 | loss at last step | MFU |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for c in contenders:
        row = (f"| {c.name} | {rate[c.name]:,.0f} | {rate[c.name] / base:.2f}x | {best[c.name]:,.0f} | "
               f"{best[c.name] / best_base:.2f}x | {c.losses[-1]:.4f} (step {len(c.losses)}) | "
               f"{flops.mfu(rate[c.name], flops_per_token, peaks[c.bf16]):.1%} |")
        print(row)
    print(f"MFU: model FLOPs ({flops_per_token / 1e6:,.1f} MFLOP a token) against "
          + "; ".join(f"{'bfloat16' if k else 'float32'} runs {v.describe()}" for k, v in peaks.items()))
    l32, l16 = contenders[1].losses, contenders[2].losses
    rel = abs(l16[-1] - l32[-1]) / l32[-1]
    hf = contenders[0].losses
    curve = max(abs(a - b) for a, b in zip(hf, l32, strict=False))
    print()
    print(f"loss curve, bf16 vs float32 (gpt2kit) at step {len(l32)}: {l16[-1]:.4f} vs {l32[-1]:.4f}, "
          f"{rel:.2%} apart -> {'OK' if rel <= 0.02 else 'FAIL'} (limit 2%)")
    print(f"same computation, transformers vs gpt2kit float32 over {len(hf)} steps: max |loss difference| "
          f"{curve:.2e} -> {'OK' if curve <= 1e-3 else 'FAIL'} (limit 1e-3)")
    print(f"tokens/s: median step time over steps {window.start + 1}-{window.stop}, which every run took part in")
    f32, b16 = "gpt2kit float32", "gpt2kit bfloat16 autocast"
    print(f"targets (median / fastest step): float32 {rate[f32] / base:.2f}x / {best[f32] / best_base:.2f}x "
          f"(>= 1.0x), bf16 {rate[b16] / base:.2f}x / {best[b16] / best_base:.2f}x (>= 1.5x); wall {wall:.0f}s")
    if args.times:
        for c in contenders:
            print(f"{c.name}: step seconds " + " ".join(f"{t:.2f}" for t in c.times))


if __name__ == "__main__":
    main()
