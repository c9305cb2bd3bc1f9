"""Time to first token of a prompt that shares most of its tokens with an earlier one, with the
prefix cache (gpt2kit.prefix_cache) and without, on the server's engine.

Each trial makes a new prompt pair: an earlier prompt (the shared prefix + its own ending) and the
timed prompt (the same prefix + another ending), both --prompt tokens long, sharing --shared. With
the cache (emptied first): the earlier prompt runs (untimed), then the timed prompt's time from
submit to its first token. Without: the timed prompt in an engine without a cache. An untimed
trial first; then the two alternate, trial by trial, so a load that comes and goes hits both; the
first tokens must be equal. Also timed: a prompt sharing nothing with the cache (a miss: it pays
for storing its blocks). The engines are the server's (max batch 8, its prefill chunk, packed
weights), made and warmed up once, before any timing. Weights: GPT-2's init at the chosen preset
(no download).

    python benchmarks/bench_prefix_cache.py [--model gpt2] [--prompt 900] [--shared 850] [--trials 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpt2kit.config import GPT2Config
from gpt2kit.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.prefix_cache import PrefixCache
from gpt2kit.sampling import SamplingSettings
from gpt2kit.serve.engine import serve_engine

GREEDY = SamplingSettings(temperature=0, max_new_tokens=1, stop_token_ids=())


def ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to the row's first token, and that token."""
    row = engine.new_row(prompt, GREEDY)
    t0 = time.perf_counter()
    engine.submit([row])
    while not row.tokens:
        engine.step()
    dt = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    return dt, row.tokens[0]


def _engine(model, cache, max_batch):
    return serve_engine(model, None, max_batch=max_batch, pack_weights=None, prefix_cache=cache)


def run(model: GPT2, prompt: int, shared: int, trials: int, max_batch: int = 8, seed: int = 0
        ) -> dict[str, list[float]]:
    n_vocab = model.config.n_vocab
    gen = torch.Generator().manual_seed(seed)
    cache = PrefixCache(4 * prompt)  # room for both prompts' blocks
    plain, cached = _engine(model, None, max_batch), _engine(model, cache, max_batch)
    times: dict[str, list[float]] = {"without": [], "with": [], "miss": []}
    for trial in range(trials + 1):  # trial 0 warms up (first calls of each shape): not kept
        ids = torch.randint(0, n_vocab, (shared + 3 * (prompt - shared),), generator=gen).tolist()
        head, a, b, c = ids[:shared], ids[shared:][:prompt - shared], ids[prompt:][:prompt - shared], ids[-prompt:]
        dt, want = ttft(plain, head + b)
        times["without"].append(dt)
        cache.clear()
        ttft(cached, head + a)  # leaves the shared prefix in the cache
        dt, got = ttft(cached, head + b)
        if got != want:
            raise AssertionError(f"the first token differs with the cache: {got} != {want}")
        times["with"].append(dt)
        cache.clear()
        times["miss"].append(ttft(cached, c)[0])
        if trial == 0:
            times = {k: [] for k in times}
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", help="the config preset, random weights (default gpt2: 124M)")
    p.add_argument("--prompt", type=int, default=900, help="tokens of each prompt (default 900)")
    p.add_argument("--shared", type=int, default=850, help="tokens the prompts share (default 850)")
    p.add_argument("--trials", type=int, default=3, help="alternated trials (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    if not 0 < a.shared < a.prompt:
        p.error(f"--shared must be in [1, --prompt - 1], got {a.shared}")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name(a.model)).eval()
    t = run(model, a.prompt, a.shared, a.trials)
    print(f"machine: {describe_cpu()}, torch threads {torch.get_num_threads()}")
    print(f"{a.model} random weights, prompt {a.prompt} tokens, {a.shared} shared with an earlier prompt, "
          f"{a.trials} alternated trials")
    print("| case | TTFT per trial (s) | median (s) |")
    print("|---|---|---|")
    for name, label in (("without", "without the cache"), ("with", "with the cache (shared prefix held)"),
                        ("miss", "with the cache, nothing shared (a miss)")):
        print(f"| {label} | {', '.join(f'{x:.3f}' for x in t[name])} | {statistics.median(t[name]):.3f} |")
    ratios = [w / o for w, o in zip(t["with"], t["without"], strict=True)]
    print(f"TTFT with / without, per trial: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}x (target <= 0.25x)")
    print(f"miss / without, median: {statistics.median(t['miss']) / statistics.median(t['without']):.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
