"""Structured outputs, the torch half: one llguidance matcher per row, and the tokens it bans at each
step as a (1, V) bool mask that RowSampler.banned adds to the row's other constraints (so it applies
before temperature and the truncation warpers, and greedy rows take the argmax of what it allows).

A row's matcher starts at its first generated token (the prompt is not parsed) and advances with
each token the row keeps. The row's stop tokens are allowed where the grammar may end; a stop token
that is not one of the row's is never allowed (it would be text). When nothing but the end can follow,
the row is done (`done`): it finishes with "stop" without spending a step on the stop token.
A fork (speculative decoding's probe over drafts) copies the matcher; a draft the grammar refuses
leaves the fork without a mask, since the verification never keeps what follows a refused draft.

What the constraint means: gpt2kit.sampling.constraint. Legend: V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpt2kit.sampling.constraint import Constraint, require_llguidance
from gpt2kit.validate import SettingError

if TYPE_CHECKING:
    from gpt2kit.tokenizer import Tokenizer


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the end token, and an encoder of bytes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eot_token
        self.bos_token_id = None
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [tokenizer.eot_token]

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"))


class MatcherFactory:
    """A tokenizer's llguidance vocabulary (built once: about a second) and the rows' matchers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        llg = require_llguidance()
        self.llg, self.n_tokens = llg, tokenizer.n_vocab
        self.lltokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)))
        self._compiled = functools.lru_cache(maxsize=64)(self._compile)

    def _compile(self, constraint: Constraint):
        m = self.llg.LLMatcher(self.lltokenizer, constraint.grammar(), log_level=0)
        if m.is_error():
            raise SettingError(f"invalid {constraint.kind} constraint: {m.get_error()}", "structured")
        return m

    def check(self, constraint: Constraint) -> None:
        """SettingError unless the constraint compiles against this vocabulary (compiled once, kept)."""
        self._compiled(constraint)

    def matcher(self, constraint: Constraint, n_vocab: int | None = None,
                stop_token_ids: Sequence[int] = ()) -> RowMatcher:
        """A fresh matcher for one row (a copy of the constraint's compiled one)."""
        stops = frozenset(stop_token_ids) if stop_token_ids else frozenset({self.lltokenizer.eos_token})
        return RowMatcher(self._compiled(constraint).deep_copy(), n_vocab or self.n_tokens, self.n_tokens,
                          self.lltokenizer.eos_token, stops)


@functools.lru_cache(maxsize=4)
def _factory(tokenizer: Tokenizer) -> MatcherFactory:
    return MatcherFactory(tokenizer)


def matcher_factory(tokenizer: Tokenizer | None = None) -> MatcherFactory:
    """The MatcherFactory of a tokenizer (default: GPT-2's), made once per tokenizer."""
    if tokenizer is None:
        from gpt2kit.tokenizer import Tokenizer

        tokenizer = Tokenizer.default()
    return _factory(tokenizer)


class RowMatcher:
    """One row's place in its grammar: disallowed() the tokens it bans now (1, V), advance(token)
    after each token the row keeps, done once only the end can follow, fork() a copy."""

    def __init__(self, matcher, n_vocab: int, n_tokens: int, eos: int, stops: frozenset[int]) -> None:
        self.matcher, self.n_vocab, self.n_tokens, self.eos, self.stops = matcher, n_vocab, n_tokens, eos, stops
        self.refused = False  # a token the grammar does not allow was advanced over (a fork's draft)
        self._mask: torch.Tensor | None = None  # the mask of the current state, made at most once

    def disallowed(self) -> torch.Tensor | None:
        """(1, V) bool: the tokens the grammar bans at this step; None after a refused token."""
        if self.refused:
            return None
        if self._mask is None:  # numpy until the end: one zero-copy tensor, no torch op per step
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            k = min(self.n_vocab, self.n_tokens)
            banned = np.unpackbits(bits, count=k, bitorder="little") == 0  # (k,)
            if self.eos < k and not banned[self.eos]:  # the grammar may end here: the row's stops may end it
                banned[self.eos] = self.eos not in self.stops
                for t in self.stops:
                    if t < k:
                        banned[t] = False
            if self.n_vocab > k:  # ids past the tokenizer's are never allowed
                banned = np.concatenate([banned, np.ones(self.n_vocab - k, dtype=bool)])
            self._mask = torch.from_numpy(banned).view(1, -1)  # (1, V)
        return self._mask

    def advance(self, token: int) -> None:
        self._mask = None
        if not self.refused and not self.matcher.consume_token(token):
            self.refused = True

    @property
    def done(self) -> bool:
        """Only the end can follow (the output is complete)."""
        return not self.refused and self.matcher.is_stopped()

    def fork(self) -> RowMatcher:
        other = RowMatcher(self.matcher.deep_copy(), self.n_vocab, self.n_tokens, self.eos, self.stops)
        other.refused, other._mask = self.refused, self._mask
        return other
