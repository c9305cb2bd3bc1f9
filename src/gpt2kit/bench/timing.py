"""Timing for the benchmark: the best of alternating trials, and which trials were quiet.

On Linux a trial during which other processes used the CPU (/proc/stat against this process's own
ticks) is not quiet; `time_alternating` runs the functions in turn until each has enough quiet trials (or
the trials run out), and can wait before each trial for the machine to go idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt2kit.bench.machine import cpu_ticks as _cpu_ticks


@dataclass
class Timing:
    seconds: float  # best trial
    quiet: int  # trials during which no other process used the CPU
    trials: int


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
                     wait: float = 0.0) -> dict[str, Timing]:
    """Best wall time of each fn, running them in turn; stop once each has `trials` quiet trials.
    wait: before each trial, wait up to this many seconds for other processes to leave the CPU."""
    results = {k: Timing(float("inf"), 0, 0) for k in fns}
    quiet_times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max_trials):
        for name, fn in fns.items():
            r = results[name]
            if r.quiet >= trials:
                continue
            dt, quiet = trial(fn, wait)
            r.trials += 1
            if quiet:
                r.quiet += 1
                quiet_times[name].append(dt)
            r.seconds = min(quiet_times[name]) if quiet_times[name] else min(r.seconds, dt)
        if all(r.quiet >= trials for r in results.values()):
            break
    return results
