"""What a training run reports: metrics.jsonl, loss.png and the progress shown while it runs.

`Metrics` appends one JSON object per line to OUT/metrics.jsonl (flushed per line, so a crash loses
at most the line being written) and keeps the history that `plot` draws into OUT/loss.png (loss,
learning rate and gradient norm against step; `figure` builds it). `Reporter` is rank 0's console
output: a tqdm bar when stderr is a terminal, plain log lines otherwise; its ETA (`eta_seconds`)
counts the evaluations still to come.
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

from tqdm import tqdm

from gpt2kit._io import atomic_write
from gpt2kit.progress import clock

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"
TRAIN_COLOUR, VAL_COLOUR, LR_COLOUR, GRAD_COLOUR = "C0", "C1", "C2", "C3"


class Metrics:
    """metrics.jsonl (appended, flushed per line) and the loss history behind loss.png."""

    def __init__(self, out: Path, resume_step: int | None):
        self.path = out / METRICS_NAME
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.lr: list[tuple[int, float]] = []
        self.grad_norm: list[tuple[int, float]] = []
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
        if rec.get("lr") is not None:
            self.lr.append((rec["step"], rec["lr"]))
        if rec.get("grad_norm") is not None:
            self.grad_norm.append((rec["step"], rec["grad_norm"]))

    def log(self, rec: dict[str, Any]) -> None:
        # Strict JSON: a non-finite number is written as null, never as a bare NaN / Infinity.
        rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        self._remember(rec)
        self.file.write(json.dumps(rec, allow_nan=False) + "\n")
        self.file.flush()

    def figure(self, title: str):
        """loss.png's figure: train (raw and smoothed) and validation loss in two colours with a legend,
        above the learning rate and the gradient norm (a matplotlib Figure, drawn off-screen)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global state, no GUI
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullFormatter

        fig = Figure(figsize=(8, 7), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        loss_ax, lr_ax, gn_ax = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1, 1))
        if self.train:
            steps, losses = zip(*self.train, strict=True)
            loss_ax.plot(steps, losses, lw=0.6, alpha=0.35, color=TRAIN_COLOUR, label="train")
            loss_ax.plot(steps, smooth(losses), lw=1.5, color=TRAIN_COLOUR, label="train (smoothed)")
        if self.val:
            loss_ax.plot(*zip(*self.val, strict=True), "o-", ms=3, color=VAL_COLOUR, label="validation")
        loss_ax.set(ylabel="loss (nats/token)", title=title)
        if self.train or self.val:
            loss_ax.legend()
        if self.lr:
            lr_ax.plot(*zip(*self.lr, strict=True), lw=1.2, color=LR_COLOUR, label="learning rate")
        lr_ax.set(ylabel="lr")
        if self.grad_norm:
            gn_ax.plot(*zip(*self.grad_norm, strict=True), lw=0.8, color=GRAD_COLOUR,
                       label="grad norm (before clipping)")
            if all(g > 0 for _, g in self.grad_norm):
                gn_ax.set_yscale("log")  # spikes of 10-100x are what this panel is for
                gn_ax.yaxis.set_minor_formatter(NullFormatter())
        gn_ax.set(xlabel="step", ylabel="grad norm")
        for ax in (loss_ax, lr_ax, gn_ax):
            ax.grid(alpha=0.3)
        return fig

    def plot(self, path: Path, title: str) -> None:
        fig = self.figure(title)
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


def evaluations_left(step: int, total: int, eval_every: int) -> int:
    """How many evaluations the training loop still runs once step `step` is trained, that step's own
    included (the loop reports a step, then evaluates after it): one at every multiple of `eval_every`
    from `step` to `total` (0: none), and one at the last step."""
    if step > total:
        return 0
    first = max(step, 1)  # a fine-tune's step-0 evaluation runs before the first step, before any ETA
    periodic = total // eval_every - (first - 1) // eval_every if eval_every > 0 else 0
    return periodic + (0 if eval_every > 0 and total % eval_every == 0 else 1)


def eta_seconds(*, step: int, total: int, seconds_per_step: float, eval_every: int,
                seconds_per_eval: float | None) -> float:
    """Seconds until the run ends, after step `step`: the steps left at `seconds_per_step`, plus every
    evaluation still to run (`evaluations_left`, step's own included) at `seconds_per_eval` (None:
    the run has no validation split)."""
    steps = max(0, total - step) * seconds_per_step
    if seconds_per_eval is None:
        return steps
    return steps + evaluations_left(step, total, eval_every) * seconds_per_eval


class Reporter:
    """Rank 0's output: a tqdm bar when stderr is a terminal, plain log lines otherwise.

    Plain lines come every `log_every` steps, and at least every `heartbeat` seconds, and carry the
    elapsed time and an ETA, so a log file shows how far a run is; the bar shows the same ETA. The
    ETA is this invocation's mean step time times the steps left, plus the evaluations to come, the
    one right after the step shown included (`eval_every`; `eval_tokens` tokens each, 0 for no
    validation) at the mean time the evaluations so far took, or, before the first, at the training
    steps' tokens per second (an overestimate: an evaluation is a forward pass only). Evaluations
    report their own progress (`evaluating`).
    """

    def __init__(self, enabled: bool, start: int, total: int, log_every: int, heartbeat: float = 60.0, *,
                 eval_every: int = 0, eval_tokens: int = 0):
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.start_step = start
        self.heartbeat = heartbeat
        self.eval_every = eval_every
        self.eval_tokens = eval_tokens
        self.t0 = time.monotonic()
        self.last_line = self.t0
        self.step_seconds = 0.0  # time in training steps only, for the ETA
        self.step_tokens = 0.0
        self.eval_seconds = 0.0  # how long the last evaluation took
        self.eval_times: list[float] = []  # every evaluation of this invocation, for the ETA
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
                            postfix="ETA ?")

    def eta(self, step: int) -> float:
        """Seconds left after `step` (see the class docstring); 0 before any step of this invocation."""
        done = step - self.start_step
        if done <= 0 or self.step_seconds <= 0:
            return 0.0
        if not self.eval_tokens:
            per_eval = None
        elif self.eval_times:
            per_eval = sum(self.eval_times) / len(self.eval_times)
        else:
            per_eval = self.eval_tokens * self.step_seconds / self.step_tokens if self.step_tokens else 0.0
        return eta_seconds(step=step, total=self.total, seconds_per_step=self.step_seconds / done,
                           eval_every=self.eval_every, seconds_per_eval=per_eval)

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
        self.step_tokens += rec["tokens_per_s"] * seconds
        step = rec["step"]
        if self.bar is not None:
            self.bar.set_postfix_str(f"ETA {clock(self.eta(step))}, loss {rec['loss']:.4f}, "
                                     f"{rec['tokens_per_s']:,.0f} tok/s{_mfu(rec)}", refresh=False)
            self.bar.update()
            return
        due = step % self.log_every == 0 or step == self.total
        if due or time.monotonic() - self.last_line >= self.heartbeat:
            self.line(f"step {step}/{self.total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                      f"grad norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s{_mfu(rec)} | "
                      f"elapsed {clock(time.monotonic() - self.t0)} | ETA {clock(self.eta(step))}")

    @contextlib.contextmanager
    def evaluating(self, batches: int) -> Iterator[Callable[[], None]]:
        """Progress of one evaluation: yields a function to call after each batch."""
        t0 = time.monotonic()
        bar = None
        if self.enabled and self.bar is not None:
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
        self.eval_times.append(self.eval_seconds)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _mfu(rec: dict[str, Any]) -> str:
    return f" (MFU {rec['mfu']:.1%})" if "mfu" in rec else ""
