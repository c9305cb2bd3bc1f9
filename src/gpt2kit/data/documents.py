"""prepare's inputs: which files, in which order, and the text of each document.

A task is one document: (path, line number, raw line) for a .jsonl line, (path, 0, None) for a
text file, which the worker reads itself so that big files are not piped through the parent,
(path, 0, contents) for an input that can be read only once (a pipe, /dev/stdin), read up front, and
in a shuffled run (which holds every task at once) a .jsonl line is its byte offset, read by the worker.
"""

from __future__ import annotations

import collections
import json
import os
import stat
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from gpt2kit.data.shard import HEADER_BYTES, MAGIC

Task = tuple[str, int, bytes | int | None]


def decode_bytes(raw: bytes) -> tuple[str, bool]:
    """UTF-8 (a leading BOM dropped); undecodable bytes become U+FFFD. Returns (text, replaced)."""
    try:
        return raw.decode("utf-8-sig"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8-sig", errors="replace"), True


def jsonl_text(raw: bytes, path: str, lineno: int) -> tuple[str, bool]:
    line, replaced = decode_bytes(raw)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: invalid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        found = f"keys {sorted(obj)}" if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f'{path}, line {lineno}: expected an object with a string "text" field, found {found}')
    return obj["text"], replaced


def document_text(task: Task) -> tuple[str, bool]:
    """The text of one task's document and whether undecodable bytes were replaced."""
    path, lineno, raw = task
    if raw is None:
        return decode_bytes(Path(path).read_bytes())
    if isinstance(raw, int):
        with open(path, "rb") as f:
            f.seek(raw)
            return jsonl_text(f.readline(), path, lineno)
    if lineno == 0:
        return decode_bytes(raw)
    return jsonl_text(raw, path, lineno)


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def collect_files(
    inputs: Iterable[str | os.PathLike], glob: str, exclude: Path
) -> tuple[list[Path], dict[str, bytes]]:
    """Input files (directories expanded recursively by `glob`), deduplicated, sorted by path string,
    and the contents of the inputs that are not regular files (pipes, character devices), read once here.

    Files in directories that `glob` leaves out are reported in one warning (how many, which suffixes).
    """
    found: dict[str, Path] = {}
    once: dict[str, bytes] = {}
    for item in inputs:
        p = Path(os.path.abspath(item))
        if p.is_dir():
            candidates = [f for f in p.rglob(glob) if f.is_file()]
            _warn_skipped(p, glob, {str(f) for f in candidates}, exclude)
        elif p.is_file():
            candidates = [p]
        elif p.exists():  # a pipe, /dev/null, /dev/stdin: readable once, as one text document
            mode = p.stat().st_mode
            if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
                raise ValueError(f"input {item} is neither a file nor a directory")
            if is_jsonl(p):
                raise ValueError(f"input {item}: a .jsonl input must be a regular file (it is read twice)")
            with open(p, "rb") as f:
                once[str(p)] = f.read()
            candidates = [p]
        elif p.is_symlink():
            raise FileNotFoundError(f"input {item} is a symbolic link to {os.readlink(p)}, which does not exist")
        else:
            raise FileNotFoundError(f"input {item} does not exist")
        for f in candidates:
            if exclude not in f.parents:  # never read our own output back
                found[str(f)] = f
    return [found[k] for k in sorted(found)], once


def _warn_skipped(directory: Path, glob: str, taken: set[str], exclude: Path) -> None:
    def hidden(f: Path) -> bool:
        return any(part.startswith(".") for part in f.relative_to(directory).parts)

    skipped = [f for f in directory.rglob("*")
               if f.is_file() and str(f) not in taken and exclude not in f.parents and not hidden(f)]
    if not skipped:
        return
    suffixes = collections.Counter(f.suffix or "(no suffix)" for f in skipped)
    listed = ", ".join(f"{n} {suffix}" for suffix, n in suffixes.most_common(5))
    more = ", ..." if len(suffixes) > 5 else ""
    top = next((suffix for suffix, _ in suffixes.most_common() if suffix.startswith(".")), ".py")
    files = "file that does" if len(skipped) == 1 else "files that do"
    warnings.warn(f"{directory}: skipped {len(skipped)} {files} not match --glob {glob!r} ({listed}{more}); "
                  f"pass e.g. --glob '*{top}' or --glob '*' to include them", stacklevel=4)


def count_documents(files: list[Path], once: dict[str, bytes]) -> int:
    """One document per text file, one per non-blank line of a .jsonl file."""
    return sum(_count_jsonl_lines(f) if is_jsonl(f) and str(f) not in once else 1 for f in files)


def _count_jsonl_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def iter_tasks(files: list[Path], once: dict[str, bytes], *, offsets: bool = False) -> Iterator[Task]:
    for path in files:
        if str(path) in once:
            yield str(path), 0, once[str(path)]
        elif not is_jsonl(path):
            yield str(path), 0, None
        else:
            with open(path, "rb") as f:
                offset = 0
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        yield str(path), lineno, offset if offsets else line
                    offset += len(line)


def ordered_tasks(files: list[Path], once: dict[str, bytes], shuffle_seed: int | None) -> Iterable[Task]:
    """Documents in path order, or permuted by numpy's default_rng(shuffle_seed).permutation(n_docs)."""
    if shuffle_seed is None:
        return iter_tasks(files, once)
    tasks = list(iter_tasks(files, once, offsets=True))
    order = np.random.default_rng(shuffle_seed).permutation(len(tasks))
    return [tasks[i] for i in order]


def refuse_shards(files: list[Path]) -> None:
    """Token shards given to prepare would be tokenized as text: say what they are instead."""
    for f in files:
        if f.suffix == ".bin" and f.stat().st_size >= HEADER_BYTES:
            magic = int(np.fromfile(f, dtype="<i4", count=1)[0])
            if magic == MAGIC:
                raise ValueError(f"{f} is already a token shard (llm.c format): prepare reads text, and a shard's "
                                 f"documents cannot be re-shuffled here; point train --data at its directory "
                                 f"(training samples random windows from shards as they are)")

