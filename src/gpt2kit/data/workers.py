"""prepare's tokenizer processes: one document's tokens, and an ordered pool that fails fast."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait
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
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked at start; ignored from now on

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
    """An ordered, bounded `imap` over `workers` tokenizer processes that fails fast and stops at once.

    Each worker has a pipe of its own and shares no lock with the others or with this process: a
    worker killed in the middle of sending a result is an end of file on its pipe here, never a lock
    held forever (concurrent.futures' pool shares one result queue and its lock, so a worker killed
    while writing to it hung the pool and, through the exit-time join of its manager thread, the
    interpreter). The pool starts no thread here. Workers are started with SIGINT blocked and then
    ignore it: on Ctrl-C (or any error) this process kills them and returns without their tracebacks.
    A worker that dies raises WorkerDied naming the document being tokenized.
    """
    ctx = mp.get_context("spawn")  # not fork: forking a parent that runs torch's threads can deadlock the children
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        with _sigint_blocked():  # a Ctrl-C now would cut a worker's start-up data in half
            for _ in range(workers):
                here, there = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_serve, args=(there,), daemon=True, name="gpt2kit-tokenizer")
                proc.start()
                there.close()  # the worker's end lives in the worker only: its death is an end of file here
                procs.append(proc)
                conns.append(here)
        yield lambda tasks: _ordered(tasks, procs, conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(None)  # done: the worker returns
        for proc in procs:
            proc.join(5)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL: also a worker stopped or stuck in native code
        for proc in procs:
            proc.join()
        for conn in conns:
            conn.close()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Ctrl-C held off while workers start: blocked in this thread, so the children start with it
    blocked, and, because another thread of this process (a library's) may still take a signal sent
    to the process, Python's handler swapped for one that only records it. A KeyboardInterrupt in the
    middle of a start left a stopped worker out of the list this module kills, and
    multiprocessing's exit then waited on it for ever. A Ctrl-C that came meanwhile is raised at the end."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield  # Windows, or not the main thread (no handler can be set there): nothing to hold off
        return
    got: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # one pending here is delivered now, to the recorder
        signal.signal(signal.SIGINT, handler)
    if got and handler is not signal.SIG_IGN:
        if callable(handler):
            handler(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt
        else:
            raise KeyboardInterrupt


def _ordered(tasks: Iterable[Task], procs: list, conns: list) -> Iterator[Result]:
    """Every task's result in task order: chunks go to whichever worker is free, at most 2 at a
    worker and 4 per worker in all (results waiting for an earlier chunk included)."""
    tasks = iter(tasks)  # a list too (a shuffled run's): each chunk takes the next tasks
    chunks = enumerate(iter(lambda: [t for _, t in zip(range(_CHUNK), tasks, strict=False)], []))
    pending: list[collections.deque] = [collections.deque() for _ in procs]  # per worker: (chunk, its first path)
    done: dict[int, list[Result]] = {}
    following, exhausted = 0, False
    while True:
        while following in done:
            yield from done.pop(following)
            following += 1
        for w, conn in enumerate(conns):  # top up
            while not exhausted and len(pending[w]) < 2 and len(done) + sum(map(len, pending)) < 4 * len(procs):
                item = next(chunks, None)
                if item is None:
                    exhausted = True
                    break
                pending[w].append((item[0], item[1][0][0]))
                try:
                    conn.send(item[1])
                except OSError:  # its end is closed: it died
                    raise _died(item[1][0][0]) from None
        if exhausted and not any(pending):
            return
        busy = [w for w in range(len(procs)) if pending[w]]
        ready = set(wait([conns[w] for w in busy] + [procs[w].sentinel for w in busy]))
        for w in busy:
            if conns[w] not in ready and procs[w].sentinel not in ready:
                continue
            i, path = pending[w][0]
            try:
                ok, payload = conns[w].recv()  # a dead worker's pipe reads to its end: EOFError
            except (EOFError, OSError):
                raise _died(path) from None
            pending[w].popleft()
            if not ok:
                raise payload
            done[i] = payload


def _died(path: str) -> WorkerDied:
    return WorkerDied(f"a tokenizer process died (killed, out of memory, or crashed) while tokenizing {path} "
                      f"or the documents after it; nothing was written")


def _serve(conn) -> None:
    """A worker: chunks of tasks in, their results out, until None or the parent's end closes. A
    thread takes the chunks in as they come, so the parent's send never waits on this process
    sending a result (each side would wait on the other with both pipes full)."""
    init_worker(ignore_sigint=True)
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                item = None
            inbox.put(item)
            if item is None:
                return

    threading.Thread(target=receive, daemon=True).start()
    while (chunk := inbox.get()) is not None:
        try:
            out = (True, _tokenize_chunk(chunk))
        except Exception as e:  # the parent raises it, as if raised there
            out = (False, e)
        try:
            try:
                conn.send(out)
            except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
                conn.send((False, RuntimeError(f"{type(out[1]).__name__}: {out[1]}")))
        except OSError:  # the parent is gone
            return
