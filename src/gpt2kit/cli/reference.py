"""docs/reference/cli.md, written from the parser the CLI runs (build_parser), so the reference cannot
drift from the flags: `python -m gpt2kit.cli.reference docs/reference/cli.md` writes it, and
tests/test_docs.py fails while the committed page differs from what this writes."""

from __future__ import annotations

import argparse
import sys

from gpt2kit.cli.entry import build_parser

HEADER = """# Command-line reference

Every command's flags and arguments, generated from the parser `gpt2kit` runs
(`python -m gpt2kit.cli.reference docs/reference/cli.md`; do not edit by hand). What the commands are
for: [the README](../../README.md#the-command-line); each topic's page in [docs/](../index.md).
`gpt2kit COMMAND --help` prints the same.

What every command shares:

- `M` (`--model`, `SRC`, `BASE`) is a hub id (`gpt2`, `gpt2-medium`, `openai-community/gpt2-xl`, any GPT-2
  fine-tune), an HF directory, or OpenAI's release directory (`hparams.json`, `model.ckpt.*`, `encoder.json`,
  `vocab.bpe`). A name that is not an existing path is a hub id only if it is a published name or
  `owner/name`; `HF_HUB_OFFLINE=1` uses only huggingface_hub's cache.
- stdout carries only the command's output; stderr shows the stages (a status line on a terminal, one line
  per stage elsewhere) and each warning as one line, `gpt2kit COMMAND: warning: ...`. Input that is not
  UTF-8 is read with U+FFFD for the bad bytes and a warning.
- An error is one line on stderr and exit code 1 (2 for usage errors; 130 on Ctrl-C; 141 when the reader
  of stdout went away, as with `| head`). `--debug`, anywhere on the line, shows the traceback instead.
- `gpt2kit --version` prints the version.
"""


def _cell(text: str) -> str:
    # one line; pipes escaped for the table, angle brackets for Markdown's HTML (<|endoftext|>)
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    # argparse's own expansion (%(default)s, %(choices)s), as --help shows it
    return parser._get_formatter()._expand_help(action)


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices else
                                 action.dest.upper())
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d == argparse.SUPPRESS or d == []:
        return ""
    return f"`{d}`"


def _command(name: str, help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## gpt2kit {name}", "", _cell(help_text) + ".", ""]
    if parser.description and parser.description != help_text:
        lines += [_cell(parser.description), ""]
    lines += ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        required = " (required)" if action.required and action.option_strings else ""
        text = _help(parser, action)
        default = "" if "default" in text else _default(action)  # the help already says it
        lines.append(f"| {_name(action)}{required} | {_cell(default)} | {_cell(text)} |")
    return lines + [""]


def render() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    out = [HEADER, "| command | what it does |", "|---|---|"]
    out += [f"| [`{n}`](#gpt2kit-{n}) | {_cell(helps[n])} |" for n in sub.choices]
    out.append("")
    for name, command in sub.choices.items():
        out += _command(name, helps[name], command)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m gpt2kit.cli.reference OUT.md", file=sys.stderr)
        return 2
    from pathlib import Path

    from gpt2kit._io import atomic_write_text

    Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(argv[0], render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
