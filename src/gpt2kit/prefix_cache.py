"""A bounded LRU of scored token sequences, so a prompt that shares a prefix with an earlier one
runs only its own suffix through the model (gpt2kit.score.score_tokens_top(..., cache=)).

An entry is what scoring one sequence leaves behind: its tokens, its keys and values in the
official past layout (the form ``GPT2.forward(past=)`` takes), the log-softmax at its last
position (the distribution of the token after it), and its per-position log-probs and top
alternatives. Attention is causal, so the keys, values and log-probs of the first m positions
depend only on those m tokens: any later sequence that shares them reuses them as they are.
lm-eval's multiple-choice items (one context, each ending in its own request) so compute the
context once.

The bound is in tokens (the sum of the entries' lengths); the least recently used entries go
first, and a sequence longer than the bound is not kept. The cache belongs to one model: every
lookup and store compares the model's parameters and buffers (identity and version counter) with
those the entries were computed with, and any change (an in-place edit, a replaced tensor, a
module swap, another model) empties it. A model in training mode (dropout) is never cached.
Lookups and stores take a lock, so threads may share one cache. The module imports no torch.

Legend: L layers, nh heads, n tokens, hs head size, V vocabulary.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpt2kit.validate import check_int

if TYPE_CHECKING:  # torch-free at run time: the tensors are only held and compared
    import torch
    from torch import nn

Top = tuple[tuple[int, float], ...]  # (id, log-prob) alternatives of one position, best first


@dataclass(frozen=True, eq=False)
class Scored:
    """One scored sequence: logprobs[i] and tops[i] belong to tokens[i + 1] (n - 1 of each)."""

    tokens: tuple[int, ...]
    present: torch.Tensor  # (1, L, 2, nh, n, hs): keys and values of every position
    last_logp: torch.Tensor  # (V,) float32: log-softmax at position n - 1
    logprobs: tuple[float, ...]
    tops: tuple[Top, ...]
    top: int  # alternatives kept per position


@dataclass(frozen=True)
class Hit:
    """What a lookup found: `entry` shares the first `shared` tokens of the sequence asked about."""

    entry: Scored
    shared: int


class PrefixCache:
    """Scored sequences by their tokens, at most `max_tokens` tokens in all (0: keeps nothing).
    on_reuse(n) is called with the number of positions a scoring did not run through the model."""

    def __init__(self, max_tokens: int, on_reuse: Callable[[int], None] | None = None) -> None:
        check_int("prefix cache max_tokens", max_tokens, ">= 0", lambda v: v >= 0)
        self.max_tokens, self.on_reuse = max_tokens, on_reuse
        self._entries: OrderedDict[tuple[int, ...], Scored] = OrderedDict()  # oldest first
        self._tokens = 0
        self._weights: list[tuple[torch.Tensor, int]] = []
        self._model_id: int | None = None
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held, over all entries."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def lookup(self, model: nn.Module, tokens: tuple[int, ...], top: int) -> Hit | None:
        """The entry sharing the longest prefix with `tokens` (at least two tokens: one shared
        token alone saves no work) whose top alternatives cover `top`, made the most recently used;
        None if there is none."""
        with self._lock:
            if not self._usable(model):
                return None
            best: Hit | None = None
            for entry in self._entries.values():
                if entry.top < top or (best is not None and best.shared >= len(entry.tokens)):
                    continue
                m = _shared(entry.tokens, tokens)
                if m >= 2 and (best is None or m > best.shared):
                    best = Hit(entry, m)
            if best is not None:
                self._entries.move_to_end(best.entry.tokens)
            return best

    def store(self, model: nn.Module, entry: Scored) -> None:
        """Keep `entry` as the most recently used, evicting the least recently used to stay within
        max_tokens; an entry it extends (its tokens a prefix of entry's, no more alternatives) goes."""
        n = len(entry.tokens)
        with self._lock:
            if not self._usable(model) or n > self.max_tokens:
                return
            for key in [k for k, e in self._entries.items()
                        if e.top <= entry.top and len(k) <= n and entry.tokens[:len(k)] == k]:
                self._drop(key)
            self._entries[entry.tokens] = entry
            self._tokens += n
            while self._tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def reused(self, n: int) -> None:
        if n and self.on_reuse is not None:
            self.on_reuse(n)

    # -- inside the lock --

    def _drop(self, key: tuple[int, ...]) -> None:
        self._tokens -= len(self._entries.pop(key).tokens)

    def _clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _usable(self, model: nn.Module) -> bool:
        """Whether the cache may serve `model` (emptied first if the entries were computed with
        other weights)."""
        if self.max_tokens == 0 or model.training:
            return False
        tensors = [*model.parameters(), *model.buffers()]
        try:
            versions = [t._version for t in tensors]
        except RuntimeError:  # inference tensors keep no version counter: changes could not be seen
            self._clear()
            return False
        same = (self._model_id == id(model) and len(tensors) == len(self._weights)
                and all(t is held and v == was for t, v, (held, was) in zip(tensors, versions, self._weights,
                                                                             strict=True)))
        if not same:
            self._clear()
            self._model_id = id(model)
            self._weights = list(zip(tensors, versions, strict=True))
        return True


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
