"""gpt2kit generate and gpt2kit score. generate's sampling flags are SamplingSettings' fields (their
metadata holds the help, gpt2kit.sampling), so a new setting gets its flag there; the fields whose
command-line form differs (token-id lists, stop strings, the stop token) are the few flags below."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from gpt2kit.cli.common import (
    CLIError,
    DefaultsShown,
    add_field_flags,
    field_values,
    read_text,
)
from gpt2kit.cli.decoding import SKIPPED as _DECODING_SKIPPED
from gpt2kit.cli.decoding import add_arguments as add_decoding_arguments
from gpt2kit.cli.decoding import load_draft, print_beams, report_acceptance, with_early_stopping
from gpt2kit.cli.load import add_model_args, add_quantize_arg, check_load_args, load_for
from gpt2kit.cli.trace import add_intervention_args, interventions_for, parse_interventions
from gpt2kit.sampling import SamplingSettings


def _sampling_settings(args: argparse.Namespace) -> SamplingSettings:
    from gpt2kit.config import EOT_ID

    values = field_values(args, args.sampling_fields)
    if args.greedy:
        values["temperature"] = 0.0
    return SamplingSettings(
        **values, stop_token_ids=() if args.ignore_eot else (EOT_ID,), stop_strings=tuple(args.stop or ()),
        bad_words=tuple(_token_ids("--bad-words-ids", s) for s in args.bad_words_ids or ()),
        suppress_tokens=_token_ids("--suppress-tokens", args.suppress_tokens) if args.suppress_tokens else (),
        structured=_structured(args))


def _structured(args: argparse.Namespace):
    """The constraint of --json-schema FILE, --regex R, --choice A,B,... or --grammar FILE (one of them), or None."""
    from gpt2kit.sampling import Constraint

    if args.json_schema is not None:
        return Constraint("json_schema", read_text(args.json_schema))
    if args.regex is not None:
        return Constraint("regex", args.regex)
    if args.choice is not None:
        return Constraint("choice", tuple(args.choice.split(",")))
    if args.grammar is not None:
        return Constraint("grammar", read_text(args.grammar))
    return None


def _add_structured_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured outputs (one of; needs the structured extra)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="output a JSON value valid under the JSON schema in FILE")
    g.add_argument("--regex", metavar="R", help="output text matching the regular expression R")
    g.add_argument("--choice", metavar="A,B,...", help="output exactly one of the comma-separated choices")
    g.add_argument("--grammar", metavar="FILE", help="output text of the Lark or GBNF grammar in FILE")




def cmd_score(args: argparse.Namespace) -> int:
    from gpt2kit.score import score_text

    text = read_text(args.file)
    check_load_args(args)  # before the model loads
    items = parse_interventions(args)
    model, tok = load_for(args)
    args.status.show(f"scoring {len(text):,} characters")
    result = score_text(model, tok, text, stride=args.stride, interventions=interventions_for(args, model, items))
    args.status.hide()
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(f"{'index':>7}  {'log-prob':>9}  token")
    for i, (t, lp) in enumerate(zip(result.tokens, result.logprobs, strict=True)):
        print(f"{i:>7}  {lp:>9.4f}  {_token_shown(tok, t)}")
    print(f"tokens: {len(result.tokens)}  nll: {result.nll:.4f} nats/token  "
          f"perplexity: {result.ppl:.3f}  bits/byte: {result.bits_per_byte:.4f}")
    return 0


def _token_shown(tok, t: int) -> str:
    """A token as score's table shows it: its text JSON-quoted (spaces and newlines visible), or its
    bytes as `bytes:\\xNN...` when they are not UTF-8 on their own (part of a character)."""
    data = tok.decode_bytes([t])
    try:
        return json.dumps(data.decode("utf-8"), ensure_ascii=False)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in data)


def register_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="how likely a text is under a model: each token's log-prob, then NLL, "
                                     "perplexity and bits per byte")
    p.add_argument("file", nargs="?", help="text file (default: stdin)")
    add_model_args(p)
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride for long texts (default n_ctx/2)")
    p.add_argument("--json", action="store_true", help='print {"tokens", "logprobs", "nll", "ppl"}')
    add_intervention_args(p, generating=False)
    add_quantize_arg(p)
    p.set_defaults(func=cmd_score)


def _token_ids(flag: str, text: str) -> tuple[int, ...]:
    """Comma-separated token ids ("262,3290") as a tuple."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated token ids such as 262,3290, got {text!r}") from None


