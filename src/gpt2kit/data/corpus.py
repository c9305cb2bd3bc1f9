"""prepare(): text files, directories and .jsonl files -> GPT-2 token shards, recorded in prepare.json.

The inputs and their order are documents.py's, the tokenizing processes workers.py's, the shard
format shard.py's; this module packs the tokens into shards and writes the record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gpt2kit._io import atomic_write
from gpt2kit.data.documents import Task, collect_files, count_documents, ordered_tasks, refuse_shards
from gpt2kit.data.shard import MAGIC, MAX_SHARD_TOKENS, VERSION, write_shard
from gpt2kit.data.workers import tokenized
from gpt2kit.validate import check_int

DEFAULT_SHUFFLE_SEED = 1337


class _ShardWriter:
    """Packs documents back to back into shards of exactly `shard_size` tokens (the last one shorter)."""

    def __init__(self, out_dir: Path, shard_size: int):
        self.out_dir = out_dir
        self.buf = np.empty(shard_size, dtype=np.uint16)
        self.fill = 0
        self.split = "val"
        self.shards: dict[str, list[Path]] = {"train": [], "val": []}
        self.tokens = {"train": 0, "val": 0}

    def add(self, tokens: np.ndarray) -> None:
        self.tokens[self.split] += tokens.size
        while tokens.size:
            n = min(tokens.size, self.buf.size - self.fill)
            self.buf[self.fill : self.fill + n] = tokens[:n]
            self.fill += n
            tokens = tokens[n:]
            if self.fill == self.buf.size:
                self.flush()

    def flush(self) -> None:
        if self.fill:
            path = self.out_dir / f"{self.split}_{len(self.shards[self.split]):06d}.bin"
            write_shard(path, self.buf[: self.fill])
            self.shards[self.split].append(path)
            self.fill = 0

    def start_train(self) -> None:
        self.flush()
        self.split = "train"

    def remove_all(self) -> None:
        for path in self.shards["train"] + self.shards["val"]:
            path.unlink(missing_ok=True)

    def summary(self, documents: int, val_documents: int) -> PrepareSummary:
        return PrepareSummary(out_dir=self.out_dir, documents=documents, val_documents=val_documents,
                              train_tokens=self.tokens["train"], val_tokens=self.tokens["val"],
                              train_shards=self.shards["train"], val_shards=self.shards["val"])


@dataclasses.dataclass(frozen=True)
class PrepareSummary:
    """What prepare() wrote; also saved as out_dir/prepare.json (shard paths relative to out_dir)."""

    out_dir: Path
    documents: int
    val_documents: int
    train_tokens: int  # eot separators included
    val_tokens: int
    train_shards: list[Path]
    val_shards: list[Path]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": {"magic": MAGIC, "version": VERSION, "dtype": "uint16", "tokenizer": "gpt2"},
            "documents": self.documents,
            "val_documents": self.val_documents,
            "train_tokens": self.train_tokens,
            "val_tokens": self.val_tokens,
            "train_shards": [p.name for p in self.train_shards],
            "val_shards": [p.name for p in self.val_shards],
        }


def _val_documents(val_fraction: float, n_docs: int) -> int:
    if val_fraction == 0 or n_docs < 2:
        return 0
    # round() first so that e.g. 0.0005 * 2000 = 1.0000000000000002 does not ceil to 2
    return min(max(1, math.ceil(round(val_fraction * n_docs, 9))), n_docs - 1)


def _existing_shards(out_dir: Path) -> list[Path]:
    pattern = re.compile(r"(train|val)_\d{6}\.bin")
    return sorted(p for p in out_dir.glob("*.bin") if pattern.fullmatch(p.name))


def prepare(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.0005,
    glob: str = "*.txt",
    workers: int | None = None,
    shard_size: int = 100_000_000,
    progress: bool = True,
    overwrite: bool = False,
    shuffle_seed: int | None = DEFAULT_SHUFFLE_SEED,
) -> PrepareSummary:
    """Tokenize text files, directories and .jsonl files into GPT-2 shards in `out_dir`.

    Documents: each text file is one document; each non-blank line of a .jsonl file is one (an
    object with a string "text" field). Directories are searched recursively for `glob`; files
    named directly are used whatever their name. Files are read as UTF-8 with undecodable bytes
    replaced (one UnicodeWarning per such file).

    Order and split: documents are listed in order of their absolute path string, .jsonl lines in
    file order, then shuffled: document i of the output is document
    numpy.random.default_rng(shuffle_seed).permutation(documents)[i] of that list (shuffle_seed
    None keeps the list order). The seed is recorded in prepare.json. The validation split is the
    first ceil(val_fraction * documents) of them (at least one when val_fraction > 0 and there are
    two or more documents; never all of them), so a random sample of the documents; the rest is
    train. The default 0.0005 keeps 1 document in 2000 for validation.

    Tokens: every document is preceded by <|endoftext|> (50256), as in llm.c, and documents are
    packed back to back into shards of `shard_size` tokens named val_000000.bin, train_000000.bin,
    train_000001.bin, ... (a document may span two shards). Tokenization runs in a pool of
    `workers` processes (default os.cpu_count(); 1 runs in this process) started with "spawn";
    the output does not depend on the number of workers.

    Raises ValueError for an empty corpus or a malformed .jsonl line (naming file and line),
    FileNotFoundError for a missing input, FileExistsError when `out_dir` already holds shards
    (unless overwrite=True, which deletes them first).
    """
    workers = _check_arguments(val_fraction, shard_size, workers, shuffle_seed)
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    out = Path(os.path.abspath(out_dir))

    files, once = collect_files(inputs, glob, exclude=out)
    refuse_shards(files)
    n_docs = count_documents(files, once)
    if n_docs == 0:
        names = ", ".join(str(i) for i in inputs) or "(no inputs)"
        raise ValueError(f"empty corpus: found {len(files)} files and no documents in {names} "
                         f"(directories are searched for {glob!r}; .jsonl files need non-blank lines)")
    n_val = _val_documents(val_fraction, n_docs)
    _clear_output(out, overwrite)

    writer = _ShardWriter(out, shard_size)
    try:
        text_tokens = _tokenize_into(writer, ordered_tasks(files, once, shuffle_seed), n_docs, n_val, workers,
                                     progress)
        writer.flush()
        if text_tokens == 0:
            names = ", ".join(str(i) for i in inputs)
            raise ValueError(f"empty corpus: the {n_docs} documents in {names} hold no text")
    except BaseException:
        writer.remove_all()
        raise

    summary = writer.summary(n_docs, n_val)
    record = summary.to_dict() | {"inputs": [str(i) for i in inputs], "glob": glob, "val_fraction": val_fraction,
                                  "shard_size": shard_size, "shuffle_seed": shuffle_seed}
    atomic_write(out / "prepare.json", lambda f: f.write(json.dumps(record, indent=2).encode() + b"\n"))
    return summary


def _check_arguments(val_fraction: float, shard_size: int, workers: int | None, shuffle_seed: int | None) -> int:
    """ValueError naming the first bad argument; returns the number of workers (default os.cpu_count())."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not 1 <= shard_size <= MAX_SHARD_TOKENS:
        raise ValueError(f"shard_size must be in [1, {MAX_SHARD_TOKENS}], got {shard_size}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if shuffle_seed is not None:
        check_int("shuffle_seed", shuffle_seed, ">= 0 or None", lambda v: v >= 0)
    return workers


def _clear_output(out: Path, overwrite: bool) -> None:
    """Create `out`; remove what a killed run left half-written, and old shards if overwrite, else refuse."""
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)
    stale = _existing_shards(out)
    if stale and not overwrite:
        raise FileExistsError(f"{out} already holds shards ({stale[0].name}, ...); pass --overwrite "
                              f"(overwrite=True) to replace them, or choose another output directory")
    for p in stale:
        p.unlink()


