"""What a training run reports: metrics.jsonl, loss.png and the progress shown while it runs.

`Metrics` appends one JSON object per line to OUT/metrics.jsonl (flushed per line, so a crash loses
at most the line being written) and keeps the loss history that `plot` draws into OUT/loss.png.
`Reporter` is rank 0's console output: a tqdm bar when stderr is a terminal, plain log lines
otherwise.
"""

from __future__ import annotations

import json
import math
import sys
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
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _remember(self, rec: dict[str, Any]) -> None:
        if "loss" in rec:
            self.train.append((rec["step"], rec["loss"]))
        if "val_loss" in rec:
            self.val.append((rec["step"], rec["val_loss"]))

    def log(self, rec: dict[str, Any]) -> None:
        self._remember(rec)
        self.file.write(json.dumps(rec) + "\n")
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
    """Rank 0's output: a tqdm bar when stderr is a terminal, plain log lines otherwise."""

    def __init__(self, enabled: bool, start: int, total: int, log_every: int):
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def step(self, rec: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update()
        elif rec["step"] % self.log_every == 0 or rec["step"] == self.total:
            self.line(f"step {rec['step']}/{self.total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                      f"grad norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
