"""What a training run keeps in OUT besides the model: checkpoint.pt and the lock.

checkpoint.pt is written atomically (temporary file, fsync, rename) and ends with the SHA-256 of
its contents, which reading it checks; it holds the RNG states of every rank (`rng_state`,
`set_rng_state`) beside the model and optimizer. `claim_out` takes an exclusive flock on OUT/.lock
for the length of a run, so a second run into the same directory stops at once naming the holder,
and removes half-written temporaries a killed run left behind. gpt2kit.train.loop calls these.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2kit._io import atomic_write
from gpt2kit.train.distributed import Dist

CHECKPOINT_NAME = "checkpoint.pt"
LOCK_NAME = ".lock"  # held (flock) by the run writing OUT
CHECKPOINT_FORMAT = "gpt2kit-train/1"


# checkpoint.pt is torch.save's zip archive followed by a trailer holding the SHA-256 of the archive
# (zip readers find their directory from the end and ignore what follows). One file, so the
# atomic rename keeps the data and its checksum together.
_TRAILER_TAG = b"\ngpt2kit-sha256 "
_TRAILER_LEN = len(_TRAILER_TAG) + 64 + 1


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through it."""

    def __init__(self, f: Any):
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    def write(f: Any) -> None:
        hashing = _HashingWriter(f)
        torch.save(state, hashing)
        f.write(_TRAILER_TAG + hashing.sha.hexdigest().encode() + b"\n")

    atomic_write(path, write)  # a full disk (torch's "[enforce fail ...]" included) is said by _io


def _verify_checkpoint(path: Path) -> None:
    """Check the recorded SHA-256; a mismatch means the file changed after it was written."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < _TRAILER_LEN:
            return  # too short to hold a trailer: torch.load reports what is wrong with it
        f.seek(size - _TRAILER_LEN)
        trailer = f.read()
        if not trailer.startswith(_TRAILER_TAG):
            return  # written before checkpoints carried a checksum
        want = trailer[len(_TRAILER_TAG):-1].decode("ascii", errors="replace")
        sha = hashlib.sha256()
        f.seek(0)
        left = size - _TRAILER_LEN
        while left:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            sha.update(block)
            left -= len(block)
    if sha.hexdigest() != want:
        raise ValueError(f"{path}: checksum mismatch: the file was damaged after it was written (SHA-256 "
                         f"{sha.hexdigest()[:16]}..., recorded {want[:16]}...); restore it from a copy or "
                         f"start a new run")


def read_checkpoint(path: Path, *, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint to resume from (train without --resume first)")
    if verify:
        _verify_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # any unreadable file is one user-facing error
        raise ValueError(f"{path}: not a readable gpt2kit training checkpoint ({e})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a gpt2kit training checkpoint (expected format {CHECKPOINT_FORMAT!r})")
    return ckpt


def rng_state(device: torch.device) -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, np_keys, np_pos, np_has_gauss, np_cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), int(np_pos), int(np_has_gauss), np_cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------
# the lock on OUT


class OutInUse(RuntimeError):
    """Another training process holds the lock on the output directory."""


@contextlib.contextmanager
def claim_out(out: Path, d: Dist) -> Iterator[None]:
    """Create OUT if needed and hold an exclusive lock on it while the run lasts (rank 0 takes it).

    Two runs writing one OUT would interleave their checkpoints and metrics; the second gets
    OutInUse naming the holder instead. The lock is an flock on OUT/.lock, so the kernel releases it
    when the holder exits, however it exits. A run that fails before writing anything removes the
    directories it created.
    """
    created = []
    if d.master:
        p = out
        while not p.exists() and p != p.parent:
            created.append(p)
            p = p.parent
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--out {out} is a file, not a directory")
    lock, error = None, None
    if d.master:
        out.mkdir(parents=True, exist_ok=True)
        lock, error = _lock(out / LOCK_NAME)
    error = d.broadcast(error)
    if error is not None:
        raise OutInUse(error)
    if d.master:
        _remove_stale_temporaries(out)
    try:
        yield
    except BaseException:
        if d.master and created and {p.name for p in out.iterdir()} <= {LOCK_NAME}:
            (out / LOCK_NAME).unlink(missing_ok=True)
            for p in created:  # the leaf first
                with contextlib.suppress(OSError):
                    p.rmdir()
        raise
    finally:
        if lock is not None:
            lock.close()  # closing the file releases the flock


# atomic_write's temporaries: mkstemp(prefix=".NAME.", suffix=".tmp") adds 8 characters.
_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def _remove_stale_temporaries(out: Path) -> None:
    """Delete half-written files a killed run left in OUT. Safe: we hold OUT's lock, so no live writer
    owns them."""
    for p in out.iterdir():
        if _TEMPORARY.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def _lock(path: Path) -> tuple[Any, str | None]:
    """(open lock file, None) with an exclusive flock held, or (None, a message naming the holder)."""
    import fcntl

    f = open(path, "a+", encoding="utf-8")  # held open while the run lasts
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return None, (f"{path.parent} is in use by another training run ({holder}); wait for it to finish, "
                      f"or choose another --out")
    except OSError as e:  # a filesystem without locks (some network mounts): run, but say so
        f.close()
        warnings.warn(f"{path.parent}: cannot lock the output directory ({e.strerror}); make sure no other "
                      f"run writes to it", stacklevel=4)
        return None, None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f, None
