"""The generate command's decoding-method flags (speculative decoding, beam and contrastive search), apart from
cli.py's core flags: how they are registered, turned into settings, the draft model loaded, the
acceptance rate reported and beams printed. Thin, as cli.py: the work is gpt2kit.generate's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (greedy output unchanged; sampled output the same distribution)")
    g.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="draft up to N tokens per step from n-gram matches in the context (0 = off)")
    g.add_argument("--draft-model", default=None, metavar="M",
                   help="a smaller GPT-2 with the same tokenizer drafts for --model")
    g.add_argument("--draft-tokens", type=int, default=4, metavar="K", help="tokens the draft model proposes per step")
    g.add_argument("--verbose", "-v", action="store_true",
                   help="report the draft acceptance rate on stderr at the end")
    b = p.add_argument_group("beam search (as transformers' generate(num_beams=...); not streamed)")
    b.add_argument("--num-beams", type=int, default=1, metavar="N", help="beams per prompt (1 = off; at most 64)")
    b.add_argument("--length-penalty", type=float, default=1.0,
                   help="a finished beam's score is its log-prob sum / length ** this")
    b.add_argument("--early-stopping", choices=tuple(_EARLY_STOPPING), default="false",
                   help="true: stop once num_beams beams finished; false: once none can improve; never")
    b.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                   help="beams printed per prompt, best first")
    c = p.add_argument_group("contrastive search (Su et al. 2022; not streamed)")
    c.add_argument("--penalty-alpha", type=float, default=0.0, metavar="A",
                   help="with --top-k K > 1: contrastive search over K candidates (0 = off; in [0, 1])")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding for every greedy request (responses unchanged)")
    g.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="draft up to N tokens per step from n-gram matches in the context (0 = off)")
    g.add_argument("--draft-model", default=None, metavar="M", help="a smaller GPT-2 with the same tokenizer drafts")
    g.add_argument("--draft-tokens", type=int, default=4, metavar="K", help="tokens the draft model proposes per step")


def serve_options(args: argparse.Namespace) -> dict:
    """ServeOptions' speculative-decoding fields from the serve flags."""
    return {"draft_model": args.draft_model, "draft_tokens": args.draft_tokens, "prompt_lookup": args.prompt_lookup}


def settings(args: argparse.Namespace, base):
    """base (the core flags' SamplingSettings) with the decoding flags' settings."""
    return dataclasses.replace(base, prompt_lookup=args.prompt_lookup, draft_tokens=args.draft_tokens,
                               num_beams=args.num_beams, length_penalty=args.length_penalty,
                               early_stopping=_EARLY_STOPPING[args.early_stopping],
                               num_return_sequences=args.num_return_sequences, penalty_alpha=args.penalty_alpha)


def load_draft(args: argparse.Namespace, model, tok):
    """--draft-model's model (as --model: --dtype, --device), refused unless it shares --model's
    tokenizer; None without the flag."""
    if args.draft_model is None:
        return None
    from gpt2kit.checkpoint import load_model, load_tokenizer, resolve_source
    from gpt2kit.engine.speculative import check_draft_model

    _, path = resolve_source(args.draft_model)
    if not load_tokenizer(path).same_vocabulary(tok):
        raise ValueError(f"--draft-model {args.draft_model} has another tokenizer than --model {args.model}: "
                       f"a draft model must share the target's vocabulary")
    draft = load_model(path, dtype=args.dtype, device=args.device)
    check_draft_model(model, draft)
    return draft


def report(args: argparse.Namespace, drafted: int, accepted: int) -> None:
    """With --verbose: the acceptance rate of the run's drafts, one line on stderr."""
    if not args.verbose or not (args.prompt_lookup or args.draft_model):
        return
    rate = f"{100 * accepted / drafted:.1f}%" if drafted else "n/a"
    print(f"speculative decoding: {accepted} of {drafted} draft tokens accepted ({rate})", file=sys.stderr)


def print_beams(model, tok, texts: list[str], settings, args: argparse.Namespace) -> None:
    """Beam (or contrastive) search's results, best first per prompt: a header and the text, or --json lines."""
    from gpt2kit.generate import generate

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
