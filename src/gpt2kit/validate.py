"""The checks every library boundary uses on a user's value: one message shape, naming the value and
the limit. No torch, so configs that validate (TrainConfig, SamplingSettings) stay cheap to import."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any


def check_int(name: str, value: Any, limit: str, ok: Callable[[int], bool]) -> None:
    """ValueError "NAME must be an integer LIMIT, got VALUE" unless value is an int (not a bool) and ok."""
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"{name} must be an integer {limit}, got {value!r}")


def check_number(name: str, value: Any, limit: str, ok: Callable[[float], bool]) -> None:
    """ValueError "NAME must be a number LIMIT, got VALUE" unless value is a finite real number and ok."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not ok(value):
        raise ValueError(f"{name} must be a number {limit}, got {value!r}")


def check_choice(kind: str, value: Any, choices: Iterable[str]) -> None:
    """ValueError "unknown KIND VALUE; valid choices: ..." unless value is one of choices."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {', '.join(choices)}")
