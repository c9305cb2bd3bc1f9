"""Speculative decoding on the engine's rows: each step drafts up to k tokens per row (from a
prompt-lookup match, or from a small draft model), the target checks them all in one forward over
the drafted tokens with its KV cache, and each row keeps the prefix gpt2kit.speculate accepts plus
one token of the target's own. Greedy output is the target's greedy output token for token;
sampled output is distributed exactly as the target's (the rejection rule).

The cache: one left-padded KVCache per model (the target's and, with a draft model, the draft's),
columns shared, one mask for both. A step writes k + 1 columns for every row ([the row's pending
token, its drafts], padded to the batch's widest draft); the columns of the drafts a row did not
keep are masked out, leaving holes that positions (counted from the mask) skip, so each row
computes what it would alone. When the cache fills, every row's real columns are packed
right-aligned into a new one.

Rows run in groups of max_batch: a group is prefilled together and runs until its last row ends
(no joining mid-group). The whole sequence stays in the context: prompt + max_new_tokens +
draft tokens must fit in n_ctx (checked before anything runs, gpt2kit.generate).

Legend: L layers, B rows, K drafts per row this step, P cache columns, M cache size, V vocab.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import decode_step, kernels_for, prefill
from gpt2kit.engine.outputs import advance, token_logprobs
from gpt2kit.engine.rows import Row, RowEvent
from gpt2kit.engine.scheduler import Engine, next_tokens
from gpt2kit.kv_cache import KVCache
from gpt2kit.sampling import SamplingSettings, check_finite, warp
from gpt2kit.speculate import accept_drafts, greedy_accept, lookup_drafts

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer

ROOM = 128  # cache columns added past the widest row when the cache is (re)built


def check_draft_model(model: GPT2, draft: GPT2) -> None:
    """ValueError unless draft can draft for model: the same vocabulary, device and dtype."""
    if draft.config.n_vocab != model.config.n_vocab:
        raise ValueError(f"the draft model's vocabulary has {draft.config.n_vocab} tokens, the target's "
                         f"{model.config.n_vocab}: a draft model needs the target's tokenizer")
    dd, td = draft.wpe.weight, model.wpe.weight
    if dd.device != td.device or dd.dtype != td.dtype:
        raise ValueError(f"the draft model is on {dd.device} in {dd.dtype}, the target on {td.device} in "
                         f"{td.dtype}: load both the same way")


class SpeculativeEngine:
    """Engine's interface (new_row, submit, cancel, has_work, step) for speculative decoding: a
    step may give a row several tokens (one RowEvent each, in order). draft: a draft model, or None
    for prompt lookup (settings.prompt_lookup tokens per step)."""

    def __init__(self, model: GPT2, tokenizer: Tokenizer | None = None, *, draft: GPT2 | None = None,
                 max_batch: int | None = None, pack_weights: bool | None = None) -> None:
        if draft is not None:
            check_draft_model(model, draft)
        self._rows_from = Engine(model, tokenizer, max_batch=max_batch, pack_weights=pack_weights)
        self.model, self.draft, self.max_batch, self.pack_weights = model, draft, max_batch, pack_weights
        self.rows: list[Row] = []
        self._waiting: deque[Row] = deque()
        self._lock = threading.Lock()
        self._caches: list[KVCache] = []  # the target's, then the draft's
        self._mask: torch.Tensor | None = None  # (B, M) long: 1 real, 0 padding or a dropped draft
        self._pending: torch.Tensor | None = None  # (B,) each row's newest token, not yet fed
        self._P = 0  # cache columns written
        self._draft_q: list[list[torch.Tensor]] = []  # this step's draft distributions per row (sampled)

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, **kw) -> Row:
        return self._rows_from.new_row(prompt, settings, **kw)

    def submit(self, rows: Sequence[Row]) -> None:
        with self._lock:
            self._waiting.extend(rows)

    def cancel(self, row: Row) -> None:
        row.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._waiting)

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """Start a group (its first token each, from the prefill) or speculate one step for it."""
        self._keep([r for r, row in enumerate(self.rows) if not row.cancelled])
        if not self.rows:
            return self._start_group()
        drafts = self._drafts()
        logits = self._verify(drafts)  # (B, K + 1, V)
        argmax = None  # plain greedy rows: one batched argmax
        if all(row.settings.plain_greedy for row in self.rows) and torch.isfinite(logits.amax(-1)).all():
            argmax = logits.argmax(-1).tolist()  # (B, K + 1)
        events, keep, last = [], [], []
        for r, row in enumerate(self.rows):
            q = self._draft_q[r] if self.draft is not None else None
            try:
                kept, nxt = greedy_accept(argmax[r], drafts[r]) if argmax else _accept(row, logits[r], drafts[r], q)
            except Exception as e:  # this row alone fails, as in Engine.step
                row.finish_reason, row.error = "error", e
                events.append(RowEvent.failed(row, e))
                continue
            row.drafted += len(drafts[r])
            row.accepted += kept
            self._mask[r, self._P + 1 + kept:self._P + logits.shape[1]] = 0  # the drafts it did not keep
            new = list(drafts[r][:kept]) + [nxt]
            for i, t in enumerate(new):
                events.append(_emit(row, t, logits[r, i:i + 1]))
                if row.finish_reason is not None:
                    break
            if row.finish_reason is None:
                keep.append(r)
                last.append(new[-1])
        self._P += logits.shape[1]
        for c in self._caches:
            c.length = self._P
        self._keep(keep, torch.tensor(last, dtype=torch.long, device=logits.device) if keep else None)
        return events

    # -- a group's start --

    def _start_group(self) -> list[RowEvent]:
        with self._lock:
            n = len(self._waiting) if self.max_batch is None else self.max_batch
            rows = []
            while self._waiting and len(rows) < n:
                row = self._waiting.popleft()
                if not row.cancelled:
                    rows.append(row)
        if not rows:
            return []
        B, T = len(rows), max(len(row.prompt) for row in rows)
        n_vocab = self.model.config.n_vocab
        idx = torch.full((B, T), EOT_ID % n_vocab, dtype=torch.long)  # (B, T)
        mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        for r, row in enumerate(rows):
            idx[r, T - len(row.prompt):] = torch.tensor(row.prompt)
            mask[r, T - len(row.prompt):] = 1
        device = self.model.wpe.weight.device
        idx, mask = idx.to(device), mask.to(device)
        padded = bool((mask == 0).any())
        self._caches, logits = [], None
        for m in (self.model, self.draft):
            if m is not None:
                cache = KVCache.for_model(m, B, T)
                out = prefill(m, idx, mask if padded else None, cache)  # (B, V)
                logits = out if logits is None else logits
                self._caches.append(cache)
        self.rows, self._mask, self._P = rows, mask, T
        failed = {}
        tok = next_tokens(logits, [row.sampler for row in rows], failed)  # (B,)
        events, keep = [], []
        for r, row in enumerate(rows):
            if r in failed:
                row.finish_reason, row.error = "error", failed[r]
                events.append(RowEvent.failed(row, failed[r]))
                continue
            events.append(_emit(row, int(tok[r]), logits[r:r + 1]))
            if row.finish_reason is None:
                keep.append(r)
        self._pending = tok
        self._keep(keep)
        return events

    # -- drafting and verifying --

    def _drafts(self) -> list[list[int]]:
        """Each row's drafts, at most its remaining tokens - 1 (the target adds one of its own)."""
        caps = [row.settings.max_new_tokens - len(row.tokens) - 1 for row in self.rows]
        if self.draft is None:
            return [lookup_drafts(row.prompt + row.tokens, min(row.settings.prompt_lookup, cap))
                    for row, cap in zip(self.rows, caps, strict=True)]
        self._draft_q = [[] for _ in self.rows]
        K = max(min(row.settings.draft_tokens, cap) for row, cap in zip(self.rows, caps, strict=True))
        out = [[] for _ in self.rows]
        if K <= 0:
            return out
        self._room(K + 1)
        cache, B = self._caches[1], len(self.rows)
        kernels = kernels_for(self.draft, B, self.pack_weights)
        tok = self._pending
        self._mask[:, self._P:self._P + K + 1] = 1
        for j in range(K + 1):  # the pending token, then each draft (the last is fed for the next step)
            dl = decode_step(self.draft, tok[:, None], cache, self._mask[:, :self._P + j + 1], kernels)  # (B, V)
            if j == K:
                break
            if all(row.settings.greedy for row in self.rows):
                tok = dl.argmax(-1)  # (B,)
            else:
                tok = torch.stack([_draw_draft(row, dl[r:r + 1], self._draft_q[r]) for r, row in enumerate(self.rows)])
            for r, t in enumerate(tok.tolist()):
                out[r].append(t)
        cap = [max(min(row.settings.draft_tokens, c), 0) for row, c in zip(self.rows, caps, strict=True)]
        for r in range(B):
            out[r], self._draft_q[r] = out[r][:cap[r]], self._draft_q[r][:cap[r]]
        return out

    def _verify(self, drafts: list[list[int]]) -> torch.Tensor:
        """The target's logits (B, K + 1, V) at [pending token, drafts...] (short rows padded)."""
        K = max(map(len, drafts))
        self._room(K + 1)
        B, device = len(self.rows), self._mask.device
        idx = torch.full((B, K + 1), EOT_ID % self.model.config.n_vocab, dtype=torch.long)  # (B, K + 1)
        for r, d in enumerate(drafts):
            idx[r, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        idx[:, 0] = self._pending.cpu()
        idx = idx.to(device)
        P, cache = self._P, self._caches[0]
        self._mask[:, P:P + K + 1] = 1
        mask = self._mask[:, :P + K + 1]
        if K == 0:
            kernels = kernels_for(self.model, B, self.pack_weights)
            return decode_step(self.model, idx, cache, mask, kernels)[:, None]  # (B, 1, V)
        return self.model(idx, attention_mask=mask, cache=cache).logits  # (B, K + 1, V)

    # -- the cache --

    def _room(self, n: int) -> None:
        """Make room for n more columns: pack every row's real columns right-aligned when full."""
        if self._P + n > self._caches[0].max_len:
            M = min(self.model.config.n_ctx, int(self._mask[:, :self._P].sum(-1).max()) + n + ROOM)
            self._caches, self._mask, self._P = pack_columns(self._caches, self._mask[:, :self._P], M)

    def _keep(self, keep: list[int], pending: torch.Tensor | None = None) -> None:
        """Keep batch rows `keep` (with each one's pending token, when given)."""
        if pending is not None:
            self._pending = pending
            if len(keep) == len(self.rows):
                return
        elif len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        if not keep:
            self._caches, self._mask, self._pending = [], None, None
            return
        sel = torch.tensor(keep, device=self._mask.device)
        for c in self._caches:
            c.select(sel)
        self._mask = self._mask[sel]
        if pending is None:
            self._pending = self._pending[sel]


def pack_columns(caches: list[KVCache], mask: torch.Tensor, M: int) -> tuple[list[KVCache], torch.Tensor, int]:
    """New caches of M columns holding each row's real columns (mask (B, P) == 1) right-aligned,
    zeros before them; returns them, their mask (B, M) and their width W (the longest row)."""
    real = mask.bool()  # (B, P)
    lengths = real.sum(-1).tolist()
    W = max(lengths)
    out = torch.zeros(mask.shape[0], M, dtype=torch.long, device=mask.device)  # (B, M)
    packed = []
    for old in caches:
        L, B, _, nh, _, hs = old.kv.shape
        new = KVCache(L, B, nh, M, hs, device=old.kv.device, dtype=old.kv.dtype)
        new.kv.zero_()
        for r in range(B):
            new.kv[:, r, :, :, W - lengths[r]:W] = old.kv[:, r, :, :, real[r].nonzero()[:, 0]]
        new.length = W
        packed.append(new)
    for r in range(mask.shape[0]):
        out[r, W - lengths[r]:W] = 1
    return packed, out, W


def _draw_draft(row: Row, logits: torch.Tensor, qs: list[torch.Tensor]) -> torch.Tensor:
    """The draft's token for a row from its logits (1, V): greedy, the argmax; sampled, a draw from
    its warped distribution, which is appended to qs (the rejection rule needs it)."""
    s = row.settings
    if s.greedy:
        return logits[0].argmax()
    q = warp(logits, s).softmax(-1)[0]  # (V,)
    qs.append(q)
    return torch.multinomial(q, 1, generator=row.sampler.generator)[0]


def _emit(row: Row, t: int, logits: torch.Tensor) -> RowEvent:
    """Add token t to the row (its raw next-token logits (1, V) give the log-probs it asked for)."""
    row.tokens.append(t)
    row.sampler.observe(t)
    piece, reason = advance(row, t)
    row.finish_reason = reason
    if row.logprobs is None:
        return RowEvent(row, t, piece, reason)
    lp, top = token_logprobs(logits, torch.tensor([t], device=logits.device), [row])[0]
    return RowEvent(row, t, piece, reason, lp, top)


def _accept(row: Row, logits: torch.Tensor, drafts: list[int], q: list[torch.Tensor] | None = None
            ) -> tuple[int, int]:
    """(drafts kept, the target's next token) for one row; logits (K + 1, V) of its step."""
    s, k = row.settings, len(drafts)
    if s.plain_greedy:
        check_finite(logits[:k + 1], s)
        return greedy_accept(logits[:k + 1].argmax(-1).tolist(), drafts)
    warped = _warped_along(row, logits[:k + 1], drafts)  # (k + 1, V)
    if s.greedy:
        return greedy_accept(warped.argmax(-1).tolist(), drafts)
    p = warped.softmax(-1)
    qs = None if q is None else (torch.stack(q) if q else p[:0])  # (k, V)
    return accept_drafts(p, qs, drafts, row.sampler.generator)


def _warped_along(row: Row, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """The row's warped logits at each position, its penalties counting the drafts before it (as
    if they were kept): what the row's sampler would see token by token."""
    sampler, s = row.sampler, row.settings
    seen = None if sampler.seen is None else sampler.seen.clone()
    counts = None if sampler.counts is None else sampler.counts.clone()
    out = []
    for i in range(logits.shape[0]):
        w = warp(logits[i:i + 1], s, seen, counts)  # (1, V)
        check_finite(w, s)
        out.append(w)
        if i < len(drafts):
            if seen is not None:
                seen[0, drafts[i]] = True
            if counts is not None:
                counts[0, drafts[i]] += 1
    return torch.cat(out)

