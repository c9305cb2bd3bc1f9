"""Before/after on one harness: decode (batch 1 and 8) and prefill tok/s of whichever gpt2kit is
importable, so two builds are measured by the same code. Alternate the builds run by run:

    for i in 1 2 3 4 5; do for d in /tmp/before /path/to/main; do
        (cd $d && PYTHONPATH=src python /path/to/main/benchmarks/bench_ab.py --tag $(basename $d)); done; done

It uses only names public in every build since the int8 kernels (gpt2kit.model.GPT2, generate from
gpt2kit.generation or, in builds before the wings, gpt2kit.generate, gpt2kit.decode.prefill,
gpt2kit.kv_cache.KVCache, quantize_model from gpt2kit.quant). GPT-2 124M random weights, greedy,
16-token prompts, --new-tokens new tokens, best of --trials; prefill of --prefill tokens; `--int8`
quantizes the model first (weight-only, the default mode). One line per run.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpt2kit.config import GPT2Config
from gpt2kit.decode import prefill
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2
from gpt2kit.sampling import SamplingSettings

try:
    from gpt2kit.generation import generate
except ImportError:  # a build before the wings
    from gpt2kit.generate import generate


def best(f, trials: int) -> float:
    f()
    b = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t)
    return b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--int8", action="store_true", help="quantize the model (weight-only int8) first")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = GPT2(GPT2Config()).eval()
    if args.int8:
        from gpt2kit.quant import quantize_model

        quantize_model(model)
    n, out = args.new_tokens, [args.tag]
    for B in (1, 8):
        prompts = torch.randint(0, 50257, (B, 16)).tolist()
        s = SamplingSettings(temperature=0, max_new_tokens=n, stop_token_ids=())
        out.append(f"b{B} {B * n / best(lambda: generate(model, prompts, s), args.trials):.1f}")  # noqa: B023
    ids = torch.randint(0, 50257, (1, args.prefill))
    with torch.inference_mode():
        t = best(lambda: prefill(model, ids, None, KVCache.for_model(model, 1, args.prefill)), args.trials)
    out.append(f"prefill {args.prefill / t:.1f}")
    print(" ".join(out), flush=True)


if __name__ == "__main__":
    main()
