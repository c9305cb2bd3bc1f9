"""Decoding methods side by side: prompt lookup vs plain greedy, beam search vs transformers, and
(with --draft-model) draft-model speculation vs the target's plain greedy.

    python benchmarks/bench_decoding.py [--model gpt2 | --model DIR] [--draft-model D --target T]
                                        [--prompt-data DIR] [--edit MODULE:FUNCTION:OLD:NEW[,...]]
                                        [--beam-model random[:PRESET] | DIR] [--random-dir DIR]
                                        [--rows lookup,beams,draft] [--threads N] [--quick]

--model is a published name or a trained model directory (an HF directory, as `gpt2kit train` and
`save_model` write it); the beam row's weights are --beam-model's (transformers reads the same
directory for its side).

1. prompt lookup (the aim: >= 2x plain greedy) on code-editing tasks, where the output
   repeats most of the input: functions from the standard library (--edit MODULE:FUNCTION:OLD:NEW,
   a comma list; default EDITS, the modules edit_corpus.py never trains on), each read from this
   Python's own library, docstring left out so it fits a small context, then "# The same function
   with `OLD` renamed to `NEW`:" and its def line renamed (whole words); the model writes the rest.
   gpt2kit greedy vs gpt2kit greedy with prompt_lookup=10 over the edits one after another (the
   tokens are checked equal); as many new tokens as each renamed body, within the context. The note
   gives the acceptance, the share of greedy's tokens that are the renamed function's (position by
   position) and how many edits came out exact (a model that writes something else, e.g. runs of
   spaces, is not measuring copying).
2. beam search (target: >= 1.5x transformers): 4 beams, 2 prompts, 48 new tokens, gpt2kit vs
   transformers' generate(num_beams=4, early_stopping=False, length_penalty=1.0) on the same weights,
   both loading one directory: --beam-model DIR, or (default) `random`: GPT-2 124M-shaped random
   weights (seed 0) saved once to --random-dir and reused (`random:PRESET` for another preset's
   shape). Neither side has a stop token (gpt2kit stop_token_ids=(), transformers eos_token_id=None),
   so every beam runs all 48 tokens whatever the weights; the sequences are checked equal.
3. with --draft-model D (and --target T, default --model): T's greedy vs T with D drafting
   (draft_tokens 4), at batch 1 and batch 8, with the acceptance rate (target: >= 1.5x where the
   acceptance is >= 60%; the tokens are checked equal). The prompts: with --prompt-data DIR, 8
   windows of 64 tokens spread over DIR's validation shards (text neither model trained on, for a
   draft and a target trained by `gpt2kit train` on DIR); batch 1 runs them one after another,
   batch 8 all at once. Without it, one English prompt (batch 8: eight copies). The note says how
   many of the greedy tokens are single spaces (runs of them are easy for a draft to agree on).

--rows picks the rows (lookup, beams, draft; default all, draft only with --draft-model), e.g. a
trained pair: --model T --draft-model D --prompt-data DIR --edit getpass:getuser:user:login
--rows lookup,draft (getpass is in the validation split of docs/training.md's stdlib data). --model
is loaded only for the lookup row (and the draft row without --target).

--quick: one trial of each and a few tokens (checks the script runs; not figures).
Each row: the peer's tokens/s, ours, the ratio (ours / peer), best of alternating quiet trials.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import textwrap

import torch

from gpt2kit.bench.timing import time_alternating
from gpt2kit.checkpoint import load_model, load_tokenizer
from gpt2kit.config import EOT_ID
from gpt2kit.generation import generate
from gpt2kit.machine import describe_cpu
from gpt2kit.sampling import SamplingSettings

EDITS = ("textwrap:indent:prefix:margin", "fnmatch:filter:name:item", "colorsys:hls_to_rgb:m2:upper",
         "getpass:getuser:user:login")  # edit_corpus.py never reads these modules
LOOKUP = 10  # prompt_lookup's draft tokens


def function_source(lines: list[str], node: ast.FunctionDef) -> str:
    """The source of the function `node` of a module whose source is `lines`, without its docstring
    (and the blank line after it) and dedented (a method reads as a top-level function)."""
    out = lines[node.lineno - 1:node.end_lineno]
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        rest = out[first.end_lineno - node.lineno + 1:]
        while rest and not rest[0].strip():  # the blank line that followed the docstring
            rest = rest[1:]
        out = out[:first.lineno - node.lineno] + rest
    return textwrap.dedent("\n".join(out))


def stdlib_function(module: str, name: str) -> str:
    """The source of module's top-level function `name` as this Python's library has it (read
    from the module's file, so a C accelerator of the same name does not hide it), without its
    docstring."""
    src = inspect.getsource(importlib.import_module(module))
    node = next((n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise SystemExit(f"--edit: {module} has no top-level function {name}")
    return function_source(src.splitlines(), node)


def rename(text: str, old: str, new: str) -> str:
    """text with every whole-word `old` replaced by `new` (`prefix` renamed leaves `prefixed` alone)."""
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def edit_prompt(source: str, old: str, new: str) -> tuple[str, str]:
    """(prompt, the rest of the edit done right): the function, the comment naming the rename and the
    renamed def line; then the renamed function after its def line (edit_corpus.py trains on this)."""
    head, _, body = rename(source, old, new).partition("\n")
    return f"{source}\n\n\n# The same function with `{old}` renamed to `{new}`:\n{head}\n", body


def edit_task(spec: str) -> tuple[str, str]:
    """(prompt, the renamed function's source after its def line) of the code-editing task
    MODULE:FUNCTION:OLD:NEW."""
    try:
        module, name, old, new = spec.split(":")
    except ValueError:
        raise SystemExit(f"--edit takes MODULE:FUNCTION:OLD:NEW, got {spec!r}") from None
    source = stdlib_function(module, name)
    if not re.search(rf"\b{re.escape(old)}\b", source):
        raise SystemExit(f"--edit: {old!r} does not occur in {module}.{name}")
    return edit_prompt(source, old, new)


def _row(name: str, peer: float, ours: float, note: str = "") -> str:
    return f"| {name} | {peer:.1f} | {ours:.1f} | {ours / peer:.2f}x | {note} |"


def bench_prompt_lookup(model, tok, specs: list[str], trials: int, cap: int | None) -> str:
    """The code edits of `specs` one after another, greedy vs greedy with prompt lookup; each edit runs
    as many new tokens as its renamed body (within the context, at most `cap`)."""
    tasks = []
    for spec in specs:
        prompt, body = edit_task(spec)
        ids, want = tok.encode(prompt), tok.encode(body)
        room = model.config.n_ctx - len(ids) - LOOKUP  # prompt lookup keeps the whole sequence in the context
        n = min(len(want), room, cap or room)
        if n < 1:
            raise SystemExit(f"--edit {spec}: the prompt ({len(ids)} tokens) leaves no room in n_ctx="
                             f"{model.config.n_ctx}; choose a shorter function")
        tasks.append((ids, want[:n], SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=()),
                      SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=(), prompt_lookup=LOOKUP)))
    a = [generate(model, [ids], plain)[0] for ids, _, plain, _ in tasks]
    b = [generate(model, [ids], looked)[0] for ids, _, _, looked in tasks]
    same = [x.tokens for x in a] == [y.tokens for y in b]
    total = sum(len(want) for _, want, _, _ in tasks)
    pairs = [(c.tokens, want) for c, (_, want, _, _) in zip(a, tasks, strict=True)]
    right = sum(x == y for got, want in pairs for x, y in zip(got, want, strict=True))
    whole = sum(got == want for got, want in pairs)
    rate = sum(c.accepted for c in b) / max(1, sum(c.drafted for c in b))
    t = time_alternating({"plain": lambda: [generate(model, [ids], plain) for ids, _, plain, _ in tasks],
                          "lookup": lambda: [generate(model, [ids], looked) for ids, _, _, looked in tasks]},
                         trials, 4 * trials)
    note = (f"acceptance {100 * rate:.0f}%, tokens equal: {same}, {100 * right / total:.0f}% of the greedy tokens "
            f"are the renamed function's (position by position), {whole} of {len(tasks)} edits exact")
    names = ", ".join(s.split(":")[1] for s in specs)
    return _row(f"prompt lookup {LOOKUP} vs plain greedy ({len(tasks)} code edits: {names}; {total} tokens)",
                total / t["plain"].seconds, total / t["lookup"].seconds, note)


RANDOM = "random"  # --beam-model: a preset's shape with random weights (seed 0), saved once


def beam_model_dir(spec: str, random_dir: str | None) -> str:
    """The directory (or published name) the beam row's two sides load: spec itself, or for
    "random" / "random:PRESET" (default preset gpt2, i.e. GPT-2 124M's shape) random weights of
    seed 0 written once to random_dir (default: a directory under the system's temporary one) and
    reused while their config is the preset's."""
    if spec != RANDOM and not spec.startswith(RANDOM + ":"):
        return spec
    import json
    import tempfile
    from pathlib import Path

    from gpt2kit.checkpoint import save_model
    from gpt2kit.config import GPT2Config
    from gpt2kit.model import GPT2

    preset = spec.partition(":")[2] or "gpt2"
    out = Path(random_dir or Path(tempfile.gettempdir()) / f"gpt2kit-bench-{preset}-random-seed0")
    want = GPT2Config.from_name(preset).to_hf()
    try:
        have = json.loads((out / "config.json").read_text())
        if all(have.get(k) == want[k] for k in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")):
            return str(out)
    except (OSError, ValueError):
        pass
    torch.manual_seed(0)
    save_model(GPT2.from_name(preset), out)
    return str(out)


BEAM_PROMPTS = [[464, 3290, 286, 1204, 318], [7454, 2402, 257, 640, 11, 612, 373]]


def beam_sides(model, model_dir: str, n: int, nb: int = 4, prompts: list[list[int]] = BEAM_PROMPTS):
    """(ours, theirs): gpt2kit's and transformers' beam search on the same weights (model_dir, which
    `model` was loaded from), nb beams, n new tokens per prompt, every beam run to the full length:
    no stop token on either side (gpt2kit: stop_token_ids=(); transformers: eos_token_id None), so
    early_stopping (False on both, transformers' default) never ends a search early. Each returns
    a list of the prompts' best sequences (new tokens only)."""
    from transformers import GenerationConfig, GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    T = max(map(len, prompts))
    ids = torch.tensor([[EOT_ID] * (T - len(p)) + p for p in prompts])  # (B, T) left-padded
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in prompts])[:, None]).long()
    gc = GenerationConfig(num_beams=nb, max_new_tokens=n, do_sample=False, early_stopping=False,
                          length_penalty=1.0, eos_token_id=None, bos_token_id=EOT_ID, pad_token_id=EOT_ID)
    s = SamplingSettings(max_new_tokens=n, num_beams=nb, early_stopping=False, length_penalty=1.0,
                         stop_token_ids=())

    def theirs():
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=gc)  # (B, T + n)
        return [row[T:].tolist() for row in out]

    def ours():
        return [c.tokens for c in generate(model, prompts, s)]

    return ours, theirs


def bench_beams(model_spec: str, random_dir: str | None, trials: int, n: int = 48, nb: int = 4) -> str:
    model_dir = beam_model_dir(model_spec, random_dir)
    ours, theirs = beam_sides(load_model(model_dir), model_dir, n, nb)
    a, b = ours(), theirs()
    same = a == b and all(len(x) == n for x in a)
    t = time_alternating({"hf": theirs, "ours": ours}, trials, 4 * trials)
    total = n * len(BEAM_PROMPTS)
    return _row(f"beam search {nb} beams, {len(BEAM_PROMPTS)} prompts x {n} tokens vs transformers "
                f"({model_spec})", total / t["hf"].seconds, total / t["ours"].seconds,
                f"sequences equal: {same}, no stop token on either side (every beam runs {n} tokens)")


DRAFT_TOKENS, WINDOW, WINDOWS = 4, 64, 8  # draft rows: draft_tokens; --prompt-data's windows
SPACE = 220  # GPT-2's " ": one token per space of indentation
SEED = 1234  # the sampled draft row's


def draft_prompts(tok, data: str | None) -> list[list[int]]:
    """The draft rows' prompts: WINDOWS windows of WINDOW tokens spread evenly over the validation
    shards of the data directory `data` (none starting inside <|endoftext|>), or one English prompt."""
    if data is None:
        return [tok.encode("The history of the city begins")]
    import numpy as np

    from gpt2kit.data import find_shards, read_shard

    val = np.concatenate([np.asarray(read_shard(f)) for f in find_shards(data, "val")])
    if len(val) < WINDOWS * WINDOW:
        raise SystemExit(f"--prompt-data {data}: {len(val)} validation tokens, fewer than {WINDOWS} x {WINDOW}")
    step = (len(val) - WINDOW) // WINDOWS
    return [[int(t) for t in val[i * step:i * step + WINDOW] if t != EOT_ID] for i in range(WINDOWS)]


def bench_draft(target, draft, prompts: list[list[int]], trials: int, n: int = 96) -> list[str]:
    longest = max(map(len, prompts))
    if longest + n + DRAFT_TOKENS > target.config.n_ctx:
        n = target.config.n_ctx - longest - DRAFT_TOKENS
        if n < 1:
            raise SystemExit(f"the draft rows' prompts ({longest} tokens) leave no room in n_ctx={target.config.n_ctx}")
    plain = SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=())
    spec = SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=(), draft_tokens=DRAFT_TOKENS)
    rows = []
    for batch in (1, 8):
        groups = [[p] for p in prompts] if batch == 1 else [[prompts[i % len(prompts)] for i in range(batch)]]
        want = [c.tokens for g in groups for c in generate(target, g, plain)]
        out = [c for g in groups for c in generate(target, g, spec, draft_model=draft)]
        same = [c.tokens for c in out] == want
        rate = sum(c.accepted for c in out) / max(1, sum(c.drafted for c in out))
        t = time_alternating({"plain": lambda gs=groups: [generate(target, g, plain) for g in gs],
                              "spec": lambda gs=groups: [generate(target, g, spec, draft_model=draft) for g in gs]},
                             trials, 4 * trials)
        tokens = sum(len(c.tokens) for c in out)
        spaces = sum(t == SPACE for w in want for t in w) / max(1, sum(map(len, want)))  # agreement on spaces is easy
        how = f"{len(groups)} prompts one at a time" if batch == 1 and len(groups) > 1 else f"batch {batch}"
        rows.append(_row(f"draft model, {DRAFT_TOKENS} draft tokens, {how}, {n} tokens each vs plain greedy",
                         tokens / t["plain"].seconds, tokens / t["spec"].seconds,
                         f"acceptance {100 * rate:.0f}%, tokens equal: {same}, {100 * spaces:.0f}% of the "
                         "greedy tokens are single spaces"))
    rows.append(_sampled_draft_row(target, draft, prompts, trials, n))
    return rows


