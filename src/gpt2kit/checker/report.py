"""What `gpt2kit check` found, as data (CheckReport) and as the text the command prints: the weights
that loaded and those that did not, one line per stage (name, max abs difference, ok or DIFFERS), then
the first difference and its diagnosis."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpt2kit.checker.mapping import WeightMap
from gpt2kit.checker.stages import StageResult
from gpt2kit.config import GPT2Config


@dataclass
class CheckReport:
    learner: str  # how the learner's model was named (PATH.py:NAME)
    model: str  # the reference checkpoint
    config: GPT2Config
    shape: tuple[int, int]  # (B, T) of the ids both models ran
    tol: float
    weights: WeightMap
    stages: list[StageResult]  # in forward order, then the cache and the LayerNorm probe
    first: StageResult | None = None  # the first stage that differs
    diagnosis: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every observed stage matches within tol."""
        return self.first is None

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def stage(self, label: str) -> StageResult:
        return next(s for s in self.stages if s.label == label)

    def format(self) -> str:
        c, (B, T) = self.config, self.shape
        lines = [f"gpt2kit check: {self.learner} against {self.model} ({c.n_layer} layers, n_embd {c.n_embd}, "
                 f"{c.n_head} heads, vocab {c.n_vocab}), {B} x {T} tokens, float32, tolerance {self.tol:g}"]
        lines += self._weight_lines()
        lines += [f"note: {n}" for n in self.notes]
        width = max(len(s.label) for s in self.stages) + 2
        lines.append(f"{'stage':<{width}}{'max abs diff':<14}result")
        for s in self.stages:
            lines.append(f"{s.label:<{width}}{_number(s.diff):<14}{_result(s)}")
        if self.first is None:
            lines.append(f"every stage matches GPT-2 within {self.tol:g}")
        else:
            lines.append(f"first difference: {self.first.label} (max abs {_number(self.first.diff)})")
            lines.append(f"diagnosis: {self.diagnosis}")
        return "\n".join(lines)

    def _weight_lines(self) -> list[str]:
        wm = self.weights
        moved = sum(a.transpose for a in wm.assigned)
        split = sum(".attn.q." in a.target or ".attn.k." in a.target or ".attn.v." in a.target for a in wm.assigned)
        extra = [f"{moved} transposed"] * bool(moved) + [f"{split} split from c_attn"] * bool(split)
        lines = [f"weights: {len(wm.assigned)} of your tensors set from the checkpoint"
                 + (f" ({', '.join(extra)})" if extra else "")
                 + f"; {len(wm.unset)} of yours left unset, {len(wm.unused)} of GPT-2's unused"]
        lines += [f"  left unset: {name} ({why})" for name, why in wm.unset]
        lines += [f"  unused: {name}" for name in wm.unused]
        lines += [f"note: {n}" for n in wm.notes]
        return lines

    __str__ = format


def _number(d: float | None) -> str:
    if d is None:
        return "-"
    return "nan" if math.isnan(d) else f"{d:.2e}"


def _result(s: StageResult) -> str:
    if s.ok is None:
        return s.note or "not observed"
    word = "ok" if s.ok else "DIFFERS"
    return f"{word} ({s.note})" if s.note else word
