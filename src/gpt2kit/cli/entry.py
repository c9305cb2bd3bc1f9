"""The parser of every command and the one place errors become exit codes: a library error
(ValueError, OSError, CheckpointError, ...) is one line on stderr and exit code 1 (2 for usage
errors and for an error that says so, common.InputError; 130 on Ctrl-C, 141 when the reader of
stdout went away); `--debug` shows the traceback instead. Each command's status (gpt2kit.progress)
and its one-line warnings are opened here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gpt2kit.cli.bench import register_bench
from gpt2kit.cli.check import register_check
from gpt2kit.cli.common import one_line, one_line_warnings, prog, set_prog
from gpt2kit.cli.explore import register_explore
from gpt2kit.cli.generate import register_generate, register_score
from gpt2kit.cli.models import (
    register_convert,
    register_detokenize,
    register_info,
    register_merge,
    register_quantize,
    register_tokenize,
)
from gpt2kit.cli.serve import register_serve
from gpt2kit.cli.trace import register_steer, register_trace
from gpt2kit.cli.train import register_prepare, register_train

REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [
    register_tokenize, register_detokenize, register_score, register_convert, register_info, register_prepare,
    register_train, register_generate, register_bench, register_trace, register_serve, register_quantize,
    register_merge, register_check, register_explore, register_steer,
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpt2kit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpt2kit", description="GPT-2, complete, exact and fast.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"gpt2kit {_version()}")
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
    set_prog(f"gpt2kit {args.command}")
    from gpt2kit.progress import Status

    try:
        # the stages on stderr (a status line on a terminal, log lines elsewhere); warnings as one line each
        with Status(prog()) as args.status, one_line_warnings(args.status) as args.warnings:
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed stdout shows up here, not at interpreter exit
        return code
    except KeyboardInterrupt:
        print("gpt2kit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`gpt2kit tokenize big.txt | head`): stop quietly
        _detach_stdout()
        return 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)
    except Exception as e:  # the CLI's one place that turns errors into exit codes
        if debug:
            raise
        print(f"{prog()}: error: {one_line(e)}", file=sys.stderr)
        return getattr(e, "exit_code", 1)


def _detach_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot raise about the closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests, notebooks)
        pass

