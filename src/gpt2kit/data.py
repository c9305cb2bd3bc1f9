"""Token shards for training, in llm.c's GPT-2 shard format.

A shard is a 1024-byte header of 256 little-endian int32 (magic 20240520, version 1, token count,
then zeros) followed by the tokens as little-endian uint16. This is what llm.c's dev/data scripts
and modded-nanogpt write for FineWeb, so their shards load here and ours load there.

    prepare(["corpus/"], "shards/")          # text/.jsonl -> val_000000.bin, train_000000.bin, ...
    loader = ShardLoader("shards/", "train", batch_size=8, seq_len=1024, rank=r, world_size=W)
    x, y = loader.next_batch()               # (B, T) int64, y is x shifted left by one

Legend: B batch size, T sequence length, W world size (number of data-parallel ranks).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import math
import multiprocessing as mp
import os
import re
import signal
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from gpt2kit._io import atomic_write
from gpt2kit.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_SHARD_TOKENS = 2**31 - 1  # the count lives in an int32
DEFAULT_SHUFFLE_SEED = 1337


class ShardError(ValueError):
    """A file is not a valid llm.c GPT-2 token shard."""


# ---------------------------------------------------------------------------------------------
# one shard: write, validate, read


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

    path = Path(path)
    try:
        atomic_write(path, write)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on {path.parent} while writing {path.name}") from None
        raise


def _shard_token_count(path: Path) -> int:
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
    count = _shard_token_count(path)
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


# ---------------------------------------------------------------------------------------------
# prepare: text and .jsonl documents -> shards

_TOKENIZER: Any = None  # per worker process, set by _init_worker


def _init_worker(ignore_sigint: bool = False) -> None:
    global _TOKENIZER
    if ignore_sigint:  # Ctrl-C reaches the whole process group; the parent alone handles it
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    _TOKENIZER = Tokenizer.default()


def _decode(raw: bytes) -> tuple[str, bool]:
    """UTF-8 (a leading BOM dropped); undecodable bytes become U+FFFD. Returns (text, replaced)."""
    try:
        return raw.decode("utf-8-sig"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8-sig", errors="replace"), True


# A task is one document: (path, line number, raw line) for a .jsonl line, (path, 0, None) for a
# text file, which the worker reads itself so that big files are not piped through the parent,
# (path, 0, contents) for an input that can be read only once (a pipe, /dev/stdin), read up front, and
# in a shuffled run (which holds every task at once) a .jsonl line is its byte offset, read by the worker.
_Task = tuple[str, int, bytes | int | None]


def _jsonl_text(raw: bytes, path: str, lineno: int) -> tuple[str, bool]:
    line, replaced = _decode(raw)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: invalid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        found = f"keys {sorted(obj)}" if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f'{path}, line {lineno}: expected an object with a string "text" field, found {found}')
    return obj["text"], replaced


def _tokenize_doc(task: _Task) -> tuple[np.ndarray, str | None]:
    """One document -> ([eot, *tokens] as uint16, its path if undecodable bytes were replaced)."""
    path, lineno, raw = task
    if raw is None:
        text, replaced = _decode(Path(path).read_bytes())
    elif isinstance(raw, int):
        with open(path, "rb") as f:
            f.seek(raw)
            text, replaced = _jsonl_text(f.readline(), path, lineno)
    elif lineno == 0:
        text, replaced = _decode(raw)
    else:
        text, replaced = _jsonl_text(raw, path, lineno)
    ids = _TOKENIZER.encode(text)
    out = np.empty(len(ids) + 1, dtype=np.uint16)
    out[0] = _TOKENIZER.eot_token
    out[1:] = ids
    return out, path if replaced else None


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _collect_files(
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
            if _is_jsonl(p):
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


def _count_jsonl_docs(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _tasks(files: list[Path], once: dict[str, bytes], *, offsets: bool = False) -> Iterator[_Task]:
    for path in files:
        if str(path) in once:
            yield str(path), 0, once[str(path)]
        elif not _is_jsonl(path):
            yield str(path), 0, None
        else:
            with open(path, "rb") as f:
                offset = 0
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        yield str(path), lineno, offset if offsets else line
                    offset += len(line)


def _ordered_tasks(files: list[Path], once: dict[str, bytes], shuffle_seed: int | None) -> Iterable[_Task]:
    """Documents in path order, or permuted by numpy's default_rng(shuffle_seed).permutation(n_docs)."""
    if shuffle_seed is None:
        return _tasks(files, once)
    tasks = list(_tasks(files, once, offsets=True))
    order = np.random.default_rng(shuffle_seed).permutation(len(tasks))
    return [tasks[i] for i in order]


