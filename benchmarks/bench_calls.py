"""Python-level calls per decoded token: the interpreter's share of a decode step.

    python benchmarks/bench_calls.py [--layers 12] [--batch 1] [--int8] [--tokens 16] [--top 15]

Builds a random-weight model of GPT-2 124M's shape (12 layers, 768 wide; --small keeps the layer
count but makes it 32 wide, which calls exactly the same functions), generates greedily through
gpt2kit.generate_stream, and counts with cProfile every function call (Python functions and the
C functions they call, as cProfile sees them) made by the decode steps after the first one: each
of those samples a token and feeds it through decode_step. Prints the calls per token, then the
functions called most. Call counts are deterministic (no timing), so this runs anywhere, loaded or
not; tests/test_decode_bind.py asserts a bound on the same count. --marginal counts the way the
decode step's target is stated: batch 1 through gpt2kit.generate, a 150-token run less a 50-token run.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats

import torch

from gpt2kit.config import GPT2Config
from gpt2kit.generation import generate, generate_stream
from gpt2kit.model import GPT2
from gpt2kit.sampling import SamplingSettings


def build(layers: int = 12, small: bool = False, int8: bool = False, seed: int = 0) -> GPT2:
    """A random-weight GPT-2 of 124M's shape (or 32 wide with small), in eval mode."""
    if small:
        cfg = GPT2Config(n_vocab=1000, n_ctx=256, n_embd=32, n_head=4, n_layer=layers)
    else:
        cfg = GPT2Config.from_name("gpt2", n_layer=layers)
    torch.manual_seed(seed)
    model = GPT2(cfg).eval()
    if int8:
        from gpt2kit.quant.modules import quantize_model

        quantize_model(model)
    return model


def profile_decode(model: GPT2, batch: int = 1, tokens: int = 16, settings: SamplingSettings | None = None
                   ) -> pstats.Stats:
    """cProfile's stats of `tokens` decode steps (each feeds a token and samples the next), after the
    first two (prefill, then the first decode forward with the kernel choice, packing and any
    measurement: once per generation), which are not counted. A step hands its token out before the
    forward that feeds it, so the one-off set-up runs in the second step."""
    settings = settings or SamplingSettings(max_new_tokens=tokens + 3, temperature=0, stop_token_ids=())
    prompts = [[(7 * r + i) % model.config.n_vocab for i in range(8)] for r in range(batch)]
    steps = generate_stream(model, prompts, settings)
    next(steps)  # prefill and the first token
    next(steps)  # the first decode forward: kernel choice, packing, measurements (once per generation)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(tokens):
        next(steps)
    prof.disable()
    steps.close()
    return pstats.Stats(prof)


def sampled_settings(max_new_tokens: int) -> SamplingSettings:
    """Sampling with the per-row settings a step reads: temperature, top-k, a logit bias."""
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.9, top_k=40, logit_bias={0: -1.0},
                            stop_token_ids=(), seed=0)


def calls_per_token(model: GPT2, batch: int = 1, tokens: int = 16, settings: SamplingSettings | None = None) -> float:
    return profile_decode(model, batch, tokens, settings).total_calls / tokens


def marginal_calls_per_token(model: GPT2, long: int = 150, short: int = 50,
                             settings: SamplingSettings | None = None) -> float:
    """Calls per decoded token through gpt2kit.generate at batch 1, marginal: a run of `long` tokens
    less one of `short` (each after an uncounted run that makes the one-off choices), over the
    difference, so the prompt's prefill and the set-up cancel."""
    def counted(n: int) -> int:
        s = dataclasses.replace(settings or SamplingSettings(temperature=0, stop_token_ids=()), max_new_tokens=n)
        generate(model, [[5, 6, 7, 8, 9, 10, 11, 12]], s)
        prof = cProfile.Profile()
        prof.enable()
        generate(model, [[5, 6, 7, 8, 9, 10, 11, 12]], s)
        prof.disable()
        return pstats.Stats(prof).total_calls
    return (counted(long) - counted(short)) / (long - short)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--int8", action="store_true", help="quantize the model (gpt2kit.quant.modules) first")
    ap.add_argument("--small", action="store_true", help="32 wide instead of 768 (the same calls)")
    ap.add_argument("--sample", action="store_true",
                    help="sample (temperature 0.9, top-k 40, a logit bias, seed 0) instead of greedy")
    ap.add_argument("--top", type=int, default=15, help="functions to list, by calls")
    ap.add_argument("--marginal", action="store_true",
                    help="at batch 1 through gpt2kit.generate: a 150-token run less a 50-token run")
    args = ap.parse_args()
    model = build(args.layers, args.small, args.int8)
    if args.marginal:
        settings = sampled_settings(1) if args.sample else None
        print(f"{args.layers} layers, batch 1, {'int8' if args.int8 else 'float32'}: "
              f"{marginal_calls_per_token(model, settings=settings):.1f} Python-level calls per decoded token "
              "(marginal: 150 tokens less 50, through gpt2kit.generate)")
        return
    settings = sampled_settings(args.tokens + 3) if args.sample else None
    stats = profile_decode(model, args.batch, args.tokens, settings)
    kind = ("int8" if args.int8 else "float32") + (", sampled" if args.sample else ", greedy")
    print(f"{args.layers} layers, batch {args.batch}, {kind}: {stats.total_calls / args.tokens:.1f} "
          f"Python-level calls per decoded token")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][1])[: args.top]
    for (file, line, name), (_, ncalls, *_rest) in rows:
        where = name if file == "~" else f"{file.rsplit('/', 1)[-1]}:{line}({name})"
        print(f"{ncalls / args.tokens:8.1f}  {where}")


if __name__ == "__main__":
    main()
