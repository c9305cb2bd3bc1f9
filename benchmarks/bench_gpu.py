"""GPT-2 on a CUDA GPU: compiled decode against transformers (eager and compiled), and training MFU.

    python benchmarks/bench_gpu.py                               # GPT-2 124M (random weights), cuda
    python benchmarks/bench_gpu.py --device cpu --size gpt2-tiny --backend eager --train-steps 2   # the checks only

Decode, greedy, batch 1 and 8 (the same random prompts, --new-tokens each), four contenders timed in
turn, best of --trials:
  gpt2kit          `gpt2kit.generate` as a user calls it
  gpt2kit compile  the model's forward compiled (torch.compile, --backend) and one decode step a
                   token on a preallocated KVCache, as gpt-fast decodes
  transformers     GPT2LMHeadModel.generate, eager
  transformers compile  the same with its forward compiled
Training: `gpt2kit.train` on random tokens, bfloat16 autocast on a GPU (float32 on a CPU), compiled,
batch --batch x --seq-len; its MFU as gpt2kit.train.flops defines it, median over the steps after
the first two. A published figure to set beside it is given with --peer-mfu "nanoGPT=NN" (quoted
as given, with its source in the docs).

Checks, which make the script exit 1 whatever the timings: float32 logits within --atol of
transformers' (TF32 off for the check), and every contender's greedy tokens equal to transformers'
eager tokens (a difference where the two best logits are within 1e-4 is a tie, reported, not failed).
Timings mean nothing on a CPU; there the script is the test of everything but them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt2kit.bench.core import to_transformers
from gpt2kit.config import GPT2Config
from gpt2kit.data import write_shard
from gpt2kit.generation import generate
from gpt2kit.kv_cache import KVCache
from gpt2kit.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.sampling import SamplingSettings
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.loop import train

TIE = 1e-4


def compiled_greedy(model: GPT2, backend: str):
    """A greedy decoder on the model's compiled forward: prefill, then one step a token on a
    preallocated cache (positions come from the cache's length)."""
    step = torch.compile(model, backend=backend, dynamic=True)

    def run(ids: torch.Tensor, n: int) -> torch.Tensor:
        cache = KVCache.for_model(model, ids.shape[0], ids.shape[1] + n)
        with torch.inference_mode():
            tok = step(ids, cache=cache).logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out = [tok]
            for _ in range(n - 1):
                tok = step(tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
                out.append(tok)
        return torch.cat(out, 1)  # (B, n)
    return run


def contenders(model: GPT2, hf, backend: str) -> dict:
    ours_compiled = compiled_greedy(model, backend)
    hf_compiled = to_transformers(model).to(next(model.parameters()).device)
    hf_compiled.forward = torch.compile(hf_compiled.forward, backend=backend, dynamic=True)

    def ours(ids, n):
        s = SamplingSettings(temperature=0, max_new_tokens=n, stop_token_ids=())
        return torch.tensor([c.tokens for c in generate(model, ids.tolist(), s)], device=ids.device)

    def hf_gen(m):
        def run(ids, n):
            with torch.inference_mode():
                out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
            return out[:, ids.shape[1]:]
        return run
    return {"transformers": hf_gen(hf), "transformers compile": hf_gen(hf_compiled), "gpt2kit": ours,
            "gpt2kit compile": ours_compiled}


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else (int(diff[0, 0]), int(diff[0, 1]))


def is_tie(hf, ids: torch.Tensor, ref: torch.Tensor, row: int, col: int) -> bool:
    """Whether transformers' two best logits at the first differing token are within TIE."""
    seq = torch.cat([ids[row], ref[row, :col]])[None]
    with torch.inference_mode():
        top = hf(seq).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1]) <= TIE


def check_logits(model: GPT2, hf, ids: torch.Tensor, atol: float) -> float:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with torch.inference_mode():
        err = (model(ids).logits[..., : hf.config.vocab_size] - hf(ids).logits).abs().max().item()
    print(f"float32 logits, gpt2kit vs transformers: max |diff| {err:.2e} (limit {atol:g})")
    return err


