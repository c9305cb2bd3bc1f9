"""The engine in a worker thread, so that the caller's thread (an event loop) never waits on the model."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpt2kit.engine.rows import EngineInterface, Row, RowEdits, RowEvent, RowKey
    from gpt2kit.sampling import SamplingSettings


class EngineLoop:
    """Runs an engine (any EngineInterface: the Engine) in a worker
    thread; the one object a server talks to. on_events(events) is called from the worker after
    every step; on_error(rows, exc) when a step raises (every row is
    dropped, the loop goes on) and, with just that row, for a row whose own sampling raised (its
    neighbours go on). :meth:`call` runs a function in the worker between steps (e.g. scoring a
    prompt) and returns a concurrent Future; :meth:`call_steps` runs a generator there one step
    per engine step (a search with its own forwards, e.g. contrastive search), so it goes on beside
    the rows instead of holding them up for its whole length. admission_window (seconds, 0: off):
    an engine woken from idle by an arrival waits that long (or until max_batch rows wait) before
    its first step, so requests that arrive together — clients whose rows all finished at one step
    send their next ones within milliseconds — are prefilled in one forward, not the first alone
    and the rest a step later. tidy(idle), if given, is called in the worker outside the lock: with
    True once the worker has had no work for tidy_after seconds (once per quiet spell), with False
    after every step (a server gives free memory back then, gpt2kit.serve.memory)."""

    def __init__(self, engine: EngineInterface, on_events: Callable[[list[RowEvent]], None],
                 on_error: Callable[[list[Row], BaseException], None], *, admission_window: float = 0.0,
                 tidy: Callable[[bool], None] | None = None, tidy_after: float = 0.5) -> None:
        self.engine, self.on_events, self.on_error = engine, on_events, on_error
        self.tidy, self.tidy_after = tidy, tidy_after
        self.admission_window = admission_window  # seconds an idle engine gathers arrivals before a step
        self._cond = threading.Condition()
        self._jobs: deque = deque()
        self._new_steps: deque = deque()  # (future, generator) handed in, not yet stepping
        self._stepping: list = []  # the worker's own: generators advanced once per engine step
        self._stop = False
        self.steps = 0  # engine steps run (the server's /metrics: gpt2kit_engine_steps)
        self._thread = threading.Thread(target=self._run, name="gpt2kit-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, *, seed: int | None = None,
                sample_index: int = 0, logprobs: int | None = None, key: RowKey | None = None,
                edits: RowEdits | None = None) -> Row:
        """The engine's new_row (any thread: it only reads the model's config and device)."""
        return self.engine.new_row(prompt, settings, seed=seed, sample_index=sample_index, logprobs=logprobs,
                                   key=key, edits=edits)

    def new_beam_rows(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None
                      ) -> list[Row]:
        """The engine's new_beam_rows (any thread, as new_row)."""
        return self.engine.new_beam_rows(prompt, settings, key=key)

    def new_lease(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None) -> Row:
        """The engine's new_lease (any thread, as new_row)."""
        return self.engine.new_lease(prompt, settings, key=key)

    def submit(self, rows: Sequence[Row]) -> None:
        self.engine.submit(rows)
        with self._cond:
            self._cond.notify()

    def cancel(self, row: Row) -> None:
        self.engine.cancel(row)

    @property
    def n_running(self) -> int:
        return self.engine.n_running

    @property
    def n_waiting(self) -> int:
        return self.engine.n_waiting

    def call(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        with self._cond:
            self._jobs.append((fut, fn, args, kwargs))
            self._cond.notify()
        return fut

    def call_steps(self, steps: Iterator) -> concurrent.futures.Future:
        """Advance the generator `steps` in the worker, one next() per loop iteration (between the
        engine's steps); its return value is the Future's result, what it raises its exception.
        Cancelling the Future closes the generator before its next step."""
        fut = concurrent.futures.Future()
        with self._cond:
            self._new_steps.append((fut, steps))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            idle = self._wait()
            with self._cond:
                if idle and self.admission_window > 0 and self.engine.n_running == 0:
                    self._gather()
                if self._stop:
                    return
                jobs, self._jobs = list(self._jobs), deque()
                self._stepping.extend(self._new_steps)
                self._new_steps.clear()
            for fut, fn, args, kwargs in jobs:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kwargs))
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            self._stepping = [job for job in self._stepping if _advance(*job)]
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as e:  # fail the rows, keep serving
                    self.steps += 1
                    self.on_error(self.engine.reset(), e)
                    continue
                self.steps += 1
                for ev in events:
                    if ev.error is not None:
                        self.on_error([ev.row], ev.error)
                self.on_events([ev for ev in events if ev.error is None])
                if self.tidy is not None:
                    self.tidy(False)

    def _has_work(self) -> bool:
        return bool(self._jobs or self._new_steps or self._stepping or self.engine.has_work)

    def _wait(self) -> bool:
        """Wait until there is work or a stop (holding no lock on return); whether it had to wait. Once
        quiet for tidy_after seconds, tidy(True) runs, outside the lock so that arrivals never wait on
        the condition for it."""
        idle, tidied = False, self.tidy is None
        while True:
            with self._cond:
                while not (self._stop or self._has_work()):
                    idle = True
                    if tidied:
                        self._cond.wait()
                    elif not self._cond.wait(self.tidy_after):
                        break  # quiet: tidy below
                else:
                    return idle
            self.tidy(True)
            tidied = True

    def _gather(self) -> None:
        """Woken from idle by an arrival: wait out the admission window (or until the queue holds a full
        batch, or a stop) so that requests arriving together start in one step. Holds the condition."""
        deadline, full = time.monotonic() + self.admission_window, self.engine.max_batch
        while not self._stop and (full is None or self.engine.n_waiting < full):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)


def _advance(fut: concurrent.futures.Future, steps: Iterator) -> bool:
    """One step of a call_steps generator; False once it is done (result or exception handed to
    fut) or fut was cancelled (the generator closed)."""
    if fut.cancelled():
        steps.close()
        return False
    try:
        next(steps)
        return True
    except StopIteration as done:
        _settle(fut, fut.set_result, done.value)
    except BaseException as e:  # handed to the caller
        _settle(fut, fut.set_exception, e)
    return False


def _settle(fut: concurrent.futures.Future, how: Callable, value) -> None:
    try:
        how(value)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile: no one waits for it
        pass