def _remove_stale_temporaries(out: Path) -> None:
    """Delete what a killed earlier run left half-written (atomic_write's `.<name>.<random>.tmp`)."""
    pattern = re.compile(r"\.(?:(?:train|val)_\d{6}\.bin|prepare\.json)\..+\.tmp")
    for p in out.iterdir():
        if pattern.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def _tokenize_into(
    writer: _ShardWriter, tasks: Iterable[Task], n_docs: int, n_val: int, workers: int, progress: bool
) -> int:
    """Tokenize every document into `writer`; returns the number of tokens excluding separators."""
    warned: set[str] = set()
    text_tokens = 0
    with contextlib.ExitStack() as stack:
        results = stack.enter_context(tokenized(tasks, workers))
        bar = stack.enter_context(tqdm(total=n_docs, unit="doc", desc="tokenizing", disable=not progress))
        for i, (tokens, replaced_in) in enumerate(results):
            if replaced_in is not None and replaced_in not in warned:
                warned.add(replaced_in)
                msg = f"{replaced_in}: invalid UTF-8 bytes were replaced with U+FFFD"
                warnings.warn(msg, UnicodeWarning, stacklevel=3)
            if i == n_val:
                writer.start_train()
            writer.add(tokens)
            text_tokens += tokens.size - 1
            bar.update()
    return text_tokens