def decode(args, model: GPT2, hf, device: torch.device) -> tuple[list[str], bool]:
    gen = torch.Generator().manual_seed(0)
    runs, ok, rows = contenders(model, hf, args.backend), True, []
    for batch in (1, 8):
        ids = torch.randint(0, model.config.n_vocab, (batch, args.prompt), generator=gen).to(device)
        ref = runs["transformers"](ids, args.new_tokens)
        best = {}
        for name, fn in runs.items():
            out = fn(ids, args.new_tokens)  # also the warm-up (and the compile)
            where = first_difference(out, ref)
            if where is not None:
                tie = is_tie(hf, ids, ref, *where)
                print(f"batch {batch}, {name}: tokens differ from transformers' at row {where[0]}, token {where[1]}"
                      + (" (a tie within 1e-4: not a failure)" if tie else ""), file=sys.stderr)
                ok = ok and tie
            times = []
            for _ in range(args.trials):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn(ids, args.new_tokens)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            best[name] = batch * args.new_tokens / min(times)
        base = best["transformers"]
        rows += [f"| decode batch {batch} | {name} | {rate:,.0f} tok/s | {rate / base:.2f}x |"
                 for name, rate in best.items()]
    return rows, ok


def training(args, device: torch.device) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        rng = np.random.default_rng(0)
        n = (args.train_steps + 1) * args.batch * args.seq_len + 1
        for split in ("train", "val"):
            write_shard(data / f"{split}_000000.bin", rng.integers(0, 50257, n).astype(np.uint16))
        cfg = TrainConfig(data=str(data), out=str(Path(tmp) / "out"), model=args.size, device=str(device),
                          dtype="bfloat16" if device.type == "cuda" else "float32", compile=args.backend != "eager",
                          batch_size=args.batch, seq_len=args.seq_len, max_steps=args.train_steps, eval_every=0,
                          log_every=max(1, args.train_steps // 4))
        train(cfg)
        recs = [r for r in map(json.loads, (Path(tmp) / "out" / "metrics.jsonl").read_text().splitlines())
                if "mfu" in r]
    later = recs[2:] or recs
    mfu = statistics.median(r["mfu"] for r in later)
    tps = statistics.median(r["tokens_per_s"] for r in later)
    peer = f" | {args.peer_mfu}" if args.peer_mfu else ""
    return (f"| train {args.size}, {cfg.dtype}, {args.batch} x {args.seq_len} | gpt2kit | {tps:,.0f} tok/s | "
            f"MFU {mfu:.1%}{peer} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="gpt2", help="a preset (random weights)")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: the checks on a CPU)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--atol", type=float, default=None,
                    help="logit tolerance (default 1e-4 on a CPU, 1e-3 on a GPU)")
    ap.add_argument("--batch", type=int, default=12, help="training micro-batch (nanoGPT's 12)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--peer-mfu", default=None,
                    help='a published figure to print beside ours, e.g. "nanoGPT 124M: NN%%"')
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available here", file=sys.stderr)
        return 2
    atol = args.atol if args.atol is not None else (1e-3 if device.type == "cuda" else 1e-4)
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name(args.size)).to(device).eval()
    hf = to_transformers(model).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else describe_cpu()
    print(f"# {name}; torch {torch.__version__}; {args.size}, random weights; backend {args.backend}")
    ok = check_logits(model, hf, torch.randint(0, model.config.n_vocab, (2, 64)).to(device), atol) <= atol
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the timings run as users run
    rows, tokens_ok = decode(args, model, hf, device)
    rows.append(training(args, device))
    print("| workload | engine | rate | vs transformers (decode) / MFU (train) |")
    print("|---|---|--:|--:|")
    print("\n".join(rows))
    if not (ok and tokens_ok):
        print("FAILED: a correctness check above did not hold", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
