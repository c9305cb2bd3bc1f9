"""The quality of int8 activations against float32 and weight-only int8, on a trained model.

    python benchmarks/bench_int8act_quality.py MODEL DATA [--windows 32] [--prompts 16] [--new 32]

MODEL is a float checkpoint (e.g. a `gpt2kit train` output), DATA a directory of prepared shards
(its val_*.bin: held-out text the model was not trained on). For float32, weight-only int8 (LM head
quantized) and int8 activations (the same int8 model, gpt2kit.quant.modules.set_activations) it prints:

  held-out loss and perplexity   --windows windows of n_ctx tokens spread evenly over the val tokens,
                                 every next-token position scored (teacher-forced)
  next-token agreement, KL       on the same positions: the argmax equal to float32's, mean
                                 KL(float32 || mode) in nats, the largest |logit - float32 logit|
  greedy agreement               --prompts prompts of 32 val tokens, --new greedy tokens each by
                                 gpt2kit.generation: the share of generated tokens equal to float32's
                                 at the same position, and how many continuations are identical

then the gate of gpt2kit.quant.gate (int8 activations against weight-only, LIMITS) on its own windows
(quant_gate.read_windows of DATA), as `--int8-activations --gate-data DATA` would measure it. Quality
only: no timings. docs/quantization.md has the figures of a trained model.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch


def held_out(model, windows: torch.Tensor, ref_logits: list[torch.Tensor] | None) -> tuple[dict, list[torch.Tensor]]:
    """Loss, perplexity and, against `ref_logits` (float32's, per window), agreement, KL and max |Δ logit|."""
    nll = n = agree = kl = 0.0
    worst = 0.0
    kept = []
    with torch.inference_mode():
        for i, w in enumerate(windows):
            logits = model(w[None]).logits.float()[0, :-1]  # (T - 1, V)
            kept.append(logits)
            lp = torch.log_softmax(logits, -1)
            nll -= lp.gather(-1, w[1:, None]).sum().item()
            n += len(w) - 1
            if ref_logits is not None:
                ref = ref_logits[i]
                lr = torch.log_softmax(ref, -1)
                agree += (ref.argmax(-1) == logits.argmax(-1)).sum().item()
                kl += (lr.exp() * (lr - lp)).sum().item()
                worst = max(worst, (logits - ref).abs().max().item())
    out = {"loss": nll / n, "ppl": math.exp(nll / n), "positions": int(n)}
    if ref_logits is not None:
        out.update(agree=agree / n, kl=kl / n, max_dlogit=worst)
    return out, kept


def greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    from gpt2kit.generation import generate
    from gpt2kit.sampling import SamplingSettings

    settings = SamplingSettings(temperature=0, max_new_tokens=new, stop_token_ids=())
    return [c.tokens for c in generate(model, prompts, settings)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("data")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from gpt2kit.checkpoint import load_model, load_tokenizer
    from gpt2kit.data.shard import find_shards, read_shard
    from gpt2kit.decode import int8act
    from gpt2kit.machine import describe_cpu
    from gpt2kit.quant.gate import LIMITS, activation_gate, describe, read_windows, windows_of
    from gpt2kit.quant.modules import quantize_model, set_activations

    f32 = load_model(args.model).eval()
    cfg = f32.config
    tokens = torch.cat([torch.from_numpy(read_shard(s).astype("int64")) for s in find_shards(args.data, "val")])
    windows = windows_of(tokens, cfg.n_ctx, count=args.windows, length=cfg.n_ctx)
    starts = torch.linspace(0, len(tokens) - 33, args.prompts).long().tolist()
    prompts = [tokens[s:s + 32].tolist() for s in starts]
    w8 = quantize_model(copy.deepcopy(f32), "int8", lm_head=True)
    a8 = set_activations(quantize_model(copy.deepcopy(f32), "int8", lm_head=True), "int8")

    print(f"machine: {describe_cpu()}; model {args.model} ({cfg.n_layer} layers, n_embd {cfg.n_embd}, n_ctx "
          f"{cfg.n_ctx}); held-out: {len(windows)} windows of {windows.shape[1]} tokens from {args.data} val")
    base, ref = held_out(f32, windows, None)
    want = greedy(f32, prompts, args.new)
    print("\n| mode | held-out loss | perplexity | rise vs float32 | next-token agreement | mean KL, nats "
          "| max abs. logit error | greedy tokens equal | continuations identical |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    print(f"| float32 | {base['loss']:.4f} | {base['ppl']:.3f} | — | — | — | — | — | — |")
    for name, model in (("int8 weight-only", w8), ("int8 activations", a8)):
        r, _ = held_out(model, windows, ref)
        got = greedy(model, prompts, args.new)
        same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        whole = sum(g == w for g, w in zip(got, want, strict=True))
        print(f"| {name} | {r['loss']:.4f} | {r['ppl']:.3f} | {r['ppl'] / base['ppl'] - 1:+.2%} | {r['agree']:.2%} "
              f"| {r['kl']:.2e} | {r['max_dlogit']:.3f} | {same / (len(prompts) * args.new):.2%} "
              f"| {whole}/{len(prompts)} |")
    print(f"\n({base['positions']:,} next-token positions; {len(prompts)} prompts x {args.new} greedy tokens; "
          f"int8-activation kernels chosen: {int8act.chosen()})")
    gate = activation_gate(w8, read_windows(args.data, load_tokenizer(args.model), cfg.n_ctx, cfg.n_vocab))
    print(f"gate (quant_gate, limits {LIMITS}): {'passed' if gate['passed'] else 'FAILED'}: {describe(gate)}")


if __name__ == "__main__":
    main()
