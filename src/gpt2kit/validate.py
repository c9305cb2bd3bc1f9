"""The checks every library boundary uses on a user's value: one message shape, naming the value and
the limit. No torch, so configs that validate (TrainConfig, SamplingSettings) stay cheap to import."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any


class SettingError(ValueError):
    """A ValueError about one setting; name: the setting as the library spells it (a front door
    that spells it otherwise names its own field: the server's `param`)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def check_int(name: str, value: Any, limit: str, ok: Callable[[int], bool]) -> None:
    """SettingError "NAME must be an integer LIMIT, got VALUE" unless value is an int (not a bool) and ok."""
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise SettingError(f"{name} must be an integer {limit}, got {value!r}", name)


def check_number(name: str, value: Any, limit: str, ok: Callable[[float], bool]) -> None:
    """SettingError "NAME must be a number LIMIT, got VALUE" unless value is a finite real number and ok."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not ok(value):
        raise SettingError(f"{name} must be a number {limit}, got {value!r}", name)


def check_choice(kind: str, value: Any, choices: Iterable[str]) -> None:
    """ValueError "unknown KIND VALUE; valid choices: ..." unless value is one of choices."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {', '.join(choices)}")
