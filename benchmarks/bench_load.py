"""Batch-1 decode idle and under load: does a kernel choice collapse when other processes want the cores?

    python benchmarks/bench_load.py [--busy 0 2] [--trials 5] [--new-tokens 64] [--size gpt2]

On a loaded machine (more runnable threads than cores) a native kernel call that splits its columns
between two threads waits for the one the OS has not scheduled: csrc/solo.h sends the following
calls to one thread while starts are late. This script measures what that buys and what it costs.
Contenders, each a process of its own on --threads threads over one random-weight model (seed 0):

  float32            gpt2kit's float32 default (its stored kernel choice, the native kernel where it won)
  float32-nosolo     the same with the fallback off (GPT2KIT_NATIVE_LATE_US=-1)
  float32-torch      PyTorch's product (GPT2KIT_F32_KERNEL=torch: one thread for a single row)
  int8, int8-nosolo  int8 weights (quantize_model), with and without the fallback

For each --busy count (processes spinning `while True: pass` beside the run), the trials alternate
between the contenders; the table gives the median and the worst tok/s, and for the fallback's
contenders the share of kernel calls it sent to one thread and the latest-start histogram
(gpt2kit.decode.native.solo_stats). The machine is named through gpt2kit.machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONTENDERS = {
    "float32": ("float32", {}),
    "float32-nosolo": ("float32", {"GPT2KIT_NATIVE_LATE_US": "-1"}),
    "float32-torch": ("float32", {"GPT2KIT_F32_KERNEL": "torch"}),
    "int8": ("int8", {}),
    "int8-nosolo": ("int8", {"GPT2KIT_NATIVE_LATE_US": "-1"}),
}
PROMPT = 16


def _worker(path: str, dtype: str, threads: int) -> None:
    """Answer "N" on stdin with one decode of N tokens: {"seconds", "stats"} on stdout."""
    import torch

    from gpt2kit import load_model
    from gpt2kit.decode import native
    from gpt2kit.generation import SamplingSettings, generate
    from gpt2kit.quant.modules import quantize_model

    torch.set_num_threads(threads)
    model = load_model(path)
    if dtype == "int8":
        model = quantize_model(model, "int8")
    prompt = [[(13 * i + 5) % 50000 for i in range(PROMPT)]]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        settings = SamplingSettings(temperature=0, max_new_tokens=int(line), stop_token_ids=())
        t0 = time.perf_counter()
        generate(model, prompt, settings)
        seconds = time.perf_counter() - t0
        stats = {lib: native.solo_stats(lib) for lib in ("f32_linear", "int8_linear")}
        print(json.dumps({"seconds": seconds, "stats": stats}), flush=True)


class Worker:
    def __init__(self, name: str, path: Path, threads: int):
        dtype, env = CONTENDERS[name]
        env = {**{k: v for k, v in os.environ.items() if k not in ("GPT2KIT_NATIVE_LATE_US", "GPT2KIT_F32_KERNEL")},
               **env, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--_worker", str(path), dtype, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.name, self.lib = name, "int8_linear" if dtype == "int8" else "f32_linear"
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker failed (exit {self.proc.wait()})")
        return json.loads(line)

    def trial(self, n: int) -> dict:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {"calls": 0, "solo_calls": 0, "late_starts": 0, "start_delay": {}}
    return {"calls": after["calls"] - before["calls"], "solo_calls": after["solo_calls"] - before["solo_calls"],
            "late_starts": after["late_starts"] - before["late_starts"],
            "start_delay": {k: v - before["start_delay"].get(k, 0) for k, v in after["start_delay"].items()}}


def run(busy: list[int], trials: int, new_tokens: int, threads: int, size: str, contenders: list[str],
        log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    from bench_peers import save_checkpoint

    from gpt2kit.machine import describe_cpu

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpt2kit-bench-load-") as tmp:
        path = save_checkpoint(Path(tmp) / "model", size)
        workers = [Worker(name, path, threads) for name in contenders]
        for w in workers:
            w.trial(4)  # warm-up: kernels built and chosen, first allocations
        for n_busy in busy:
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n_busy)]
            try:
                time.sleep(1.0 if n_busy else 0.0)
                load = [open("/proc/loadavg").read().split()[0]]
                seconds = {w.name: [] for w in workers}
                first = {w.name: w.trial(1)["stats"][w.lib] for w in workers}
                last = dict(first)
                for t in range(trials):
                    for w in workers:
                        out = w.trial(new_tokens)
                        seconds[w.name].append(out["seconds"])
                        last[w.name] = out["stats"][w.lib]
                    log(f"busy {n_busy} trial {t + 1}/{trials}: "
                        + ", ".join(f"{k} {new_tokens / v[-1]:.1f}" for k, v in seconds.items()))
                load.append(open("/proc/loadavg").read().split()[0])
            finally:
                for s in spinners:
                    s.kill()
                    s.wait()
            for w in workers:
                rates = [new_tokens / s for s in seconds[w.name]]
                rows.append({"busy": n_busy, "contender": w.name, "median_tok_s": statistics.median(rates),
                             "worst_tok_s": min(rates), "best_tok_s": max(rates), "load": load,
                             "solo": _delta(last[w.name], first[w.name])})
        for w in workers:
            w.close()
    return {"rows": rows, "machine": describe_cpu(), "threads": threads, "new_tokens": new_tokens, "trials": trials,
            "size": size}


def format_table(r: dict) -> str:
    lines = [f"batch-1 greedy decode, {r['new_tokens']} new tokens, {r['threads']} threads, {r['size']} random "
             f"weights, {r['trials']} alternating trials; machine: {r['machine']}", "",
             "| busy processes | contender | median tok/s | worst | best | calls on one thread | latest start "
             "(<10/<50/<100/<250/<1000/>=1000 us) | load 1-min |",
             "|--:|---|--:|--:|--:|--:|---|---|"]
    for row in r["rows"]:
        solo = row["solo"]
        share = f"{solo['solo_calls'] / max(solo['calls'], 1):.0%}" if solo else "—"
        hist = "/".join(str(v) for v in solo["start_delay"].values()) if solo else "—"
        lines.append(f"| {row['busy']} | {row['contender']} | {row['median_tok_s']:.1f} | {row['worst_tok_s']:.1f} | "
                     f"{row['best_tok_s']:.1f} | {share} | {hist} | {' -> '.join(row['load'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        _worker(argv[1], argv[2], int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="busy processes beside the run, per round")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", default="gpt2")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if any(b < 0 for b in a.busy) or a.trials < 1 or a.new_tokens < 1 or a.threads < 1:
        p.error("--busy must be >= 0, --trials, --new-tokens and --threads >= 1")
    r = run(a.busy, a.trials, a.new_tokens, a.threads, a.size, a.contenders)
    print(format_table(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
