"""Many LoRA adapters on one base: engine decode steps of 8 rows spread over 4 adapters against the
same 8 rows on the plain model (the aim: >= 0.8x its tokens/s), and on the adapter-holding model's
base.

    python benchmarks/bench_multi_lora.py [--preset gpt2] [--adapters 4] [--rank 8] [--rows 8]
                                          [--trials 30] [--threads N] [--quick]

Random weights of the preset's shape (float32, the decode layout load_model gives), and --adapters
random adapters of --rank on all four block matrices (gpt2kit.lora.enable_multi_lora, added to its
bank as add_adapter adds a checked one). Three engines of max_batch --rows, each with --rows greedy
rows decoding (short prompts, more new tokens than the run takes): the plain model; the adapter model
with its rows spread over the adapters in turn; the adapter model with every row on the base. Each
trial times one engine step of each, the order rotated trial by trial, after the prompts are in and
a few steps of warm-up; the medians, tokens/s (rows a step / its median) and the ratios to the plain
model are printed last, with the machine's load (os.getloadavg: on a busy machine the figures are rough),
and beside them each step's CPU time (the process's, all its threads), which a busy machine disturbs less.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch

from gpt2kit.config import GPT2Config
from gpt2kit.decode.layout import use_decode_layout
from gpt2kit.engine import Engine
from gpt2kit.lora import TARGETS, enable_multi_lora
from gpt2kit.model import GPT2
from gpt2kit.sampling import SamplingSettings


def models(preset: str, n_adapters: int, rank: int, small: bool = False) -> tuple[GPT2, GPT2]:
    """The plain model and a copy holding n_adapters random adapters of `rank` on every block matrix
    (small: the preset cut to 2 layers of width 128)."""
    torch.manual_seed(0)
    cfg = GPT2Config.from_name(preset, **({"n_layer": 2, "n_embd": 128, "n_head": 4} if small else {}))
    plain = use_decode_layout(GPT2(cfg).eval())
    adapted = copy.deepcopy(plain)
    bank = enable_multi_lora(adapted)
    g = torch.Generator().manual_seed(1)
    for k in range(n_adapters):
        tensors = {}
        for i in range(len(adapted.h)):
            for target in TARGETS:
                out_f, in_f = adapted.get_submodule(f"h.{i}.{target}").weight.shape
                tensors[f"h.{i}.{target}"] = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5,
                                              torch.randn(out_f, rank, generator=g) * 0.01)
        bank.add(f"ad{k}", tensors, dict.fromkeys(tensors, 2.0))
    return plain, adapted


def engine(model: GPT2, adapters: list[int], rows: int, new_tokens: int) -> Engine:
    """An engine with `rows` greedy rows decoding (row b on adapters[b]), their prompts in and warmed up."""
    e = Engine(model, max_batch=rows)
    settings = SamplingSettings(max_new_tokens=new_tokens, temperature=0, stop_token_ids=())
    batch = [e.new_row([(7 * b + j) % 1000 for j in range(16)], settings) for b in range(rows)]
    for row, a in zip(batch, adapters, strict=True):
        row.adapter = a
    e.submit(batch)
    while e.n_prefilling or e.n_waiting:
        e.step()
    for _ in range(3):
        e.step()
    return e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2", help="the model's shape (GPT2Config presets; default gpt2)")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a small model, 3 trials: check that it runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trials = 3 if args.quick else args.trials
    plain, adapted = models(args.preset, args.adapters, args.rank, small=args.quick)
    n, budget = args.rows, trials + 8
    engines = {"plain model": engine(plain, [-1] * n, n, budget),
               f"{args.adapters} adapters spread": engine(adapted, [b % args.adapters for b in range(n)], n, budget),
               "adapter model, base rows": engine(adapted, [-1] * n, n, budget)}
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    with torch.inference_mode():
        for t in range(trials):
            for name in names[t % len(names):] + names[:t % len(names)]:
                t0, c0 = time.perf_counter(), time.process_time()
                engines[name].step()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    load_after = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {args.preset}{' (cut small)' if args.quick else ''} float32, {n} rows a step, "
          f"{args.adapters} adapters of rank {args.rank} on "
          f"{', '.join(TARGETS)}; median of {trials} steps each, interleaved")
    print(f"load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    base, base_cpu = statistics.median(times[names[0]]), statistics.median(cpu[names[0]])
    print(f"{'engine step':<28} {'median ms':>10} {'tokens/s':>9} {'vs plain':>9} {'CPU ms':>9} {'vs plain':>9}")
    for name in names:
        med, med_cpu = statistics.median(times[name]), statistics.median(cpu[name])
        print(f"{name:<28} {med * 1e3:>10.1f} {n / med:>9.1f} {base / med:>8.2f}x {med_cpu * 1e3:>9.1f} "
              f"{base_cpu / med_cpu:>8.2f}x")


if __name__ == "__main__":
    main()
