"""Learning per token and per second: gpt2kit's training recipe against a nanoGPT-style reference loop.

Every contender trains its own gpt2-tiny (the same initial weights) on the same shards (gpt2kit
prepare's output; the README main job uses the standard library) for the same number of steps of
the same batch, and is evaluated on the same held-out batches. The contenders take their steps in
turn, round-robin, so a busy machine slows them alike; time is each contender's own process CPU time
(one thread, so it measures work done, not how the machine was shared) and wall time.

    today      the plain recipe: shards read in order, AdamW, cosine, the model's own loss
               over full (B, T, V) float32 logits, unpadded head
    nanogpt    nanoGPT's train.py loop: random windows (torch.randint), AdamW (fused, betas (0.9,
               0.95), weight decay 0.1 on 2-D weights), warmup + cosine to lr/10, grad clip 1.0,
               model(x, targets).loss (full logits)
    gpt2kit    what `gpt2kit train` runs by default: random windows (RandomWindowLoader), Muon for
               the block matrices + AdamW for the rest (make_optimizer), warmup-stable-decay
               (lr_factor), the fused chunked loss over the padded head (TrainingLoss)
    extra contenders for the sweep: --sweep NAME=KEY:VALUE,KEY:VALUE (keys: optimizer, lr, muon_lr,
               schedule, sampling, fused, ns: the Newton-Schulz dtype, bfloat16 or float32; default
               float32, what a float32 `gpt2kit train` runs)

    python benchmarks/bench_train_quality.py --data data/stdlib --steps 300
    python benchmarks/bench_train_quality.py --data data/stdlib --steps 60 --only gpt2kit \\
        --sweep lr4e-3=lr:4e-3 --sweep mlr05=muon_lr:0.05

Prints a table (held-out loss at equal tokens, CPU seconds, ratios against nanogpt) and writes the
curves as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpt2kit.config import GPT2Config
from gpt2kit.data.loaders import RandomWindowLoader, ShardLoader
from gpt2kit.data.shard import find_shards, read_shard
from gpt2kit.model import GPT2
from gpt2kit.train.loss import TrainingLoss
from gpt2kit.train.optim import ADAM_BETAS, ADAM_EPS, lr_factor, make_optimizer, param_groups

RECIPES: dict[str, dict[str, Any]] = {
    "today": dict(optimizer="adamw", lr=2e-3, schedule="cosine", sampling="sequential", fused=False),
    "nanogpt": dict(optimizer="adamw", lr=2e-3, schedule="cosine", sampling="nanogpt", fused=False),
    "gpt2kit": dict(optimizer="muon", lr=2e-3, muon_lr=0.02, schedule="wsd", sampling="random", fused=True),
}


@dataclass
class Contender:
    name: str
    recipe: dict[str, Any]
    model: GPT2
    step_fn: Any = None
    cpu: float = 0.0
    wall: float = 0.0
    curve: list[tuple[int, float, float, float]] = field(default_factory=list)  # (step, val, cpu, wall)


def _model(fused: bool, seed: int) -> GPT2:
    torch.manual_seed(seed)
    cfg = GPT2Config.from_name("gpt2-tiny", n_vocab_padded=50304 if fused else None)
    model = GPT2(cfg)
    if fused:  # the same initial weights as the unpadded model: copy them over
        torch.manual_seed(seed)
        plain = GPT2(GPT2Config.from_name("gpt2-tiny"))
        with torch.no_grad():
            for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
                p[: q.shape[0]].copy_(q) if n == "wte.weight" else p.copy_(q)
    return model


def _batches(recipe: dict[str, Any], data: str, B: int, T: int, seed: int):
    if recipe["sampling"] == "sequential":
        loader = ShardLoader(data, "train", batch_size=B, seq_len=T)
        while True:
            yield loader.next_batch()
    elif recipe["sampling"] == "random":
        loader = RandomWindowLoader(data, "train", batch_size=B, seq_len=T, seed=seed)
        while True:
            yield loader.next_batch()
    else:  # nanoGPT's get_batch: one memmap, torch.randint starts
        tokens = np.concatenate([read_shard(p) for p in find_shards(data, "train")])
        gen = torch.Generator().manual_seed(seed)
        while True:
            ix = torch.randint(len(tokens) - T, (B,), generator=gen)
            x = torch.stack([torch.from_numpy(tokens[i : i + T].astype(np.int64)) for i in ix.tolist()])
            y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + T].astype(np.int64)) for i in ix.tolist()])
            yield x, y


def _stepper(c: Contender, data: str, B: int, T: int, steps: int, seed: int):
    r = c.recipe
    model = c.model
    if r["optimizer"] == "adamw" and not r["fused"]:  # the reference: plain torch AdamW
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=r["lr"], betas=ADAM_BETAS, eps=ADAM_EPS, fused=True)
        for g in opt.param_groups:
            g["base_lr"] = r["lr"]

        def set_factor(f: float) -> None:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * f
    else:
        opt = make_optimizer(model, r["optimizer"], lr=r["lr"], weight_decay=0.1, muon_lr=r.get("muon_lr", 0.02),
                             muon_dtype=r.get("ns"))
        set_factor = opt.set_lr_factor
    loss_fn = TrainingLoss(model) if r["fused"] else (lambda x, y: model(x, targets=y).loss)
    batches = _batches(r, data, B, T, seed)
    warmup = max(1, steps // 20)

    def step(i: int) -> float:
        x, y = next(batches)
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        set_factor(lr_factor(i, schedule=r["schedule"], warmup_steps=warmup, max_steps=steps, min_lr_ratio=0.1))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


@torch.no_grad()
def _evaluate(model: GPT2, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    loss = sum(TrainingLoss(model)(x, y).item() for x, y in val) / len(val)
    model.train()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="shards from gpt2kit prepare (train_*.bin, val_*.bin)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--only", nargs="*", default=list(RECIPES), help="built-in contenders to run")
    ap.add_argument("--sweep", action="append", default=[], metavar="NAME=KEY:VALUE,...",
                    help="an extra contender: gpt2kit's recipe with these changes")
    ap.add_argument("--json", help="write the curves here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    recipes = {k: RECIPES[k] for k in args.only}
    for spec in args.sweep:
        name, _, changes = spec.partition("=")
        recipe = dict(RECIPES["gpt2kit"])
        for kv in changes.split(","):
            k, _, v = kv.partition(":")
            if k in ("optimizer", "schedule", "sampling", "ns"):
                recipe[k] = v
            else:
                recipe[k] = v == "1" if k == "fused" else float(v)
        recipes[name] = recipe
    B, T = args.batch_size, args.seq_len
    val_loader = ShardLoader(args.data, "val", batch_size=B, seq_len=T)
    val = [val_loader.next_batch() for _ in range(args.eval_batches)]
    contenders = [Contender(n, r, _model(r["fused"], args.seed)) for n, r in recipes.items()]
    for c in contenders:
        c.step_fn = _stepper(c, args.data, B, T, args.steps, args.seed)
        c.curve.append((0, _evaluate(c.model, val), 0.0, 0.0))
    for i in range(args.steps):
        for c in contenders:
            t0, w0 = time.process_time(), time.perf_counter()
            c.step_fn(i)
            c.cpu += time.process_time() - t0
            c.wall += time.perf_counter() - w0
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            for c in contenders:
                c.curve.append((i + 1, _evaluate(c.model, val), c.cpu, c.wall))
            print(f"step {i + 1}: " + ", ".join(f"{c.name} {c.curve[-1][1]:.3f}" for c in contenders), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({c.name: {"recipe": c.recipe, "curve": c.curve} for c in contenders}, f, indent=1)
    ref = next((c for c in contenders if c.name == "nanogpt"), contenders[0])
    tokens = args.steps * B * T
    print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; gpt2-tiny, "
          f"{args.steps} steps x {B} x {T} = {tokens:,} tokens; held-out loss on {args.eval_batches} batches")
    print(f"{'contender':12s} {'val loss':>9s} {'vs ' + ref.name:>11s} {'CPU s':>8s} {'tok/CPU s':>10s} "
          f"{'speed vs ' + ref.name:>16s}")
    for c in contenders:
        print(f"{c.name:12s} {c.curve[-1][1]:9.3f} {c.curve[-1][1] - ref.curve[-1][1]:+11.3f} {c.cpu:8.0f} "
              f"{tokens / c.cpu:10.0f} {ref.cpu / c.cpu:15.2f}x")
    for c in contenders:  # equal CPU time: c's loss at the last evaluation within the reference's total time
        within = [v for s, v, cpu, _ in c.curve if cpu <= ref.cpu]
        print(f"at the reference's {ref.cpu:.0f} CPU s: {c.name} {within[-1]:.3f}")


if __name__ == "__main__":
    main()