def _refuse_shards(files: list[Path]) -> None:
    """Token shards given to prepare would be tokenized as text: say what they are instead."""
    for f in files:
        if f.suffix == ".bin" and f.stat().st_size >= HEADER_BYTES:
            magic = int(np.fromfile(f, dtype="<i4", count=1)[0])
            if magic == MAGIC:
                raise ValueError(f"{f} is already a token shard (llm.c format): prepare reads text, and a shard's "
                                 f"documents cannot be re-shuffled here; point train --data at its directory "
                                 f"(training samples random windows from shards as they are)")


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
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not 1 <= shard_size <= MAX_SHARD_TOKENS:
        raise ValueError(f"shard_size must be in [1, {MAX_SHARD_TOKENS}], got {shard_size}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)
                                     or shuffle_seed < 0):
        raise ValueError(f"shuffle_seed must be an integer >= 0 or None, got {shuffle_seed!r}")
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    out = Path(os.path.abspath(out_dir))

    files, once = _collect_files(inputs, glob, exclude=out)
    _refuse_shards(files)
    n_docs = sum(_count_jsonl_docs(f) if _is_jsonl(f) and str(f) not in once else 1 for f in files)
    if n_docs == 0:
        names = ", ".join(str(i) for i in inputs) or "(no inputs)"
        raise ValueError(
            f"empty corpus: found {len(files)} files and no documents in {names} "
            f"(directories are searched for {glob!r}; .jsonl files need non-blank lines)"
        )
    n_val = _val_documents(val_fraction, n_docs)

    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)
    stale = _existing_shards(out)
    if stale and not overwrite:
        raise FileExistsError(f"{out} already holds shards ({stale[0].name}, ...); pass --overwrite "
                              f"(overwrite=True) to replace them, or choose another output directory")
    for p in stale:
        p.unlink()

    writer = _ShardWriter(out, shard_size)
    try:
        text_tokens = _tokenize_into(writer, _ordered_tasks(files, once, shuffle_seed), n_docs, n_val, workers,
                                     progress)
        writer.flush()
        if text_tokens == 0:
            names = ", ".join(str(i) for i in inputs)
            raise ValueError(f"empty corpus: the {n_docs} documents in {names} hold no text")
    except BaseException:
        writer.remove_all()
        raise

    summary = PrepareSummary(
        out_dir=out,
        documents=n_docs,
        val_documents=n_val,
        train_tokens=writer.tokens["train"],
        val_tokens=writer.tokens["val"],
        train_shards=writer.shards["train"],
        val_shards=writer.shards["val"],
    )
    record = summary.to_dict() | {
        "inputs": [str(i) for i in inputs],
        "glob": glob,
        "val_fraction": val_fraction,
        "shard_size": shard_size,
        "shuffle_seed": shuffle_seed,
    }
    atomic_write(out / "prepare.json", lambda f: f.write(json.dumps(record, indent=2).encode() + b"\n"))
    return summary


def _remove_stale_temporaries(out: Path) -> None:
    """Delete what a killed earlier run left half-written (atomic_write's `.<name>.<random>.tmp`)."""
    pattern = re.compile(r"\.(?:(?:train|val)_\d{6}\.bin|prepare\.json)\..+\.tmp")
    for p in out.iterdir():
        if pattern.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def _tokenize_into(
    writer: _ShardWriter, tasks: Iterable[_Task], n_docs: int, n_val: int, workers: int, progress: bool
) -> int:
    """Tokenize every document into `writer`; returns the number of tokens excluding separators."""
    warned: set[str] = set()
    text_tokens = 0
    with contextlib.ExitStack() as stack:
        if workers == 1:
            _init_worker()
            results: Iterable[tuple[np.ndarray, str | None]] = map(_tokenize_doc, tasks)
        else:
            results = stack.enter_context(_worker_pool(workers))(tasks)
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


class WorkerDied(RuntimeError):
    """A tokenizer process ended without an answer (killed, out of memory, or crashed in native code)."""


_CHUNK = 16  # documents per message to a worker


def _tokenize_chunk(tasks: list[_Task]) -> list[tuple[np.ndarray, str | None]]:
    return [_tokenize_doc(t) for t in tasks]


