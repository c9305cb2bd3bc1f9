"""A row's text as its tokens arrive (:class:`RowText`); output processing
(gpt2kit.engine.outputs) feeds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpt2kit.tokenizer import Tokenizer


class RowText:
    """A row's text: whole UTF-8 characters only, with any tail that could begin a stop string
    held back until it is known not to be one (so no streamed text ever has to be taken back)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.decoder = tokenizer.decoder()
        self.stops = stops
        self.pending = ""

    def feed(self, token: int) -> tuple[str, bool]:
        """(text now safe to emit, whether a stop string was completed)."""
        return self._emit(self.pending + self.decoder.feed([token]), final=False)

    def finish(self) -> str:
        return self._emit(self.pending + self.decoder.flush(), final=True)[0]

    def _emit(self, s: str, *, final: bool) -> tuple[str, bool]:
        cut = min((i for i in (s.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return s[:cut], True
        hold = 0 if final else _prefix_overlap(s, self.stops)
        self.pending = s[len(s) - hold:]
        return s[: len(s) - hold], False


def _prefix_overlap(s: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of s that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(s)), best, -1):
            if s.endswith(stop[:n]):
                best = n
                break
    return best
