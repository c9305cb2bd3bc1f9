"""gpt2kit bench: generation speed against transformers (the work is gpt2kit.bench)."""

from __future__ import annotations

import argparse


def cmd_bench(args: argparse.Namespace) -> int:
    from gpt2kit.bench.command import run_from_args

    return run_from_args(args)


def register_bench(sub: argparse._SubParsersAction) -> None:
    from gpt2kit.bench.command import add_arguments

    p = sub.add_parser("bench", help="generation speed vs transformers, side by side (needs transformers)")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
