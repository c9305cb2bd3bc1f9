"""Weight-only int8 products of one GPT-2 124M decode step, per kernel, against float32 and bfloat16.

    python benchmarks/bench_int8.py [--threads 2] [--rows 1 8] [--torchao]

Times the 48 block matrices and the tied LM head (50257 x 768), each product once, for a few rows,
with every formulation this torch build offers for an int8 weight W (out, in) and per-output-channel
scales s (out,), output = (x @ W^T) * s:

  fp32         F.linear(x, W_f32) with W stored (in, out): the float32 peer (transformers' layout)
  native-avx2  gpt2kit's own C kernel (gpt2kit/decode/native.py) on float32 activations, where built
  bf16         W_bf16 @ x^T (torch.mv / mm): gpt2kit's bfloat16 path
  i8pack-bf16  torch.ops.aten._weight_int8pack_mm(x.bfloat16(), W, s.bfloat16()).float()
  i8pack-fp32  torch.ops.aten._weight_int8pack_mm(x, W, s) with float32 activations
  deq-fp32     F.linear(x, W.float() * s[:, None]): dequantise the whole matrix, then multiply
  dyn-w8a8     torch.ops.quantized.linear_dynamic (fbgemm/x86): activations quantised per call
               too (int8 x int8), a different accuracy contract, for comparison only
  int_mm       torch._int_mm on per-row int8 activations (also W8A8), where the build allows it
  torchao      torchao's Int8WeightOnlyConfig in eager mode (--torchao, when installed)

This is the evidence behind gpt2kit.quant.modules's kernel choice (docs/quantization.md). The first column
is the reference; the table prints milliseconds and the ratio of each to fp32.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from gpt2kit.bench.timing import time_alternating
from gpt2kit.decode import native
from gpt2kit.machine import describe_cpu

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12  # c_attn, c_proj, c_fc, mlp.c_proj
HEAD = (50257, 768)


def _quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def formulations(weights: list[torch.Tensor], rows: int, torchao: bool) -> dict:
    xs = {n: torch.randn(rows, n) for n in (768, 3072)}
    q = [_quant(w) for w in weights]
    fns = {}
    cm = [w.t().contiguous().t() for w in weights]
    fns["fp32"] = lambda: [F.linear(xs[w.shape[1]], w) for w in cm]
    if native.int8_linear() is not None:
        fns["native-avx2"] = lambda: [native.run_int8_linear(xs[w.shape[1]], w, s, None) for w, s in q]
    else:
        print(f"  native-avx2 unavailable: {native.why_unavailable()}")
    b16 = [w.bfloat16() for w in weights]
    xb = {n: x.bfloat16() for n, x in xs.items()}
    if rows == 1:
        fns["bf16"] = lambda: [torch.mv(w, xb[w.shape[1]][0]) for w in b16]
    else:
        fns["bf16"] = lambda: [torch.mm(w, xb[w.shape[1]].t()).t() for w in b16]
    qb = [(w, s.bfloat16()) for w, s in q]
    fns["i8pack-bf16"] = lambda: [
        torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]].bfloat16(), w, s).float() for w, s in qb]
    fns["i8pack-fp32"] = lambda: [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]], w, s) for w, s in q]
    fns["deq-fp32"] = lambda: [F.linear(xs[w.shape[1]], w.float() * s[:, None]) for w, s in q]
    try:
        packed = [torch.ops.quantized.linear_prepack(
            torch.quantize_per_channel(w, s.double(), torch.zeros(len(s), dtype=torch.long), 0, torch.qint8), None)
            for w, s in zip(weights, (s for _, s in q), strict=True)]
        fns["dyn-w8a8"] = lambda: [torch.ops.quantized.linear_dynamic(xs[w.shape[1]], p)
                                   for w, p in zip(weights, packed, strict=True)]
        fns["dyn-w8a8"]()
    except (RuntimeError, AttributeError) as e:
        print(f"  dyn-w8a8 unavailable: {e}".splitlines()[0])
        fns.pop("dyn-w8a8", None)

    def int_mm():
        out = []
        for w, s in q:
            x = xs[w.shape[1]]
            xsc = x.abs().amax(1, keepdim=True) / 127
            xi = torch.round(x / xsc).to(torch.int8)
            out.append(torch._int_mm(xi, w.t()).float() * xsc * s)
        return out
    try:
        int_mm()
        fns["int_mm"] = int_mm
    except RuntimeError as e:
        print(f"  int_mm unavailable at {rows} rows: {e}".splitlines()[0])
    if torchao:
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError:
            print("  torchao not installed (pip install torchao)")
        else:
            mods = []
            for w in weights:
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data = w.clone()
                mods.append(lin)
            mods = copy.deepcopy(torch.nn.ModuleList(mods))
            quantize_(mods, Int8WeightOnlyConfig())
            fns["torchao"] = lambda: [m(xs[m.in_features]) for m in mods]
    return fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--torchao", action="store_true", help="add torchao's int8 weight-only linear (eager)")
    p.add_argument("--only", nargs="+", default=None, help="run only these formulations (fp32 always runs)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{describe_cpu()}; threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"torch {torch.__version__}; ms per decode step's products (best quiet trial), ratio to fp32")
    blocks = [torch.randn(s) * 0.02 for s in SHAPES]
    head = [torch.randn(HEAD) * 0.02]
    header = None
    with torch.inference_mode():
        for rows in args.rows:
            for label, ws in (("48 block", blocks), ("LM head", head)):
                fns = formulations(ws, rows, args.torchao)
                if args.only:
                    fns = {k: f for k, f in fns.items() if k == "fp32" or k in args.only}
                for fn in fns.values():
                    fn()
                if header is None:
                    header = list(fns)
                    print("| rows | matrices | " + " | ".join(header) + " |")
                    print("|--:|---|" + "--:|" * len(header))
                t = time_alternating(fns, trials=args.trials, max_trials=2 * args.trials + 2)
                ref = t["fp32"].seconds
                cells = [f"{t[h].seconds * 1e3:.1f} ({ref / t[h].seconds:.2f}x)" if h in t else "n/a"
                         for h in header]
                print(f"| {rows} | {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
