"""gpt2kit trace: time and report size on a gpt2-124M-sized network, against one plain forward.

Random weights (the cost does not depend on their values), random token ids. Each round runs, in
turn: one plain `model(ids)`; `trace()` (the hooked forward); and `trace()` + `to_html()` (the
views: next-token stats, the logit lens over all L + 1 layers, attribution, head scores, and the
HTML) — what `gpt2kit trace --out` does after loading. Medians over the rounds, so a busy machine
slows all three alike; the ratio to the plain forward is the figure to compare across machines.
The CPU column is the process's CPU seconds for trace+html (time.process_time): on a machine shared
with other jobs, CPU seconds / threads is what the wall time would be if the threads had the cores
to themselves (an estimate, not a measurement of an idle machine).

The second table splits the HTML step into its parts (one round, on a fresh trace each, so no
view is cached): next-token stats, the logit lens, direct logit attribution, the attention maps and
head scores, the walk-through, and the rest (norms, rounding, JSON, the page).

    python benchmarks/bench_trace.py                 # T = 64 and 128, 3 rounds, 2 threads
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpt2kit.bench.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import report as trace_report
from gpt2kit.trace import trace


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def breakdown(model, tok, ids) -> dict[str, float]:
    """Seconds for each part of to_html() on a fresh trace."""
    tr = trace(model, tok, ids)
    parts: dict[str, float] = {}
    for name, fn in (("stats", tr.next_token_stats), ("lens", tr.logit_lens),
                     ("attribution", tr.direct_logit_attribution), ("attention", tr.attention_summary),
                     ("walk", lambda: trace_report.walkthrough(tr, len(ids) - 1))):
        t0 = time.perf_counter()
        fn()
        parts[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tr.to_html()  # the views above are cached now: what is left is the page itself
    parts["rest"] = time.perf_counter() - t0
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2.from_name("gpt2").eval()
    tok = Tokenizer.default()
    rows = []
    load0 = _load()
    for T in args.tokens:
        ids = torch.randint(0, model.config.n_vocab, (T,)).tolist()
        times: dict[str, list[float]] = {"forward": [], "trace": [], "trace+html": [], "cpu": []}
        size = 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            with torch.no_grad():
                model(torch.tensor([ids]))
            t1 = time.perf_counter()
            trace(model, tok, ids)
            t2, c2 = time.perf_counter(), time.process_time()
            size = len(trace(model, tok, ids).to_html().encode("utf-8"))
            t3, c3 = time.perf_counter(), time.process_time()
            times["cpu"].append(c3 - c2)
            times["forward"].append(t1 - t0)
            times["trace"].append(t2 - t1)
            times["trace+html"].append(t3 - t2)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((T, med, size, breakdown(model, tok, ids)))
    print(f"machine: {describe_cpu()}; torch {torch.__version__}, {args.threads} threads; gpt2 (124M), float32")
    print(f"load average before/after: {load0} / {_load()}")
    print(f"{'T':>5} {'forward s':>10} {'trace s':>9} {'trace+html s':>13} {'x forward':>10} "
          f"{'CPU s':>7} {'CPU s/threads':>14} {'HTML MB':>8}")
    for T, med, size, _ in rows:
        print(f"{T:>5} {med['forward']:>10.2f} {med['trace']:>9.2f} {med['trace+html']:>13.2f} "
              f"{med['trace+html'] / med['forward']:>10.1f} {med['cpu']:>7.2f} {med['cpu'] / args.threads:>14.2f} "
              f"{size / 2**20:>8.2f}")
    names = list(rows[0][3])
    print("\nwhere the HTML step's time goes (s, one round):")
    print(f"{'T':>5} " + " ".join(f"{n:>11}" for n in names))
    for T, _, _, parts in rows:
        print(f"{T:>5} " + " ".join(f"{parts[n]:>11.2f}" for n in names))


if __name__ == "__main__":
    main()