def _sampled_draft_row(target, draft, prompts: list[list[int]], trials: int, n: int) -> str:
    """Speculative sampling (temperature 1, seeded; the rejection rule keeps the target's distribution)
    against plain sampling, the prompts one at a time: text that greedy's runs of spaces do not make
    easy to draft. The tokens differ from plain sampling's (the draws are used differently), so the
    rate is over each side's own tokens."""
    plain = SamplingSettings(max_new_tokens=n, temperature=1.0, seed=SEED, stop_token_ids=())
    spec = SamplingSettings(max_new_tokens=n, temperature=1.0, seed=SEED, stop_token_ids=(), draft_tokens=DRAFT_TOKENS)
    out = [c for p in prompts for c in generate(target, [p], spec, draft_model=draft)]
    mine = [c for p in prompts for c in generate(target, [p], plain)]
    rate = sum(c.accepted for c in out) / max(1, sum(c.drafted for c in out))
    t = time_alternating({"plain": lambda: [generate(target, [p], plain) for p in prompts],
                          "spec": lambda: [generate(target, [p], spec, draft_model=draft) for p in prompts]},
                         trials, 4 * trials)
    n_plain, n_spec = sum(len(c.tokens) for c in mine), sum(len(c.tokens) for c in out)
    spaces = sum(t == SPACE for c in out for t in c.tokens) / max(1, n_spec)
    return _row(f"draft model, {DRAFT_TOKENS} draft tokens, sampled (temperature 1, seed {SEED}), "
                f"{len(prompts)} prompts one at a time, {n} tokens each vs plain sampling",
                n_plain / t["plain"].seconds, n_spec / t["spec"].seconds,
                f"acceptance {100 * rate:.0f}%, {100 * spaces:.0f}% of the sampled tokens are single spaces")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2", help="a published name or a trained model directory")
    ap.add_argument("--target", default=None, help="the target of --draft-model (default --model)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompt-data", default=None, metavar="DIR",
                    help="the draft rows' prompts from this data directory's validation shards (gpt2kit prepare's)")
    ap.add_argument("--edit", default=",".join(EDITS), metavar="MODULE:FUNCTION:OLD:NEW[,...]",
                    help="the code-editing tasks of the prompt-lookup row, a comma list (default: "
                         "edit_corpus.py's held-out edits, " + ",".join(EDITS) + ")")
    ap.add_argument("--beam-model", default=RANDOM, metavar="M",
                    help="the beam row's weights: a model directory or published name, or random[:PRESET] "
                         "(default: GPT-2 124M's shape, random weights of seed 0, saved once to --random-dir)")
    ap.add_argument("--random-dir", default=None, metavar="DIR",
                    help="where --beam-model random's weights are saved and reused (default: under the temp dir)")
    ap.add_argument("--rows", default="lookup,beams,draft", help="comma list of lookup, beams, draft (default all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one trial, a few tokens: check that it runs")
    args = ap.parse_args()
    which = set(args.rows.split(","))
    if not which or which - {"lookup", "beams", "draft"}:
        raise SystemExit(f"--rows takes a comma list of lookup, beams, draft, got {args.rows!r}")
    if "draft" in which and args.rows != ap.get_default("rows") and not args.draft_model:
        raise SystemExit("--rows draft needs --draft-model")
    if args.threads:
        torch.set_num_threads(args.threads)
    trials = 1 if args.quick else args.trials
    rows = []
    if "lookup" in which or ("draft" in which and args.draft_model and not args.target):
        model, tok = load_model(args.model), load_tokenizer(args.model)
    if "lookup" in which:
        rows.append(bench_prompt_lookup(model, tok, args.edit.split(","), trials, 16 if args.quick else None))
    if "beams" in which:
        rows.append(bench_beams(args.beam_model, args.random_dir, trials, 8 if args.quick else 48))
    if "draft" in which and args.draft_model:
        target = load_model(args.target) if args.target else model
        prompts = draft_prompts(load_tokenizer(args.target or args.model), args.prompt_data)
        rows += bench_draft(target, load_model(args.draft_model), prompts, trials, 8 if args.quick else 96)
    print(f"machine: {describe_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| case | peer tokens/s | gpt2kit tokens/s | ratio | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
