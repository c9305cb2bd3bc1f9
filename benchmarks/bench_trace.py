"""gpt2kit trace: time and report size on a gpt2-124M-sized network, against one plain forward.

Random weights (the cost does not depend on their values), random token ids. Each round runs, in
turn: one plain `model(ids)` (forward); `trace()` (the hooked forward, attention maps derived);
and `to_html()` on that trace (report: next-token stats, the logit lens over all L + 1 layers,
attribution, head scores, the walk-through and the page) — what `gpt2kit trace --out` does after
loading. The report column should stay within 2 s at 64 tokens and 20 s at 1,024 (LIMITS).
Medians over the rounds, so a busy machine slows all three alike. The CPU column is the process's
CPU seconds for the report (time.process_time): on a machine shared with other jobs, CPU seconds /
threads is what the wall time would be if the threads had the cores to themselves (an estimate,
not a measurement of an idle machine). The work column is the report's matrix products, counted
(torch.utils.flop_counter), not timed: the logit lens's unembedding is almost all of it.

The second table splits the report into its parts (one round, on a fresh trace, so no view is
cached): next-token stats, the logit lens, direct logit attribution, the head scores, the
walk-through, and the rest (attention maps, rounding, JSON, the page).

    python benchmarks/bench_trace.py                 # T = 64 and 1,024, 3 rounds, 2 threads
    python benchmarks/bench_trace.py --tokens 64 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from gpt2kit.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import report as trace_report
from gpt2kit.trace import trace

LIMITS = {64: 2.0, 1024: 20.0}  # report seconds beyond the forward pass allowed, gpt2 124M


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
                     ("attribution", tr.direct_logit_attribution), ("heads", tr.attention_summary),
                     ("walk", lambda: trace_report.walkthrough(tr, len(ids) - 1))):
        t0 = time.perf_counter()
        fn()
        parts[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tr.to_html()  # the views above are cached now: what is left is the page itself
    parts["rest"] = time.perf_counter() - t0
    return parts


def report_gflop(model, tok, ids) -> float:
    """The report's matrix-product work, counted on a fresh trace."""
    tr = trace(model, tok, ids)
    with FlopCounterMode(display=False) as counter:
        tr.to_html()
    return counter.get_total_flops() / 1e9


def measure(model, tok, T: int, rounds: int) -> dict:
    ids = torch.randint(0, model.config.n_vocab, (T,)).tolist()
    times: dict[str, list[float]] = {"forward": [], "trace": [], "report": [], "cpu": []}
    size = 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        with torch.no_grad():
            model(torch.tensor([ids]))
        t1 = time.perf_counter()
        tr = trace(model, tok, ids)
        t2, c2 = time.perf_counter(), time.process_time()
        size = len(tr.to_html().encode("utf-8"))
        t3, c3 = time.perf_counter(), time.process_time()
        del tr
        times["forward"].append(t1 - t0)
        times["trace"].append(t2 - t1)
        times["report"].append(t3 - t2)
        times["cpu"].append(c3 - c2)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"T": T, **med, "size": size, "gflop": report_gflop(model, tok, ids), "parts": breakdown(model, tok, ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2.from_name("gpt2").eval()
    tok = Tokenizer.default()
    load0 = _load()
    rows = [measure(model, tok, T, args.rounds) for T in args.tokens]
    print(f"machine: {describe_cpu()}; torch {torch.__version__}, {args.threads} threads; gpt2 (124M), float32; "
          f"{args.rounds} rounds, medians")
    print(f"load average before/after: {load0} / {_load()}")
    print(f"{'T':>5} {'forward s':>10} {'trace s':>8} {'report s':>9} {'limit s':>9} {'CPU s':>7} "
          f"{'CPU s/threads':>14} {'work GFLOP':>11} {'HTML MB':>8}")
    for r in rows:
        limit = f"{LIMITS[r['T']]:.0f}" if r["T"] in LIMITS else "-"
        print(f"{r['T']:>5} {r['forward']:>10.2f} {r['trace']:>8.2f} {r['report']:>9.2f} {limit:>9} "
              f"{r['cpu']:>7.2f} {r['cpu'] / args.threads:>14.2f} {r['gflop']:>11.1f} {r['size'] / 2**20:>8.2f}")
    names = list(rows[0]["parts"])
    print("\nwhere the report's time goes (s, one round):")
    print(f"{'T':>5} " + " ".join(f"{n:>11}" for n in names))
    for r in rows:
        print(f"{r['T']:>5} " + " ".join(f"{r['parts'][n]:>11.2f}" for n in names))


if __name__ == "__main__":
    main()
