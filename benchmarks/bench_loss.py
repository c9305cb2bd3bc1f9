"""The output layer's forward + backward: full float32 logits (the model's own loss) against the fused
chunked loss (gpt2kit.train.loss), over the padded (50,304) and the unpadded (50,257) head.

One thread, process CPU time (work done, whatever else runs on the machine), contenders interleaved,
median of --rounds.

    python benchmarks/bench_loss.py                    # gpt2-tiny's shape: 2,048 rows, C = 128
    python benchmarks/bench_loss.py --chunks 128 256 1024 --rows 2048 --n-embd 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gpt2kit.machine import describe_cpu
from gpt2kit.train.loss import fused_linear_cross_entropy

V, VP = 50257, 50304


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h0 = torch.randn(args.rows, args.n_embd)
    w0 = torch.randn(VP, args.n_embd) * 0.02
    t = torch.randint(0, V, (args.rows,))

    def full() -> None:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        F.cross_entropy(F.linear(h, w[:V]).float(), t).backward()  # the model's head: a slice of wte

    def fused(chunk: int, pad: bool):
        def run() -> None:
            h, w = h0.clone().requires_grad_(), (w0 if pad else w0[:V]).clone().requires_grad_()
            fused_linear_cross_entropy(h, w, t, n_vocab=V, chunk_rows=chunk).backward()
        return run

    contenders = {"full logits": full}
    for c in args.chunks:
        contenders[f"fused, padded, {c} rows"] = fused(c, True)
        contenders[f"fused, unpadded, {c} rows"] = fused(c, False)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    base = statistics.median(times["full logits"])
    print(f"{describe_cpu()}, torch {torch.__version__}, 1 thread; "
          f"{args.rows} rows x C={args.n_embd}, V={V} (padded {VP})")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:28s} {m * 1000:8.0f} ms CPU  x{base / m:.2f}")


if __name__ == "__main__":
    main()
