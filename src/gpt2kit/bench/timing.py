"""Timing for the benchmark: the best of alternating trials, which trials were quiet, and whether a
figure can be trusted.

On Linux a trial during which other processes used the CPU (/proc/stat against this process's own
ticks) is not quiet; `time_alternating` runs the functions in turn until each has enough quiet trials (or
the trials run out), and can wait before each trial for the machine to go idle. `doubt` says why a
timing is not a figure to quote (no quiet trials, or quiet trials far apart); `busy_cores` how much of
the machine other processes were using, for the run as a whole.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpt2kit.decode.kernel_choice import others_busy
from gpt2kit.machine import cpu_ticks as _cpu_ticks

MIN_QUIET = 2  # quiet trials a figure needs: one alone cannot show that the machine's speed held still
MAX_SPREAD = 0.25  # quiet trials further apart than this (slowest / fastest - 1): the speed drifted
BUSY_CORES = 0.5  # cores of other processes' work, before or after the run, that make the machine busy


@dataclass
class Timing:
    seconds: float  # best quiet trial (best trial when none was quiet)
    quiet: int  # trials during which no other process used the CPU
    trials: int
    quiet_times: list[float] = field(default_factory=list)  # seconds of each quiet trial, in order

    @property
    def spread(self) -> float | None:
        """How far apart the quiet trials are (slowest / fastest - 1); None with fewer than two."""
        if len(self.quiet_times) < 2:
            return None
        return max(self.quiet_times) / min(self.quiet_times) - 1


def doubt(t: Timing) -> str | None:
    """Why t's best time is not a figure to quote (other processes used the CPU during its trials, or
    its quiet trials disagree), or None when it is."""
    if t.quiet == 0:
        return f"no quiet trial (0 of {t.trials})"
    if t.quiet < MIN_QUIET:
        return f"only {t.quiet} quiet trial of {t.trials}"
    if t.spread is not None and t.spread > MAX_SPREAD:
        return f"quiet trials {t.spread:.0%} apart"
    return None


def machine_doubt(before: float | None, after: float | None, cores: int) -> str | None:
    """Why the machine as a whole was too busy for figures to quote (other processes' cores of work just
    before and just after the timings, as busy_cores measured them), or None."""
    for when, busy in (("before", before), ("after", after)):
        if busy is not None and busy > BUSY_CORES:
            return f"other processes were using {busy:.1f} of {cores} cores {when} the timings"
    return None


def busy_cores(seconds: float = 0.5) -> float | None:
    """Cores' worth of CPU other processes used over the next `seconds` (None where /proc is absent)."""
    if _cpu_ticks() is None:
        return None
    return others_busy(lambda: time.sleep(seconds))[1]


def _wait_for_idle(max_wait: float, idle: float = 1.0) -> None:
    """On a shared machine, wait (at most max_wait s) until other processes have left the CPU
    alone for `idle` seconds, so that a trial has a chance to be quiet."""
    start = last = _cpu_ticks()
    if start is None:
        return
    t0 = quiet_since = time.monotonic()
    while time.monotonic() - t0 < max_wait and time.monotonic() - quiet_since < idle:
        time.sleep(0.2)
        now = _cpu_ticks()
        if (now[0] - last[0]) - (now[1] - last[1]) > 4:  # over ~20% of a core in 0.2 s
            quiet_since = time.monotonic()
        last = now


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn, then wait for the device's queued work (CUDA runs asynchronously), so a trial times it all."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)
    return run


def trial(fn: Callable[[], object], wait: float = 0.0) -> tuple[float, bool]:
    if wait:
        _wait_for_idle(wait)
    before = _cpu_ticks()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    after = _cpu_ticks()
    if before is None or after is None:
        return dt, True
    others = (after[0] - before[0]) - (after[1] - before[1])
    # Background daemons use ~1% of a core here; more than 5% of one core is another workload.
    return dt, others <= 2 + 0.05 * dt * os.sysconf("SC_CLK_TCK")


def time_alternating(fns: dict[str, Callable[[], object]], trials: int, max_trials: int,
                     wait: float = 0.0, on_trial: Callable[[str, int, float, bool], None] | None = None
                     ) -> dict[str, Timing]:
    """Best wall time of each fn, running them in turn; stop once each has `trials` quiet trials.
    wait: before each trial, wait up to this many seconds for other processes to leave the CPU.
    on_trial(name, trial number from 1, seconds, quiet): called after each trial (progress)."""
    results = {k: Timing(float("inf"), 0, 0) for k in fns}
    for _ in range(max_trials):
        for name, fn in fns.items():
            r = results[name]
            if r.quiet >= trials:
                continue
            dt, quiet = trial(fn, wait)
            r.trials += 1
            if quiet:
                r.quiet += 1
                r.quiet_times.append(dt)
            r.seconds = min(r.quiet_times) if r.quiet_times else min(r.seconds, dt)
            if on_trial is not None:
                on_trial(name, r.trials, dt, quiet)
        if all(r.quiet >= trials for r in results.values()):
            break
    return results
