"""What every command shares: the one-line error type, the program name its lines start with, text
input, warnings as one line, and flags built from a dataclass's fields (TrainConfig, SamplingSettings,
ServeOptions: each field's metadata holds its help). Imports nothing heavy."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterable, Iterator


class CLIError(Exception):
    """A user-facing error raised by a subcommand (printed as one line)."""


class InputError(CLIError):
    """Input a command cannot use, where exit code 1 has a meaning of its own (check: "a stage differs"):
    printed as one line, exit code 2."""

    exit_code = 2


def one_line(e: BaseException) -> str:
    """An exception's message on one line (a missing file's name included)."""
    text = str(e) or type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())


_PROG = ["gpt2kit"]  # "gpt2kit <command>" once parsed: the prefix of every error and warning line


def prog() -> str:
    return _PROG[0]


def set_prog(name: str) -> None:
    _PROG[0] = name


def warn(message: str) -> None:
    print(f"{prog()}: warning: {message}", file=sys.stderr)


def read_text(path: str | None) -> str:
    """A text file (or stdin for None / "-") as str; bytes that are not UTF-8 become U+FFFD, with a warning."""
    name = "stdin" if path is None or path == "-" else path
    if name == "stdin":
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    else:
        from gpt2kit._io import read_bytes

        data = read_bytes(path)  # its errors name the path; main prints them as one line
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        warn(f"{name} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
             "invalid bytes were replaced with U+FFFD")
        return data.decode("utf-8", errors="replace")


class WarningLines:
    """Python's warnings as `gpt2kit COMMAND: warning: ...` lines on stderr, without Python's file, line
    and source (through the command's status, so a status line is not torn). While `holding` (a
    sample streams to stdout), the lines wait for `release`, so none lands between streamed tokens."""

    def __init__(self, status=None) -> None:
        self.status, self.held = status, None

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = f"{prog()}: warning: {' '.join(str(message).split())}"
        if self.held is not None:
            self.held.append(text)
        else:
            self._write(text)

    def release(self) -> None:
        """Write the held lines (the streamed line has ended)."""
        for text in self.held or ():
            self._write(text)
        if self.held is not None:
            self.held = []

    def _write(self, text: str) -> None:
        if self.status is not None:
            self.status.message(text)
        else:
            print(text, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.held = []
        try:
            yield
        finally:
            self.release()
            self.held = None


@contextlib.contextmanager
def one_line_warnings(status=None) -> Iterator[WarningLines]:
    """Every warning raised inside as one line (WarningLines), Python's own format never."""
    import warnings

    lines = WarningLines(status)
    with warnings.catch_warnings():
        warnings.showwarning = lines.show
        yield lines


class DefaultsShown(argparse.HelpFormatter):
    """Help lines that name each option's default (argparse's ArgumentDefaultsHelpFormatter also
    tags the flags whose default is None or False, and repeats a default the text already gives)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not unset and "default" not in text:
            text += " (default: %(default)s)"
        return text


FLAG_TYPES = {"int": int, "float": float, "str": str}


def field_kind(f: dataclasses.Field) -> str:
    """A field's scalar type by name ("int" for `int | None`), or its whole annotation (a tuple's)."""
    return str(f.type).split(" | ")[0]


def add_field_flags(p: argparse.ArgumentParser, cls: type, skip: Iterable[str] = ()) -> list[str]:
    """A flag for every bool, int, float or str field of the dataclass cls (not in skip): its name
    (or metadata "flag"), metadata "short", type, default (the field's), "choices" (enforced),
    "metavar" and "help"; a "const" flag stores const. The fields whose values have another form on
    the command line (tuples) are left to the command. Returns the names of the fields given flags."""
    names = []
    for f in dataclasses.fields(cls):
        meta, kind = f.metadata, field_kind(f)
        if f.name in skip or not (kind == "bool" or kind in FLAG_TYPES):
            continue
        flags = [meta.get("flag", "--" + f.name.replace("_", "-")), *([meta["short"]] if "short" in meta else [])]
        help = meta.get("help", "").replace("%", "%%")  # argparse formats help with %
        if "const" in meta:
            p.add_argument(*flags, dest=f.name, action="store_const", const=meta["const"], default=f.default,
                           help=help)
        elif kind == "bool":
            p.add_argument(*flags, dest=f.name, action="store_true", default=f.default, help=help)
        else:
            p.add_argument(*flags, dest=f.name, type=FLAG_TYPES[kind], default=f.default, help=help,
                           choices=meta.get("choices"), metavar=meta.get("metavar"))
        names.append(f.name)
    return names


def field_values(args: argparse.Namespace, names: Iterable[str]) -> dict:
    """The parsed values of the flags add_field_flags built, by field name."""
    return {name: getattr(args, name) for name in names}
