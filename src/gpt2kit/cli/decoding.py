"""gpt2kit generate's decoding-method flags that are not SamplingSettings fields (those get their
flags from the dataclass: --prompt-lookup, --draft-tokens, --num-beams, --length-penalty,
--num-return-sequences, --penalty-alpha): the draft model, --early-stopping's three values and
--verbose's acceptance rate; loading the draft, reporting, printing beams. Thin: the work is
gpt2kit.generation's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}
SKIPPED = ("early_stopping",)  # SamplingSettings fields whose flag is here


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None, metavar="M",
                   help="speculative decoding: a smaller GPT-2 with the same tokenizer drafts for --model")
    p.add_argument("--early-stopping", type=_early_stopping, default=False, metavar="{true,false,never}",
                   help="beam search: true: stop once num_beams beams finished; false: once none can improve; never")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="speculative decoding: report the draft acceptance rate on stderr at the end")


def with_early_stopping(args: argparse.Namespace, base):
    """base (the field flags' SamplingSettings) with --early-stopping."""
    return dataclasses.replace(base, early_stopping=args.early_stopping)


def _early_stopping(text: str) -> bool | str:
    if text.lower() not in _EARLY_STOPPING:
        raise argparse.ArgumentTypeError(f"expected true, false or never, got {text!r}")
    return _EARLY_STOPPING[text.lower()]


def load_draft(args: argparse.Namespace, model, tok):
    """--draft-model's model (as --model: --dtype, --device), refused unless it shares --model's
    tokenizer; None without the flag."""
    if args.draft_model is None:
        return None
    from gpt2kit.checkpoint import load_model, load_tokenizer, resolve_source
    from gpt2kit.engine.speculate import check_draft_model

    _, path = resolve_source(args.draft_model)
    if not load_tokenizer(path).same_vocabulary(tok):
        raise ValueError(f"--draft-model {args.draft_model} has another tokenizer than --model {args.model}: "
                         f"a draft model must share the target's vocabulary")
    draft = load_model(path, dtype=args.dtype, device=args.device)
    check_draft_model(model, draft, args.draft_model)
    return draft


def report_acceptance(args: argparse.Namespace, drafted: int, accepted: int) -> None:
    """With --verbose: the acceptance rate of the run's drafts, one line on stderr."""
    if not args.verbose or not (args.prompt_lookup or args.draft_model):
        return
    rate = f"{100 * accepted / drafted:.1f}%" if drafted else "n/a"
    print(f"speculative decoding: {accepted} of {drafted} draft tokens accepted ({rate})", file=sys.stderr)


def print_beams(model, tok, texts: list[str], settings, args: argparse.Namespace) -> None:
    """Beam (or contrastive) search's results, best first per prompt: a header and the text, or --json lines."""
    from gpt2kit.generation import generate

    args.status.hide()
    for c in generate(model, texts, settings, tokenizer=tok, batch_size=args.batch_size):
        if args.json:
            print(json.dumps({"prompt_index": c.prompt_index, "sample_index": c.sample_index,
                              "prompt": texts[c.prompt_index], "prompt_tokens": c.prompt_tokens, "tokens": c.tokens,
                              "text": c.text, "finish_reason": c.finish_reason, "score": c.score}), flush=True)
        else:
            label = json.dumps(texts[c.prompt_index][:60], ensure_ascii=False)
            score = "" if c.score is None else f" (score {c.score:.4f})"
            print(f"{'=' * 40} PROMPT {c.prompt_index + 1} BEAM {c.sample_index + 1}: {label}{score} {'=' * 40}")
            print(c.text, flush=True)
