"""Peak memory of fine-tuning the big GPT-2 sizes: full, LoRA, LoRA + activation checkpointing.

Each case is one `gpt2kit train` process (from-scratch random weights of the size: the memory is
the same as for OpenAI's, and nothing is downloaded) on a shard of random tokens, for --steps
optimizer steps at --batch-size x --seq-len (default 1 x 512). Printed beside the arithmetic
estimate (weights, gradients, AdamW state; no activations) and the machine: the process's peak RSS
(the kernel's ru_maxrss, via os.wait4) and its peak up to the last step's log line (VmHWM then,
before the final save writes checkpoint.pt and the model).

    python benchmarks/bench_finetune_memory.py --size gpt2-xl --method lora-ckpt       # the issue's target
    python benchmarks/bench_finetune_memory.py --size gpt2-medium --method full --method full-ckpt --seq-len 1024
    python benchmarks/bench_finetune_memory.py --estimate-only                        # the computed table

Methods: full (every parameter, AdamW), full-ckpt (+ --activation-checkpointing), lora (rank
--rank on the four block matrices), lora-ckpt (+ checkpointing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpt2kit.config import GPT2Config
from gpt2kit.machine import describe_cpu

METHODS = {"full": [], "full-ckpt": ["--activation-checkpointing"], "lora": ["--lora-rank", "{rank}"],
           "lora-ckpt": ["--lora-rank", "{rank}", "--activation-checkpointing"]}
SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GIB = 1024 ** 3


def parameters(size: str) -> int:
    cfg = GPT2Config.from_name(size)
    C = cfg.n_embd
    return 50304 * C + cfg.n_ctx * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C  # padded vocab, as training


def lora_parameters(size: str, rank: int) -> int:
    cfg = GPT2Config.from_name(size)
    L, C = cfg.n_layer, cfg.n_embd
    per_block = rank * ((C + 3 * C) + (C + C) + (C + 4 * C) + (4 * C + C))  # A (r, in) + B (out, r) per matrix
    return L * per_block


def estimate(size: str, method: str, rank: int, ranks: int = 1) -> float:
    """GiB of weights, gradients and optimizer state (no activations) per process; FSDP shards all three."""
    n = parameters(size)
    if method.startswith("lora"):
        return (4 * n + 16 * lora_parameters(size, rank)) / GIB
    return 16 * n / ranks / GIB


def _hwm(pid: int) -> int | None:
    """The process's peak RSS so far (VmHWM), in bytes; None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(size: str, method: str, rank: int, batch: int, seq_len: int, steps: int,
            work: Path) -> tuple[int, int | None, float]:
    """(peak RSS bytes of the whole process, peak RSS through the last step before saving, seconds)."""
    out = work / f"{size}-{method}"
    flags = [f.format(rank=rank) for f in METHODS[method]]
    cmd = [sys.executable, "-m", "gpt2kit", "train", "--model", size, "--data", str(work / "data"), "--out", str(out),
           "--batch-size", str(batch), "--seq-len", str(seq_len), "--max-steps", str(steps), "--eval-every", "0",
           "--save-every", "0", "--log-every", "1", "--optimizer", "adamw", "--lr", "1e-4", *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, trained = [], None
    for line in proc.stderr:  # the last step's line is printed after that step, before the save
        lines.append(line)
        if line.startswith(f"step {steps}/{steps} "):
            trained = _hwm(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        tail = "".join(lines).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"{size} {method}: the run failed (exit {os.waitstatus_to_exitcode(status)}): {tail[0]}")
    return usage.ru_maxrss * 1024, trained, seconds  # ru_maxrss is in KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", action="append", choices=SIZES, help="repeatable (default gpt2-xl)")
    ap.add_argument("--method", action="append", choices=tuple(METHODS), help="repeatable (default lora-ckpt)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--estimate-only", action="store_true", help="print the computed table, run nothing")
    args = ap.parse_args()
    print(f"machine: {describe_cpu()}, {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB RAM")
    if args.estimate_only:
        print(f"{'size':<12} {'full':>8} {'lora r' + str(args.rank):>9} {'FSDP x2':>8} {'FSDP x4':>8} {'FSDP x8':>8}"
              "   (GiB; weights + gradients + AdamW state, no activations)")
        for size in SIZES:
            cells = [estimate(size, "full", args.rank), estimate(size, "lora", args.rank),
                     *(estimate(size, "full", args.rank, n) for n in (2, 4, 8))]
            print(f"{size:<12} " + " ".join(f"{c:>8.1f}" for c in cells))
        return
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        from gpt2kit.data import write_shard

        write_shard(work / "data" / "train_000000.bin", np.random.default_rng(0).integers(0, 50257, 20_000))
        print(f"{'size':<12} {'method':<10} {'peak RSS':>9} {'in steps':>9} {'computed':>9} {'seconds':>8}   "
              f"(batch {args.batch_size} x {args.seq_len}, {args.steps} steps; "
              "in steps: the peak before the final save; computed: weights + grads + AdamW, no activations)")
        for size in args.size or ["gpt2-xl"]:
            for method in args.method or ["lora-ckpt"]:
                rss, trained, seconds = measure(size, method, args.rank, args.batch_size, args.seq_len,
                                                args.steps, work)
                steps = f"{trained / GIB:>7.2f} G" if trained is not None else f"{'?':>9}"
                print(f"{size:<12} {method:<10} {rss / GIB:>7.2f} G {steps} "
                      f"{estimate(size, method, args.rank):>7.2f} G {seconds:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
