"""What a training run reports: metrics.jsonl, loss.png and the progress shown while it runs.

`Metrics` appends one JSON object per line to OUT/metrics.jsonl (flushed per line, so a crash loses
at most the line being written) and keeps the loss history that `plot` draws into OUT/loss.png.
`Reporter` is rank 0's console output: a tqdm bar when stderr is a terminal, plain log lines
otherwise.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpt2kit._io import atomic_write

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


class Metrics:
    """metrics.jsonl (appended, flushed per line) and the loss history behind loss.png."""

    def __init__(self, out: Path, resume_step: int | None):
        self.path = out / METRICS_NAME
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        lines: list[str] = []
        if resume_step is not None and self.path.exists():
            # Drop what was logged after the checkpoint: those steps are about to be redone.
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(rec, dict) and rec.get("step", math.inf) <= resume_step:
                    lines.append(line)
                    self._remember(rec)
        atomic_write(self.path, lambda f: f.write("".join(x + "\n" for x in lines).encode()))
        self.file = open(self.path, "a", encoding="utf-8")  # closed in close()

    def _remember(self, rec: dict[str, Any]) -> None:
        if rec.get("loss") is not None:
            self.train.append((rec["step"], rec["loss"]))
        if rec.get("val_loss") is not None:
            self.val.append((rec["step"], rec["val_loss"]))

    def log(self, rec: dict[str, Any]) -> None:
        # Strict JSON: a non-finite number is written as null, never as a bare NaN / Infinity.
        rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        self._remember(rec)
        self.file.write(json.dumps(rec, allow_nan=False) + "\n")
        self.file.flush()

    def plot(self, path: Path, title: str) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global state, no GUI
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if self.train:
            steps, losses = zip(*self.train, strict=True)
            ax.plot(steps, losses, lw=0.6, alpha=0.35, color="C0")
            ax.plot(steps, smooth(losses), lw=1.5, color="C0", label="train (smoothed)")
        if self.val:
            ax.plot(*zip(*self.val, strict=True), "o-", ms=3, label="validation")
        ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
        ax.grid(alpha=0.3)
        if self.train or self.val:
            ax.legend()
        atomic_write(path, lambda f: fig.savefig(f, format="png"))

    def close(self) -> None:
        self.file.close()


def smooth(values: tuple[float, ...]) -> list[float]:
    """Exponential moving average with a span of ~1/20 of the run, debiased (as TensorBoard's)."""
    beta = 1 - 1 / max(1.0, len(values) / 20)
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i) if beta else v)
    return out


class Reporter:
    """Rank 0's output: a tqdm bar when stderr is a terminal, plain log lines otherwise.

    Plain lines come every `log_every` steps, and at least every `heartbeat` seconds, and carry the
    elapsed time and an ETA (the mean step time of this invocation times the steps left), so a log
    file shows how far a run is. Evaluations report their own progress (`evaluating`).
    """

    def __init__(self, enabled: bool, start: int, total: int, log_every: int, heartbeat: float = 60.0):
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.start_step = start
        self.heartbeat = heartbeat
        self.t0 = time.monotonic()
        self.last_line = self.t0
        self.step_seconds = 0.0  # time in training steps only, for the ETA
        self.eval_seconds = 0.0  # how long the last evaluation took
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        self.last_line = time.monotonic()
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def step(self, rec: dict[str, Any], seconds: float) -> None:
        self.step_seconds += seconds
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update()
            return
        step = rec["step"]
        due = step % self.log_every == 0 or step == self.total
        if due or time.monotonic() - self.last_line >= self.heartbeat:
            done = step - self.start_step
            eta = self.step_seconds / done * (self.total - step) if done else 0.0
            self.line(f"step {step}/{self.total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                      f"grad norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
                      f"elapsed {clock(time.monotonic() - self.t0)} | ETA {clock(eta)}")

    @contextlib.contextmanager
    def evaluating(self, batches: int) -> Iterator[Callable[[], None]]:
        """Progress of one evaluation: yields a function to call after each batch."""
        t0 = time.monotonic()
        bar = None
        if self.enabled and self.bar is not None:
            from tqdm import tqdm

            bar = tqdm(total=batches, unit="batch", desc="evaluating", leave=False, dynamic_ncols=True,
                       file=sys.stderr)
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            if bar is not None:
                bar.update()
            elif self.enabled and time.monotonic() - self.last_line >= min(self.heartbeat, 10.0):
                self.line(f"evaluating: {done}/{batches} batches, {clock(time.monotonic() - t0)}")

        try:
            yield advance
        finally:
            if bar is not None:
                bar.close()
        self.eval_seconds = time.monotonic() - t0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def clock(seconds: float) -> str:
    """H:MM:SS."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