def _with_bad_words(settings, tok, args: argparse.Namespace):
    """settings with --bad-words text added as token sequences (gpt2kit.sampling.bad_words_ids)."""
    if not args.bad_words:
        return settings
    from gpt2kit.sampling import bad_words_ids

    return dataclasses.replace(settings, bad_words=settings.bad_words + bad_words_ids(tok, args.bad_words))


def _read_prompts(path: str) -> list[str]:
    """One prompt per non-blank line, or JSONL objects with a "prompt" field (.jsonl or a leading '{')."""
    lines = [(n, line) for n, line in enumerate(read_text(path).splitlines(), start=1) if line.strip()]
    if not lines:
        raise CLIError(f"{path}: no prompts (the file is empty)")
    if not (path.endswith(".jsonl") or lines[0][1].lstrip().startswith("{")):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"{path}: line {n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CLIError(f'{path}: line {n}: expected a JSON object with a string "prompt" field')
        prompts.append(obj["prompt"])
    return prompts


def _quoted(prompt: str, limit: int = 60) -> str:
    """A prompt for a header line: JSON-quoted (newlines visible), cut to `limit` characters."""
    return json.dumps(prompt if len(prompt) <= limit else prompt[: limit - 1] + "…", ensure_ascii=False)


def _generate_and_print(model, tok, texts: list[str], settings, args: argparse.Namespace) -> None:
    """Run one generation and print its samples in order; the first unfinished one streams live.

    Headers (several samples, or --prompts-file) and --json lines name the prompt each sample
    belongs to; with stdout redirected and stderr a terminal, a bar counts the tokens."""
    from gpt2kit.generation import encode_prompts, generate_stream
    from gpt2kit.progress import is_terminal

    if settings.num_beams > 1 or settings.contrastive:
        return print_beams(model, tok, texts, settings, args)
    ids = encode_prompts(tok, texts)
    out = _SamplePrinter(texts, ids, settings.num_samples, args)
    args.status.hide()  # the samples (or the token bar) take the terminal from here
    bar = None if is_terminal(sys.stdout) else args.status.bar(out.n_rows * settings.max_new_tokens, unit="token",
                                                                  desc="generating")
    try:
        with args.warnings.holding():  # a warning waits for the end of the line being streamed
            out.header(0)
            drafted = accepted = 0
            for step in generate_stream(model, ids, settings, tokenizer=tok, batch_size=args.batch_size,
                                        draft_model=args.draft, interventions=args.interventions):
                for d, a in step.drafts.values():
                    drafted, accepted = drafted + d, accepted + a
                if bar is not None:
                    bar.update(len(step.tokens))
                out.take(step)
            report_acceptance(args, drafted, accepted)
    finally:
        if bar is not None:
            bar.close()


