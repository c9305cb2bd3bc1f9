"""The llm.c GPT-2 token shard: write, validate, read, find.

A shard is a 1024-byte header of 256 little-endian int32 (magic 20240520, version 1, token count,
then zeros) followed by the tokens as little-endian uint16. This is what llm.c's dev/data scripts
and modded-nanogpt write for FineWeb, so their shards load here and ours load there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

from gpt2kit._io import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_SHARD_TOKENS = 2**31 - 1  # the count lives in an int32


class ShardError(ValueError):
    """A file is not a valid llm.c GPT-2 token shard."""


def write_shard(path: str | os.PathLike, tokens: np.ndarray | Sequence[int]) -> None:
    """Write `tokens` (1-D, each in [0, 65536)) as an llm.c shard at `path`, atomically."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size > MAX_SHARD_TOKENS:
        raise ValueError(f"a shard holds at most {MAX_SHARD_TOKENS} tokens, got {arr.size}")
    if arr.size:
        bad = np.flatnonzero((arr < 0) | (arr >= 2**16))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token {int(arr[i])} at index {i} does not fit a uint16 shard (need 0 <= token < 65536)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, arr.size)
    payload = arr.astype(TOKEN_DTYPE, copy=False)

    def write(f: IO[bytes]) -> None:
        f.write(header.tobytes())
        f.write(payload.tobytes())

    atomic_write(path, write)  # a full disk is said by _io: "no space left on DIR while writing NAME"


def shard_token_count(path: Path) -> int:
    """Validate the header and length of the shard at `path` and return its token count."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: not a token shard: expected at least {HEADER_BYTES} header bytes, found {size}")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise ShardError(f"{path}: bad magic number: expected {MAGIC}, found {magic}")
    if version != VERSION:
        raise ShardError(
            f"{path}: unsupported shard version: expected {VERSION} (GPT-2, uint16 tokens), found {version}"
        )
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        raise ShardError(
            f"{path}: file length does not match the header's token count {count}: "
            f"expected {expected} bytes, found {size}"
        )
    return count


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Return the tokens of the shard at `path` as a read-only uint16 memmap (header validated)."""
    path = Path(path)
    count = shard_token_count(path)
    if count == 0:  # mmap cannot map zero bytes
        return np.empty(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def first_token_at_least(path: str | os.PathLike, limit: int, *, block: int = 1 << 24) -> tuple[int, int] | None:
    """(offset, token) of the first token >= `limit` in the shard at `path`, or None; read in blocks."""
    tokens = read_shard(path)
    for start in range(0, tokens.size, block):
        chunk = tokens[start : start + block]
        if chunk.max() >= limit:
            i = int(np.argmax(chunk >= limit))
            return start + i, int(chunk[i])
    return None


def find_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """The shards of `split` in `data_dir`, sorted by name.

    Matches our names (train_000000.bin) and llm.c's prefixed ones (fineweb_train_000001.bin).
    """
    data_dir = Path(data_dir)
    pattern = re.compile(rf"(?:.*_)?{re.escape(split)}_\d+\.bin")
    shards = sorted(p for p in data_dir.glob(f"*{split}_*.bin") if pattern.fullmatch(p.name))
    if not shards:
        raise ValueError(f"no {split!r} shards in {data_dir} (looked for files named like '{split}_000000.bin')")
    return shards


def most_used_tokens(files: Sequence[Path], n: int, n_vocab: int) -> list[int]:
    """The n token ids that occur most often in `files` (shards), most used first, ties by the lower id;
    fewer if fewer distinct ids occur. One pass, one shard in memory at a time."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for f in files:
        counts += np.bincount(read_shard(f), minlength=n_vocab)[:n_vocab]
    order = np.lexsort((np.arange(n_vocab), -counts))  # by count descending, then id
    return [int(t) for t in order[:n] if counts[t] > 0]


def check_vocab(files: Sequence[Path], n_vocab: int) -> None:
    """Raise ValueError naming the shard and offset of the first token id >= n_vocab, if any.

    Checked when training starts, so that data tokenized for a larger vocabulary than the model's
    fails at once rather than when the loop reaches the token.
    """
    for f in files:
        found = first_token_at_least(f, n_vocab)
        if found is not None:
            offset, token = found
            top = int(read_shard(f).max())
            raise ValueError(
                f"{f}: token {token} at offset {offset} is outside the model's vocabulary (n_vocab {n_vocab}, "
                f"ids 0..{n_vocab - 1}); this shard holds ids up to {top}: the data was tokenized for a "
                f"larger vocabulary than the model's"
            )
