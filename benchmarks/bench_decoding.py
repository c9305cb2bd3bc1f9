"""Decoding methods side by side: prompt lookup vs plain greedy, beam search vs transformers, and
(with --draft-model) draft-model speculation vs the target's plain greedy.

    python benchmarks/bench_decoding.py [--model gpt2] [--draft-model D --target T] [--threads N]

1. prompt lookup (issue 22's target: >= 2x plain greedy): a code-editing task — a function, then
   "the same function with `total` renamed to `acc`" — where the output repeats most of the input;
   gpt2kit greedy vs gpt2kit greedy with prompt_lookup=10 (the tokens are checked equal).
2. beam search (target: >= 1.5x transformers): 4 beams, 2 prompts, 48 new tokens, gpt2kit vs
   transformers' generate(num_beams=4) on the same weights (the sequences are checked equal).
3. with --draft-model D (and --target T, default --model): T's greedy vs T with D drafting
   (draft_tokens 4), at batch 1 and batch 8, with the acceptance rate (target: >= 1.5x where the
   acceptance is >= 60%).

Each row: the peer's tokens/s, ours, the ratio (ours / peer), best of alternating quiet trials.
"""

from __future__ import annotations

import argparse

import torch

from gpt2kit.bench.machine import describe_cpu
from gpt2kit.bench.timing import time_alternating
from gpt2kit.checkpoint import load_model, load_tokenizer
from gpt2kit.generate import generate
from gpt2kit.sampling import SamplingSettings

CODE = '''def summarize(orders, tax_rate):
    """Total, average and largest order of a list of (name, price, quantity) tuples."""
    total = 0.0
    largest = None
    for name, price, quantity in orders:
        cost = price * quantity * (1 + tax_rate)
        total += cost
        if largest is None or cost > largest[1]:
            largest = (name, cost)
    average = total / len(orders) if orders else 0.0
    print(f"total: {total:.2f}, average: {average:.2f}")
    return total, average, largest


# The same function with `total` renamed to `acc`:
def summarize(orders, tax_rate):
'''


def _row(name: str, peer: float, ours: float, note: str = "") -> str:
    return f"| {name} | {peer:.1f} | {ours:.1f} | {ours / peer:.2f}x | {note} |"


def bench_prompt_lookup(model, tok, trials: int) -> str:
    ids = [tok.encode(CODE)]
    n = 120
    plain = SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=())
    looked = SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=(), prompt_lookup=10)
    a, b = generate(model, ids, plain), generate(model, ids, looked)
    same = a[0].tokens == b[0].tokens
    t = time_alternating({"plain": lambda: generate(model, ids, plain),
                          "lookup": lambda: generate(model, ids, looked)}, trials, 4 * trials)
    note = f"acceptance {100 * b[0].acceptance_rate:.0f}%, tokens equal: {same}"
    return _row("prompt lookup 10 vs plain greedy (code edit, 120 tokens)", n / t["plain"].seconds,
                n / t["lookup"].seconds, note)


def bench_beams(model, model_name: str, trials: int) -> str:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_name).eval()
    prompts = [[464, 3290, 286, 1204, 318], [7454, 2402, 257, 640, 11, 612, 373]]
    n, nb = 48, 4
    T = max(map(len, prompts))
    ids = torch.tensor([[50256] * (T - len(p)) + p for p in prompts])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in prompts])[:, None]).long()

    def theirs():
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, num_beams=nb, max_new_tokens=n, do_sample=False,
                               pad_token_id=50256)

    s = SamplingSettings(max_new_tokens=n, num_beams=nb)
    ours = generate(model, prompts, s)
    same = all(c.tokens == row[T:T + len(c.tokens)].tolist() for c, row in zip(ours, theirs(), strict=True))
    t = time_alternating({"hf": theirs, "ours": lambda: generate(model, prompts, s)}, trials, 4 * trials)
    total = n * len(prompts)
    return _row(f"beam search {nb} beams, {len(prompts)} prompts x {n} tokens vs transformers",
                total / t["hf"].seconds, total / t["ours"].seconds, f"sequences equal: {same}")


def bench_draft(target, draft, tok, trials: int) -> list[str]:
    rows = []
    for batch in (1, 8):
        prompts = [tok.encode("The history of the city begins")] * batch
        n = 96
        plain = SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=())
        spec = SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=(), draft_tokens=4)
        out = generate(target, prompts, spec, draft_model=draft)
        rate = sum(c.accepted for c in out) / max(1, sum(c.drafted for c in out))
        t = time_alternating({"plain": lambda p=prompts, s=plain: generate(target, p, s),
                              "spec": lambda p=prompts, s=spec: generate(target, p, s, draft_model=draft)},
                             trials, 4 * trials)
        rows.append(_row(f"draft model, 4 draft tokens, batch {batch} vs plain greedy", batch * n / t["plain"].seconds,
                         batch * n / t["spec"].seconds, f"acceptance {100 * rate:.0f}%"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--target", default=None, help="the target of --draft-model (default --model)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model), load_tokenizer(args.model)
    rows = [bench_prompt_lookup(model, tok, args.trials), bench_beams(model, args.model, args.trials)]
    if args.draft_model:
        target = load_model(args.target) if args.target else model
        rows += bench_draft(target, load_model(args.draft_model), tok, args.trials)
    print(f"machine: {describe_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| case | peer tokens/s | gpt2kit tokens/s | ratio | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
