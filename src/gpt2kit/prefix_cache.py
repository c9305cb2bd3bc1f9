"""A bounded LRU of what earlier prompts computed, so a prompt that shares a prefix with an earlier
one runs only its own suffix through the model: scored sequences for echo scoring
(gpt2kit.score.score_tokens_top(..., cache=)) and blocks of keys and values for generation (the
engine's rows start from them: gpt2kit.engine.prefill).

A scored entry is what scoring one sequence leaves behind: its tokens, its keys and values in the
official past layout (the form ``GPT2.forward(past=)`` takes), the log-softmax at its last
position (the distribution of the token after it), and its per-position log-probs and top
alternatives. Attention is causal, so the keys, values and log-probs of the first m positions
depend only on those m tokens: any later sequence that shares them reuses them as they are.
lm-eval's multiple-choice items (one context, each ending in its own request) so compute the
context once.

A block is the keys and values of `block` tokens (16) at positions [i * block, (i + 1) * block)
of a prompt, keyed by a chain: its key hashes its parent's key (the block before it; the first
block's parent is the root, which hashes `namespace`, e.g. a row's adapter) with its own tokens,
as vLLM's automatic prefix caching does, so a key stands for the whole prefix up to its block's
end. A block also holds its parent's key and its tokens, compared at each lookup, so a hash
collision is a miss, never a wrong block. A lookup walks a prompt's blocks from the first while
they are held; a hit is made most recently used last block first, so eviction takes a chain's
tail before its head (a head alone still serves).

Scored entries and blocks are one LRU under one bound, in tokens (the sum of the entries'
lengths); the least recently used entries go first, and a sequence longer than the bound is not
kept. Scored entries keep per-position log-probs that generation does not need, and blocks keep
no log-probs, so neither kind serves the other's lookups. The cache belongs to one model: every
lookup and store compares the model's parameters and buffers (identity and version counter) with
those the entries were computed with, and any change (an in-place edit, a replaced tensor, a
module swap, another model) empties it. A model in training mode (dropout) is never cached.
Lookups and stores take a lock, so threads may share one cache. The module imports no torch.
Every lookup is reported to on_lookup with the tokens it reused (0: a miss), for the metrics.

Legend: L layers, nh heads, n tokens, hs head size, V vocabulary, M columns.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
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


@dataclass(frozen=True, eq=False)
class Block:
    """The keys and values of one block of a prompt (module doc)."""

    parent: int  # the key of the block before it (or of the root)
    tokens: tuple[int, ...]
    kv: torch.Tensor  # (L, 2, nh, block, hs)


@dataclass(frozen=True)
class Hit:
    """What a lookup found: `entry` shares the first `shared` tokens of the sequence asked about."""

    entry: Scored
    shared: int


class PrefixCache:
    """Scored sequences by their tokens and blocks by their chain keys, at most `max_tokens` tokens
    in all (0: keeps nothing). on_reuse(n) is called with the number of positions a lookup spared
    the model (when n > 0), on_lookup(n) after every lookup, n 0 too."""

    def __init__(self, max_tokens: int, on_reuse: Callable[[int], None] | None = None, *,
                 on_lookup: Callable[[int], None] | None = None, block: int = 16) -> None:
        check_int("prefix cache max_tokens", max_tokens, ">= 0", lambda v: v >= 0)
        check_int("prefix cache block", block, ">= 1", lambda v: v >= 1)
        self.max_tokens, self.on_reuse, self.on_lookup, self.block = max_tokens, on_reuse, on_lookup, block
        # oldest first: scored sequences keyed by their tokens (a tuple), blocks by their chain key (an int)
        self._entries: OrderedDict[tuple[int, ...] | int, Scored | Block] = OrderedDict()
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
                if (not isinstance(entry, Scored) or entry.top < top
                        or (best is not None and best.shared >= len(entry.tokens))):
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
            for key in [k for k, e in self._entries.items() if isinstance(e, Scored)
                        and e.top <= entry.top and len(k) <= n and entry.tokens[:len(k)] == k]:
                self._drop(key)
            self._entries[entry.tokens] = entry
            self._tokens += n
            self._evict()

    def lookup_blocks(self, model: nn.Module, tokens: Sequence[int], limit: int, namespace: Hashable = None
                      ) -> list[torch.Tensor]:
        """The keys and values (L, 2, nh, block, hs) of the blocks of `tokens` held, from the first
        while they are, at most `limit` tokens' worth, made the most recently used (module doc);
        reported to the callbacks."""
        bs, found = self.block, []
        with self._lock:
            if not self._usable(model):
                return []
            parent = _root(namespace)
            for i in range(min(limit, len(tokens)) // bs):
                key, part = _key(parent, tokens, i, bs)
                b = self._entries.get(key)
                if not isinstance(b, Block) or b.parent != parent or b.tokens != part:
                    break
                found.append((key, b))
                parent = key
            for key, _ in reversed(found):
                self._entries.move_to_end(key)
        self.reused(len(found) * bs)
        return [b.kv for _, b in found]

    def store_blocks(self, model: nn.Module, tokens: Sequence[int], kv: torch.Tensor, namespace: Hashable = None
                     ) -> None:
        """Keep the whole blocks of `tokens`, whose keys and values are kv[:, :, :, :len(tokens)]
        (L, 2, nh, M, hs: a row's slot; copied), as the most recently used, the first block most;
        blocks held already are not copied again. At most max_tokens // block of them."""
        bs = self.block
        with self._lock:
            if not self._usable(model):
                return
            keys, parent = [], _root(namespace)
            for i in range(min(len(tokens), self.max_tokens) // bs):
                key, part = _key(parent, tokens, i, bs)
                b = self._entries.get(key)
                if not isinstance(b, Block) or b.parent != parent or b.tokens != part:
                    if b is not None:  # another prefix hashed alike: the newer one takes the key
                        self._drop(key)
                    self._entries[key] = Block(parent, part, kv[:, :, :, i * bs:(i + 1) * bs].clone())
                    self._tokens += bs
                keys.append(key)
                parent = key
            for key in reversed(keys):
                self._entries.move_to_end(key)
            self._evict()

    def reused(self, n: int) -> None:
        """One lookup spared the model n positions (0: none)."""
        if n and self.on_reuse is not None:
            self.on_reuse(n)
        if self.on_lookup is not None:
            self.on_lookup(n)

    # -- inside the lock --

    def _drop(self, key: tuple[int, ...] | int) -> None:
        self._tokens -= len(self._entries.pop(key).tokens)

    def _evict(self) -> None:
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

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


def _root(namespace: Hashable) -> int:
    """The chain's root key: the first block's parent."""
    return hash(("gpt2kit.prefix_cache", namespace))


def _key(parent: int, tokens: Sequence[int], i: int, bs: int) -> tuple[int, tuple[int, ...]]:
    """Block i's key (module doc) and its tokens."""
    part = tuple(tokens[i * bs:(i + 1) * bs])
    return hash((parent, part)), part


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