@contextlib.contextmanager
def _worker_pool(workers: int) -> Iterator[Callable[[Iterator[_Task]], Iterator[tuple[np.ndarray, str | None]]]]:
    """An ordered, bounded `imap` over a process pool that fails fast.

    multiprocessing.Pool replaces a worker that dies and waits forever for the task it lost;
    concurrent.futures marks the whole pool broken instead, which we turn into WorkerDied naming the
    document being tokenized. Workers ignore SIGINT: on Ctrl-C (or any error) the parent terminates
    them and returns at once, without their tracebacks.
    """
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: forking a parent that runs torch's threads can deadlock the children
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                               initargs=(True,))

    def imap(tasks: Iterable[_Task]) -> Iterator[tuple[np.ndarray, str | None]]:
        pending: collections.deque = collections.deque()
        tasks = iter(tasks)  # a list too (a shuffled run's): each chunk takes the next tasks
        chunks = iter(lambda: [t for _, t in zip(range(_CHUNK), tasks, strict=False)], [])
        for chunk in chunks:
            pending.append((chunk[0][0], pool.submit(_tokenize_chunk, chunk)))
            while len(pending) >= 4 * workers:
                yield from _result(*pending.popleft())
        while pending:
            yield from _result(*pending.popleft())

    def _result(path: str, future) -> list[tuple[np.ndarray, str | None]]:
        try:
            return future.result()
        except BrokenProcessPool:
            raise WorkerDied(f"a tokenizer process died (killed, out of memory, or crashed) while tokenizing "
                             f"{path} or the documents after it; nothing was written") from None

    ok = False
    try:
        yield imap
        ok = True
    finally:
        if not ok:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                with contextlib.suppress(Exception):
                    proc.terminate()
        pool.shutdown(wait=ok, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# loading batches


class ShardLoader:
    """Endless (x, y) batches from shards, split across data-parallel ranks as in llm.c/nanoGPT.

    Each step covers a window of W*B*T + 1 tokens starting at `position` in the current shard;
    rank r reads the r-th B*T (+1) slice of it, so ranks 0..W-1 stacked give exactly the batch
    one process with batch size W*B would get. Then position advances by W*B*T; when the next
    window does not fit, the loader moves to the next shard, and after the last shard wraps to
    the first and increments `epoch`. The tail of a shard that does not fill a window is skipped.

    The state (shard, position, epoch) is the same on every rank, so one rank's state_dict()
    resumes all of them exactly.
    """

    def __init__(
        self,
        data_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
        split: str = "train",
        *,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.files = _loader_files(type(self).__name__, data_dir_or_files, split, batch_size, seq_len, rank,
                                   world_size)
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.window = world_size * batch_size * seq_len + 1
        self.counts = [_shard_token_count(f) for f in self.files]
        for f, n in zip(self.files, self.counts, strict=True):
            if n < self.window:
                raise ValueError(
                    f"{f}: shard has {n} tokens, fewer than the {self.window} one step needs "
                    f"(world_size {world_size} * batch_size {batch_size} * seq_len {seq_len} + 1)"
                )
        self.reset()

    def check_vocab(self, n_vocab: int) -> None:
        """Raise ValueError naming the shard and offset of the first token id >= n_vocab, if any."""
        check_vocab(self.files, n_vocab)

    def reset(self) -> None:
        """Back to the start of the first shard, epoch 0."""
        self._set(shard=0, position=0, epoch=0)

    def _set(self, shard: int, position: int, epoch: int) -> None:
        self.shard, self.position, self.epoch = shard, position, epoch
        self._tokens = read_shard(self.files[shard])  # only the current shard stays mapped

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x, y), int64 tensors of shape (B, T) on the CPU; y[b, t] == x[b, t + 1] in the stream."""
        import torch

        BT = self.B * self.T
        start = self.position + self.rank * BT
        buf = torch.from_numpy(self._tokens[start : start + BT + 1].astype(np.int64))  # (B*T + 1,)
        x = buf[:-1].view(self.B, self.T)  # (B, T)
        y = buf[1:].view(self.B, self.T)  # (B, T)
        self._advance(self.position + self.world_size * BT)
        return x, y

    def _advance(self, position: int) -> None:
        if position + self.window <= self.counts[self.shard]:
            self.position = position
        elif self.shard + 1 < len(self.files):
            self._set(self.shard + 1, 0, self.epoch)
        else:
            self._set(0, 0, self.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "position": self.position,
            "epoch": self.epoch,
            "shard_name": self.files[self.shard].name,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); with the same shards and B, T, W the next batches are identical."""
        shard, position, epoch = int(state["shard"]), int(state["position"]), int(state["epoch"])
        if not 0 <= shard < len(self.files):
            raise ValueError(f"state names shard {shard}, but the loader has {len(self.files)} shards")
        name = state.get("shard_name")
        if name is not None and name != self.files[shard].name:
            raise ValueError(
                f"state was saved at shard {shard} = {name}, but here shard {shard} is {self.files[shard].name}"
            )
        if not 0 <= position <= self.counts[shard]:
            raise ValueError(
                f"state position {position} is outside shard {self.files[shard]} ({self.counts[shard]} tokens)"
            )
        self._set(shard, position, epoch)
        if position + self.window > self.counts[shard]:  # saved with a smaller window: move on as usual
            self._advance(position)


def _loader_files(who: str, data_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike], split: str,
                  batch_size: int, seq_len: int, rank: int, world_size: int) -> list[Path]:
    """The shard files a loader reads, after the checks every loader makes of its arguments."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if isinstance(data_dir_or_files, (str, os.PathLike)):
        p = Path(data_dir_or_files)
        return find_shards(p, split) if p.is_dir() else [p]
    files = [Path(f) for f in data_dir_or_files]
    if not files:
        raise ValueError(f"{who} needs at least one shard file")
    return files


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


class RandomWindowLoader:
    """Endless (x, y) batches of windows drawn at random from all shards, as nanoGPT samples them.

    Batch k (counted from 0 over the whole run) is W*B windows of T+1 tokens whose starts are drawn
    uniformly, with replacement, from every position of every shard where a window fits, by a
    generator seeded with (seed, k); rank r takes windows r*B .. r*B+B-1. So one process with batch
    size W*B gets exactly the batches that W ranks get together, and the state is one counter:
    state_dict() on any rank resumes all of them exactly. A window may span two documents (they are
    separated by <|endoftext|>, as in a sequential read), never two shards.
    """

    def __init__(
        self,
        data_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
        split: str = "train",
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.files = _loader_files(type(self).__name__, data_dir_or_files, split, batch_size, seq_len, rank,
                                   world_size)
        self.B, self.T, self.rank, self.world_size, self.seed = batch_size, seq_len, rank, world_size, seed
        self.counts = [_shard_token_count(f) for f in self.files]
        starts = np.array([max(0, n - seq_len) for n in self.counts], dtype=np.int64)  # windows per shard
        if not starts.sum():
            raise ValueError(f"no shard in {[f.name for f in self.files]} holds the {seq_len + 1} tokens "
                             f"one window needs (seq_len {seq_len} + 1)")
        self._ends = np.cumsum(starts)  # (shards,): window index bounds
        self._tokens: dict[int, np.ndarray] = {}
        self.batches = 0

    def check_vocab(self, n_vocab: int) -> None:
        """Raise ValueError naming the shard and offset of the first token id >= n_vocab, if any."""
        check_vocab(self.files, n_vocab)

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._tokens:
            self._tokens[i] = read_shard(self.files[i])
        return self._tokens[i]

    def windows(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's windows of batch `batch`: (shard index (B,), start offset in it (B,))."""
        rng = np.random.default_rng([self.seed, batch])
        picks = rng.integers(0, int(self._ends[-1]), size=self.world_size * self.B)  # (W*B,)
        picks = picks[self.rank * self.B : (self.rank + 1) * self.B]  # (B,): this rank's windows
        shards = np.searchsorted(self._ends, picks, side="right")  # (B,)
        return shards, picks - np.concatenate(([0], self._ends))[shards]  # (B,), (B,)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x, y), int64 tensors of shape (B, T) on the CPU; y[b, t] == x[b, t + 1] in the stream."""
        import torch

        shards, offsets = self.windows(self.batches)
        buf = np.stack([self._shard(int(s))[o : o + self.T + 1] for s, o in zip(shards, offsets, strict=True)])
        buf = torch.from_numpy(buf.astype(np.int64))  # (B, T + 1)
        self.batches += 1
        return buf[:, :-1], buf[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sampling": "random", "batches": self.batches, "seed": self.seed,
                "shard_names": [f.name for f in self.files]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); with the same shards, seed and B, T, W the next batches are identical."""
        if state.get("sampling") != "random":
            raise ValueError("the saved data position is a sequential read, not random windows")
        names = [f.name for f in self.files]
        if state.get("shard_names", names) != names:
            raise ValueError(f"state was saved with shards {state['shard_names']}, but here they are {names}")
        self.seed = int(state.get("seed", self.seed))
        self.batches = int(state["batches"])