class _SamplePrinter:
    """The samples of one generation printed in order: the one at `head` streams live, later ones
    are held until it finishes."""

    def __init__(self, texts: list[str], ids: list[list[int]], num_samples: int, args: argparse.Namespace) -> None:
        self.texts, self.ids, self.num_samples, self.args = texts, ids, num_samples, args
        self.n_rows = len(ids) * num_samples
        self.tokens: list[list[int]] = [[] for _ in range(self.n_rows)]
        self.text = [""] * self.n_rows
        self.done: dict[int, str] = {}
        self.head = 0  # the next sample to print; its text goes out as it arrives
        self.many_prompts = len(ids) > 1 or args.prompts_file is not None

    def header(self, k: int) -> None:
        if (self.n_rows > 1 or self.many_prompts) and not self.args.json:
            i, j = divmod(k, self.num_samples)
            label = (f"PROMPT {i + 1} SAMPLE {j + 1}: {_quoted(self.texts[i])}" if self.many_prompts
                     else f"SAMPLE {k + 1}")
            print(f"{'=' * 40} {label} {'=' * 40}")

    def finish(self, k: int) -> None:
        if self.args.json:
            i, j = divmod(k, self.num_samples)
            print(json.dumps({"prompt_index": i, "sample_index": j, "prompt": self.texts[i],
                              "prompt_tokens": self.ids[i], "tokens": self.tokens[k], "text": self.text[k],
                              "finish_reason": self.done[k]}), flush=True)
        else:
            print(flush=True)
        self.args.warnings.release()  # the line has ended: warnings held meanwhile go out now

    def take(self, step) -> None:
        """One step's tokens and text: print what belongs to the head, and move on past finished ones."""
        for k, t in step.tokens.items():
            self.tokens[k].append(t)
        for k, piece in step.text.items():
            self.text[k] += piece
            if k == self.head and piece and not self.args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        self.done.update(step.finished)
        while self.head in self.done:
            self.finish(self.head)
            self.head += 1
            if self.head < self.n_rows:
                self.header(self.head)
                if not self.args.json and self.text[self.head]:
                    sys.stdout.write(self.text[self.head])  # buffered while an earlier sample was printing
                    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    settings = with_early_stopping(args, _sampling_settings(args))  # bad values fail before the model loads
    if args.prompt is not None and args.prompts_file is not None:
        raise CLIError("give a PROMPT or --prompts-file, not both")
    if args.interactive and (args.prompt is not None or args.prompts_file is not None):
        raise CLIError("--interactive reads its prompts from stdin; drop PROMPT / --prompts-file")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_load_args(args)  # before the model loads
    from gpt2kit.sampling import bad_word_text

    for w in args.bad_words or ():
        bad_word_text(w, "--bad-words")  # before the model loads
    items = parse_interventions(args)
    if (items or args.sae) and (settings.num_beams > 1 or settings.contrastive):
        raise CLIError("interventions apply to sampled or greedy generation, not beam or contrastive search")
    texts = _read_prompts(args.prompts_file) if args.prompts_file is not None else [args.prompt or ""]
    model, tok = load_for(args)
    args.interventions = interventions_for(args, model, items)
    settings = _with_bad_words(settings, tok, args)
    args.draft = load_draft(args, model, tok)
    if not args.interactive:  # no prompt: unconditional samples from <|endoftext|>
        _generate_and_print(model, tok, texts, settings, args)
        return 0
    while True:  # as openai/gpt-2's interactive_conditional_samples.py, until EOF or Ctrl-C at the prompt
        if sys.stdin.isatty():
            print("Model prompt >>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        try:
            _generate_and_print(model, tok, [line.rstrip("\r\n")], settings, args)
        except KeyboardInterrupt:  # Ctrl-C stops this sample only
            print(flush=True)
            print("(sample stopped; Ctrl-C at the prompt or end of input quits)", file=sys.stderr, flush=True)


def register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a model (KV-cached, batched, streamed)",
                       formatter_class=DefaultsShown)
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (default: unconditional samples starting from <|endoftext|>)")
    add_model_args(p)
    fields = add_field_flags(p, SamplingSettings, skip=_DECODING_SKIPPED)
    add_decoding_arguments(p)
    p.add_argument("--bad-words", action="append", metavar="TEXT",
                   help="text never generated, tokenized with and without a leading space (repeatable)")
    p.add_argument("--bad-words-ids", action="append", metavar="IDS",
                   help="a token-id sequence never generated, e.g. 262,3290 (repeatable)")
    p.add_argument("--suppress-tokens", default=None, metavar="IDS",
                   help="token ids never generated, e.g. 13,198 (default: none)")
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    _add_structured_flags(p)
    p.add_argument("--ignore-eot", action="store_true", help="do not stop at <|endoftext|>")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--batch-size", type=int, default=8, help="rows generated together (default 8)")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help='one prompt per line, or JSONL with a "prompt" field')
    p.add_argument("--json", action="store_true",
                   help='one line per sample: {"prompt_index", "sample_index", "prompt", "prompt_tokens", '
                        '"tokens", "text", "finish_reason"} (indexes from 0)')
    p.add_argument("--interactive", "-i", action="store_true",
                   help="read prompts from stdin until EOF; Ctrl-C stops a sample, Ctrl-C at the prompt quits")
    add_intervention_args(p, generating=True)
    add_quantize_arg(p)
    p.set_defaults(func=cmd_generate, sampling_fields=fields)
