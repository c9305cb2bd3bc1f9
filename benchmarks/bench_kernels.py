"""The matrix products of one GPT-2 124M decode step, per weight layout and formulation.

    python benchmarks/bench_kernels.py [--threads 2]

Times the 48 block matrices and the tied LM head (50257 x 768), each product once, for 1 and 8
rows, in float32 and bfloat16, written as
  linear   F.linear(x, W) with W stored (out, in) row-major (nn.Linear's layout),
  cm       F.linear(x, W) with W stored (in, out), i.e. column-major (transformers' Conv1D layout),
  W@x^T    torch.mv(W, x) for one row, torch.mm(W, x.T).T for several (W row-major),
  packed   oneDNN on a prepacked copy of W (torch.ops.mkldnn._reorder_linear_weight, then
           _linear_pointwise), what gpt2kit.decode.packed gives generation.
This is the evidence behind decode.plain.matmul_t, decode.use_decode_layout and gpt2kit.decode.packed
(docs/benchmarks.md). The matrices are distinct, but a CPU with a large L3 may keep part of them
between trials, so in-step rates (decode_step) are lower; compare the columns, not the totals.
Best of a few trials; a trial during which other processes used the CPU is retried when possible.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gpt2kit.bench.timing import time_alternating

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12  # c_attn, c_proj, c_fc, mlp.c_proj
HEAD = (50257, 768)


def products(weights: list[torch.Tensor], rows: int, how: str):
    dt = weights[0].dtype
    xs = {n: torch.randn(rows, n, dtype=dt) for n in (768, 3072)}
    if how == "cm":
        weights = [w.t().contiguous().t() for w in weights]
    if how == "packed":
        weights = [(w, torch.ops.mkldnn._reorder_linear_weight(w, 1 if rows == 1 else 8)) for w in weights]

    def run():
        for w in weights:
            if how == "packed":
                torch.ops.mkldnn._linear_pointwise(xs[w[0].shape[1]], w[1], None, "none", [], "")
                continue
            x = xs[w.shape[1]]
            if how == "W@x^T":
                torch.mv(w, x[0]) if rows == 1 else torch.mm(w, x.t()).t()
            else:
                F.linear(x, w)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; milliseconds per decode step's products (best trial)")
    print("| dtype | rows | matrices | linear | cm | W@x^T | packed |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for dt in (torch.float32, torch.bfloat16):
        blocks = [torch.randn(s, dtype=dt) for s in SHAPES]
        head = [torch.randn(HEAD, dtype=dt)]
        for rows in (1, 8):
            for label, ws in (("48 block", blocks), ("LM head", head)):
                fns = {how: products(ws, rows, how) for how in ("linear", "cm", "W@x^T", "packed")}
                for fn in fns.values():
                    fn()
                t = time_alternating(fns, trials=3, max_trials=8)
                print(f"| {str(dt).removeprefix('torch.')} | {rows} | {label} | "
                      + " | ".join(f"{t[h].seconds * 1e3:.1f}" for h in fns) + " |", flush=True)


if __name__ == "__main__":
    main()
