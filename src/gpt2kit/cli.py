"""The `gpt2kit` command: parse, call one library function, map errors to one line and an exit code.

Each subcommand is a `cmd_<name>(args) -> int` function registered in `build_parser`. Errors from
the library (ValueError, OSError, CheckpointError, ...) are printed as one line on stderr with exit
code 1 (2 for usage errors); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


class CLIError(Exception):
    """A user-facing error raised by a subcommand (printed as one line)."""


def _add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--model", "-m", required=required, default=None if required else "gpt2",
                   help="hub id (gpt2, gpt2-medium, ...), HF directory, or OpenAI TF release directory")
    _add_device_args(p)


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N | mps (default: cpu)")


def _read_text(path: str | None) -> str:
    if path is None or path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CLIError(f"{path}: is a directory, expected a text file") from None


# --- subcommands ------------------------------------------------------------------------------

def cmd_tokenize(args: argparse.Namespace) -> int:
    from gpt2kit.tokenizer import Tokenizer

    ids = Tokenizer.default().encode(_read_text(args.file), allow_special=args.allow_special)
    if args.count:
        print(len(ids))
    elif args.json:
        print(json.dumps({"tokens": ids}))
    else:
        print(" ".join(map(str, ids)))
    return 0


def _register_tokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="print the GPT-2 token ids of a text")
    p.add_argument("file", nargs="?", help="text file (default: stdin)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help='print {"tokens": [...]}')
    g.add_argument("--count", action="store_true", help="print only the number of tokens")
    p.add_argument("--allow-special", action="store_true", help="treat <|endoftext|> in the text as the special token")
    p.set_defaults(func=cmd_tokenize)


def cmd_score(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import load_model, load_tokenizer
    from gpt2kit.score import score_text

    text = _read_text(args.file)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    result = score_text(model, load_tokenizer(args.model), text, stride=args.stride)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"tokens: {len(result.tokens)}  nll: {result.nll:.4f} nats/token  "
              f"perplexity: {result.ppl:.3f}  bits/byte: {result.bits_per_byte:.4f}")
    return 0


def _register_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="how likely a text is under a model (log-probs, NLL, perplexity)")
    p.add_argument("file", nargs="?", help="text file (default: stdin)")
    _add_model_args(p)
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride for long texts (default n_ctx/2)")
    p.add_argument("--json", action="store_true", help='print {"tokens", "logprobs", "nll", "ppl"}')
    p.set_defaults(func=cmd_score)


def cmd_convert(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import load_model, load_tokenizer, save_model

    model = load_model(args.src, dtype=args.dtype)
    out = save_model(model, args.dst, tokenizer=load_tokenizer(args.src))
    print(f"wrote {out} ({model.num_parameters():,} parameters, {args.dtype or 'float32'})")
    return 0


def _register_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write any loadable checkpoint as an HF-format directory")
    p.add_argument("src", help="hub id, HF directory or OpenAI TF release directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default float32)")
    p.set_defaults(func=cmd_convert)


def cmd_info(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import describe

    info = describe(args.model)
    if args.json:
        print(json.dumps(info))
        return 0
    cfg = info["config"]
    print(f"source:     {info['source']} ({info['path']})")
    print(f"config:     {cfg['n_layer']} layers, n_embd {cfg['n_embd']}, {cfg['n_head']} heads, "
          f"n_ctx {cfg['n_ctx']}, n_vocab {cfg['n_vocab']}")
    print(f"parameters: {info['parameters']:,}")
    print(f"dtype:      {info['dtype']}")
    for name, size in info["files"].items():
        print(f"file:       {name} ({size:,} bytes)")
    return 0


def _register_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="a checkpoint's config, parameter count, dtype and files")
    p.add_argument("model", help="hub id, HF directory or OpenAI TF release directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)


def cmd_prepare(args: argparse.Namespace) -> int:
    import warnings

    from gpt2kit.data import prepare

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # one line per warning
        print(f"gpt2kit prepare: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        s = prepare(args.inputs, args.out, val_fraction=args.val_fraction, glob=args.glob,
                    workers=args.workers, shard_size=args.shard_size, progress=sys.stderr.isatty(),
                    overwrite=args.overwrite, shuffle_seed=None if args.no_shuffle else args.shuffle_seed)
    print(f"{s.documents:,} documents: {s.train_tokens:,} train tokens in {len(s.train_shards)} shard(s), "
          f"{s.val_tokens:,} val tokens ({s.val_documents:,} documents) in {len(s.val_shards)} shard(s), "
          f"in {s.out_dir}")
    return 0


def _register_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text / .jsonl into llm.c-format token shards for training")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, directories (searched recursively for --glob) or .jsonl files (a \"text\" field)")
    p.add_argument("--out", "-o", required=True, help="output directory for train_*.bin / val_*.bin")
    p.add_argument("--val-fraction", type=float, default=0.0005,
                   help="fraction of documents kept for validation (default 0.0005; at least one document)")
    p.add_argument("--glob", default="*.txt", help="file pattern inside directories (default *.txt)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--shard-size", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    p.add_argument("--shuffle-seed", type=int, default=1337,
                   help="seed of the document shuffle before the split, recorded in prepare.json (default 1337)")
    p.add_argument("--no-shuffle", action="store_true",
                   help="keep documents in path order (validation = the first documents)")
    p.set_defaults(func=cmd_prepare)


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from gpt2kit.train import TrainConfig, resume_config, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.resume:
        cfg = resume_config(given.pop("out"), **given)
    elif "data" not in given:
        raise CLIError("--data is required: a directory of shards written by `gpt2kit prepare`")
    else:
        cfg = TrainConfig(**given)
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        loss = f", loss {result.loss:.4f}" if result.loss is not None else ""
        print(f"step {result.step}{loss}{val}: model and checkpoint in {result.out}")
    return 0


def _register_train(sub: argparse._SubParsersAction) -> None:
    # Defaults are None so that only the flags given on the line override a --resume'd run's settings;
    # the defaults named in the help are TrainConfig's (src/gpt2kit/train.py).
    p = sub.add_parser(
        "train", help="pre-train or fine-tune GPT-2 on token shards (torchrun -m gpt2kit train for many GPUs)",
        description="Train from a preset (from scratch) or fine-tune a checkpoint. Writes the model "
                    "(HF format), checkpoint.pt, metrics.jsonl and loss.png to --out.")
    a = p.add_argument
    a("--data", help="directory of train_*.bin / val_*.bin shards (gpt2kit prepare, or llm.c's)")
    a("--out", "-o", required=True, help="output directory: the model, checkpoint.pt, metrics.jsonl, loss.png")
    a("--model", "-m", help="a preset to train from scratch: gpt2-tiny (default), gpt2-mini, gpt2, gpt2-medium, "
                            "gpt2-large, gpt2-xl; or a checkpoint directory or hub id to fine-tune, "
                            "e.g. openai-community/gpt2")
    for flag, what in (("--n-layer", "layers"), ("--n-embd", "width"), ("--n-head", "attention heads"),
                       ("--n-ctx", "context length")):
        a(flag, type=int, help=f"from scratch: override the preset's {what}")
    a("--dropout", type=float, help="dropout probability (default 0.0)")
    a("--batch-size", "-b", type=int, help="sequences per micro-step and rank (default 8)")
    a("--seq-len", type=int, help="tokens per sequence (default: the model's n_ctx)")
    a("--total-batch-tokens", type=int,
      help="tokens per optimizer step, reached by gradient accumulation; a multiple of "
           "batch-size x seq-len x ranks (default: exactly that, no accumulation)")
    a("--lr", type=float, help="peak learning rate (default 6e-4; ~3e-5 suits fine-tuning)")
    a("--min-lr", type=float, help="final learning rate of the cosine schedule (default lr/10)")
    a("--warmup-steps", type=int, help="linear warmup steps (default max-steps/20)")
    a("--max-steps", type=int, help="optimizer steps; the schedule ends here (default 1000)")
    a("--weight-decay", type=float, help="AdamW weight decay on 2-D weights (default 0.1)")
    a("--grad-clip", type=float, help="clip the global gradient norm to this; 0 disables (default 1.0)")
    a("--eval-every", type=int, help="steps between validation evaluations; 0: only at the end (default 100)")
    a("--eval-steps", type=int, help="batches per evaluation (default 20)")
    a("--save-every", type=int, help="steps between checkpoints; 0: only at the end (default 500)")
    a("--log-every", type=int, help="steps between log lines when stderr is not a terminal (default 10)")
    a("--seed", type=int, help="random seed: initial weights, dropout, the random windows (default 1337)")
    a("--optimizer", help="muon (default where torch has torch.optim.Muon: Muon for the block matrices, AdamW "
                          "for embeddings, biases and gains) or adamw (AdamW for everything)")
    a("--muon-lr", type=float, help="Muon's peak learning rate; --lr is AdamW's (default 0.02)")
    a("--schedule", help="wsd (warmup, flat, linear decay over the last 40%%; default) or cosine")
    a("--sampling", help="random (default: windows drawn at random from all shards, a fresh draw per seed) or "
                         "sequential (shards read front to back)")
    a("--dtype", choices=["float32", "bfloat16", "fp32", "bf16"],
      help="float32 (default) or bfloat16 autocast (weights and optimizer stay float32)")
    a("--compile", action="store_true", default=None, help="torch.compile the model")
    a("--device", help="cpu | cuda | cuda:N (default: this rank's GPU if there is one, else cpu)")
    a("--resume", action="store_true", help="continue the run saved in --out/checkpoint.pt")
    a("--stop-at", type=int, help="end this invocation after this step, saving a checkpoint "
                                  "(the schedule still runs to --max-steps; continue with --resume)")
    p.set_defaults(func=cmd_train)


def _sampling_settings(args: argparse.Namespace):
    from gpt2kit.generate import EOT_ID, SamplingSettings

    return SamplingSettings(
        max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k, top_p=args.top_p, top_p_mode=args.top_p_mode,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
        stop_token_ids=() if args.ignore_eot else (EOT_ID,), stop_strings=tuple(args.stop or ()),
        num_samples=args.num_samples, strict=args.strict, window=args.window,
        pack_weights=False if args.no_pack_weights else None)


def _read_prompts(path: str) -> list[str]:
    """One prompt per non-blank line, or JSONL objects with a "prompt" field (.jsonl or a leading '{')."""
    lines = [(n, line) for n, line in enumerate(_read_text(path).splitlines(), start=1) if line.strip()]
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


def _generate_and_print(model, tok, texts: list[str], settings, args: argparse.Namespace) -> None:
    """Run one generation and print its samples in order; the first unfinished one streams live."""
    from gpt2kit.generate import encode_prompts, generate_stream

    ids = encode_prompts(tok, texts)
    n_rows = len(ids) * settings.num_samples
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    text = [""] * n_rows
    done: dict[int, str] = {}
    head = 0  # the next sample to print; its text goes out as it arrives

    def header(k: int) -> None:
        if n_rows > 1 and not args.json:
            i, j = divmod(k, settings.num_samples)
            label = f"PROMPT {i + 1} SAMPLE {j + 1}" if len(ids) > 1 else f"SAMPLE {k + 1}"
            print(f"{'=' * 40} {label} {'=' * 40}")

    def finish(k: int) -> None:
        if args.json:
            print(json.dumps({"prompt_tokens": ids[k // settings.num_samples], "tokens": tokens[k],
                              "text": text[k], "finish_reason": done[k]}), flush=True)
        else:
            print(flush=True)

    header(0)
    for step in generate_stream(model, ids, settings, tokenizer=tok, batch_size=args.batch_size):
        for k, t in step.tokens.items():
            tokens[k].append(t)
        for k, piece in step.text.items():
            text[k] += piece
            if k == head and piece and not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        done.update(step.finished)
        while head in done:
            finish(head)
            head += 1
            if head < n_rows:
                header(head)
                if not args.json and text[head]:
                    sys.stdout.write(text[head])  # buffered while an earlier sample was printing
                    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import load_model, load_tokenizer

    settings = _sampling_settings(args)  # bad values fail before the model loads
    if args.prompt is not None and args.prompts_file is not None:
        raise CLIError("give a PROMPT or --prompts-file, not both")
    if args.interactive and (args.prompt is not None or args.prompts_file is not None):
        raise CLIError("--interactive reads its prompts from stdin; drop PROMPT / --prompts-file")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    texts = _read_prompts(args.prompts_file) if args.prompts_file is not None else [args.prompt or ""]
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(args.model)
    if not args.interactive:  # no prompt: unconditional samples from <|endoftext|>
        _generate_and_print(model, tok, texts, settings, args)
        return 0
    while True:  # as openai/gpt-2's interactive_conditional_samples.py, until EOF
        if sys.stdin.isatty():
            print("Model prompt >>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if line.strip():
            _generate_and_print(model, tok, [line.rstrip("\r\n")], settings, args)


def _register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a model (KV-cached, batched, streamed)")
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (default: unconditional samples starting from <|endoftext|>)")
    _add_model_args(p, required=False)
    p.add_argument("--max-new-tokens", "-n", type=int, default=128, help="tokens to generate per sample")
    p.add_argument("--temperature", "-t", type=float, default=1.0, help="0 = greedy (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1] (1 = off)")
    p.add_argument("--top-p-mode", choices=("openai", "hf"), default="openai",
                   help="openai: keep tokens with cumulative prob <= p (sample.py); hf: also the one crossing p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--batch-size", type=int, default=8, help="rows generated together (default 8)")
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--ignore-eot", action="store_true", help="do not stop at <|endoftext|>")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help='one prompt per line, or JSONL with a "prompt" field')
    p.add_argument("--json", action="store_true",
                   help='one line per sample: {"prompt_tokens", "tokens", "text", "finish_reason"}')
    p.add_argument("--interactive", "-i", action="store_true", help="read prompts from stdin until EOF")
    p.add_argument("--strict", action="store_true",
                   help="error if prompt + new tokens exceed the context (default: re-encode a recent window)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens kept when re-encoding past the context (default n_ctx/2)")
    p.add_argument("--no-pack-weights", action="store_true",
                   help="CPU: no prepacked second copy of the weights (slower decode, less memory)")
    p.set_defaults(func=cmd_generate)


def cmd_bench(args: argparse.Namespace) -> int:
    from gpt2kit.bench import run_from_args

    return run_from_args(args)


def _register_bench(sub: argparse._SubParsersAction) -> None:
    from gpt2kit.bench import add_arguments

    p = sub.add_parser("bench", help="generation speed vs transformers, side by side (needs transformers)")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_tokenize, _register_score, _register_convert, _register_info,
    _register_prepare, _register_train, _register_generate, _register_bench,
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpt2kit", description="GPT-2, complete, exact and fast.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line, not only before the subcommand.
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.debug = debug
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gpt2kit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the CLI's one place that turns errors into exit codes
        if debug:
            raise
        print(f"gpt2kit {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
