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


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_tokenize, _register_score, _register_convert, _register_info,
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
