"""prepare's tokenizer processes: one document's tokens, and an ordered pool that fails fast."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from gpt2kit.data.documents import Task, document_text
from gpt2kit.tokenizer import Tokenizer

Result = tuple[np.ndarray, str | None]  # ([eot, *tokens] as uint16, its path if undecodable bytes were replaced)

_TOKENIZER: Any = None  # per worker process, set by init_worker
_CHUNK = 16  # documents per message to a worker


class WorkerDied(RuntimeError):
    """A tokenizer process ended without an answer (killed, out of memory, or crashed in native code)."""


def init_worker(ignore_sigint: bool = False) -> None:
    global _TOKENIZER
    if ignore_sigint:  # Ctrl-C reaches the whole process group; the parent alone handles it
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    _TOKENIZER = Tokenizer.default()


def tokenize_doc(task: Task) -> Result:
    """One document -> ([eot, *tokens] as uint16, its path if undecodable bytes were replaced)."""
    text, replaced = document_text(task)
    ids = _TOKENIZER.encode(text)
    out = np.empty(len(ids) + 1, dtype=np.uint16)
    out[0] = _TOKENIZER.eot_token
    out[1:] = ids
    return out, task[0] if replaced else None


def _tokenize_chunk(tasks: list[Task]) -> list[Result]:
    return [tokenize_doc(t) for t in tasks]


@contextlib.contextmanager
def tokenized(tasks: Iterable[Task], workers: int) -> Iterator[Iterable[Result]]:
    """Every task's result, in task order: in this process for workers=1, else from a pool of `workers`."""
    if workers == 1:
        init_worker()
        yield map(tokenize_doc, tasks)
    else:
        with worker_pool(workers) as imap:
            yield imap(tasks)


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[Callable[[Iterable[Task]], Iterator[Result]]]:
    """An ordered, bounded `imap` over a process pool that fails fast.

    multiprocessing.Pool replaces a worker that dies and waits forever for the task it lost;
    concurrent.futures marks the whole pool broken instead, which we turn into WorkerDied naming the
    document being tokenized. Workers ignore SIGINT: on Ctrl-C (or any error) the parent terminates
    them and returns at once, without their tracebacks.
    """
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: forking a parent that runs torch's threads can deadlock the children
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=init_worker,
                               initargs=(True,))

    def imap(tasks: Iterable[Task]) -> Iterator[Result]:
        pending: collections.deque = collections.deque()
        tasks = iter(tasks)  # a list too (a shuffled run's): each chunk takes the next tasks
        chunks = iter(lambda: [t for _, t in zip(range(_CHUNK), tasks, strict=False)], [])
        for chunk in chunks:
            pending.append((chunk[0][0], pool.submit(_tokenize_chunk, chunk)))
            while len(pending) >= 4 * workers:
                yield from _result(*pending.popleft())
        while pending:
            yield from _result(*pending.popleft())

    def _result(path: str, future) -> list[Result]:
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
