"""Speculative decoding on the engine's rows: each step drafts up to k tokens per row (from a
prompt-lookup match, or from a small draft model), the target checks them all in one forward over
the drafted tokens with its KV cache, and each row keeps the prefix gpt2kit.engine.drafts accepts plus
one token of the target's own. Greedy output is the target's greedy output token for token;
sampled output is distributed exactly as the target's (the rejection rule).

The cache: one left-padded KVCache per model (the target's and, with a draft model, the draft's),
columns shared, one mask for both. A step writes k + 1 columns for every row ([the row's pending
token, its drafts], padded to the batch's widest draft); the columns of the drafts a row did not
keep are masked out, leaving holes that positions (counted from the mask) skip, so each row
computes what it would alone. The first rows' prefill caches are the batch's (their real columns
are right-aligned already), sized for every step the rows may still take (up to n_ctx: columns
never written cost no memory on CPU); rows that finish are dropped in place (KVCache.keep). Only
when the cache fills, or rows join running ones, are every row's real columns packed right-aligned
into a new one (the columns' geometry: gpt2kit.engine.spec_cache).

Rows join as in gpt2kit.engine.scheduler: at the next step after a prefill of their own (their
first token from it), at most max_batch running; rows joining running ones: both parts' real
columns are then packed into new caches. The whole sequence stays in the context: prompt + max_new_tokens +
draft tokens must fit in n_ctx (checked before anything runs: gpt2kit.generation, the server's routing),
and a draft model's n_ctx must be at least the target's (check_draft_model). Rows whose admission
raises fail alone, an event each; a step that raises leaves every row to reset(), whose caller fails them.

Legend: L layers, B rows, K drafts per row this step, P cache columns, M cache size, V vocab.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import Kernels, decode_step, decode_tokens, kernels_for, prefill
from gpt2kit.engine.drafts import accept_drafts, greedy_accept, lookup_drafts
from gpt2kit.engine.outputs import advance, token_logprobs
from gpt2kit.engine.rows import Row, RowEvent, fail
from gpt2kit.engine.scheduler import Engine
from gpt2kit.engine.spec_cache import cache_columns, joined, pack_columns
from gpt2kit.kv_cache import KVCache
from gpt2kit.sampling import SamplingSettings
from gpt2kit.sampling.sampler import check_finite, next_tokens, warp

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer


def check_draft_model(model: GPT2, draft: GPT2, name: str | None = None) -> None:
    """ValueError unless draft can draft for model: the same vocabulary, device and dtype, and a context
    at least the target's (the draft's cache holds every column the target's does). name: the draft's
    checkpoint, for the message."""
    what = "the draft model" + (f" {name}" if name else "")
    if draft.config.n_vocab != model.config.n_vocab:
        raise ValueError(f"{what}: its vocabulary has {draft.config.n_vocab} tokens, the target's "
                         f"{model.config.n_vocab}; a draft model needs the target's tokenizer")
    if draft.config.n_ctx < model.config.n_ctx:
        raise ValueError(f"{what} has a context of n_ctx={draft.config.n_ctx}, shorter than the target's "
                         f"n_ctx={model.config.n_ctx}: a draft model must cover the target's whole context "
                         f"(n_ctx at least {model.config.n_ctx})")
    dd, td = draft.wpe.weight, model.wpe.weight
    if dd.device != td.device or dd.dtype != td.dtype:
        raise ValueError(f"{what} is on {dd.device} in {dd.dtype}, the target on {td.device} in "
                         f"{td.dtype}: load both the same way")


class SpeculativeEngine:
    """The engine's interface (gpt2kit.engine.rows.EngineInterface) for speculative decoding: a
    step may give a row several tokens (one RowEvent each, in order); beams and leases are the plain
    engine's (gpt2kit.engine.routing sends them there). draft: a draft model, or None
    for prompt lookup (settings.prompt_lookup tokens per step, or lookup tokens for every row)."""

    def __init__(self, model: GPT2, tokenizer: Tokenizer | None = None, *, draft: GPT2 | None = None,
                 max_batch: int | None = None, pack_weights: bool | None = None, lookup: int | None = None) -> None:
        if draft is not None:
            check_draft_model(model, draft)
        self._rows_from = Engine(model, tokenizer, max_batch=max_batch, pack_weights=pack_weights)
        self.model, self.draft, self.max_batch, self.pack_weights = model, draft, max_batch, pack_weights
        self.lookup = lookup
        self.drafted = self.accepted = 0  # totals over every row (a server's acceptance rate)
        self.rows: list[Row] = []
        self._joining: list[Row] = []  # taken off the queue, being admitted (counted as running)
        self._waiting: deque[Row] = deque()
        self._lock = threading.Lock()
        self._caches: list[KVCache] = []  # the target's, then the draft's
        self._mask: torch.Tensor | None = None  # (B, M) long: 1 real, 0 padding or a dropped draft
        self._pending: torch.Tensor | None = None  # (B,) each row's newest token, not yet fed
        self._P = 0  # cache columns written
        self._draft_q: list[list[torch.Tensor]] = []  # this step's draft distributions per row (sampled)
        self._kernel_sets: dict[tuple[int, int], Kernels | None] = {}  # (model's index, rows) -> its set

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, **kw) -> Row:
        return self._rows_from.new_row(prompt, settings, **kw)

    def new_beam_rows(self, prompt: Sequence[int], settings: SamplingSettings, **kw) -> list[Row]:
        raise ValueError(f"beam search (num_beams={settings.num_beams}) runs on the plain engine, not this one")

    def new_lease(self, prompt: Sequence[int], settings: SamplingSettings, **kw) -> Row:
        raise ValueError("a slot lease is a slot of the plain engine's cache: a speculative engine lends none")

    def submit(self, rows: Sequence[Row]) -> None:
        with self._lock:
            self._waiting.extend(rows)

    def cancel(self, row: Row) -> None:
        row.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._waiting)

    @property
    def n_running(self) -> int:
        return len(self.rows) + len(self._joining)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def reset(self) -> list[Row]:
        """Drop every row, running and waiting; returns them (after an error, to fail them)."""
        with self._lock:
            dropped, self._joining = self.rows + self._joining + list(self._waiting), []
            self._waiting.clear()
        self.rows, self._caches, self._mask, self._pending, self._P, self._kernel_sets = [], [], None, None, 0, {}
        return dropped

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """Speculate one step for the running rows, then admit waiting rows (their first token from
        their prefill); one event per token a row gained."""
        self._keep([r for r, row in enumerate(self.rows) if not row.cancelled])
        events = self._speculate() if self.rows else []
        return events + self._admit()

    def _speculate(self) -> list[RowEvent]:
        drafts = self._drafts()
        logits = _verify(self, drafts)  # (B, K + 1, V)
        argmax = _greedy_argmax(self.rows, logits)
        events, keep, last = [], [], []
        for r, row in enumerate(self.rows):
            q = self._draft_q[r] if self.draft is not None else None
            try:
                kept, nxt = greedy_accept(argmax[r], drafts[r]) if argmax else _accept(row, logits[r], drafts[r], q)
            except Exception as e:  # this row alone fails, as in Engine.step
                events += fail([row], e)
                continue
            row.drafted += len(drafts[r])
            row.accepted += kept
            self.drafted, self.accepted = self.drafted + len(drafts[r]), self.accepted + kept
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

    # -- rows joining --

    def _admit(self) -> list[RowEvent]:
        """Prefill the waiting rows there is room for, give each its first token, and add those that
        go on to the running rows. Rows whose admission raises fail, one event each (the running
        rows go on: their state changes only once everything is made)."""
        with self._lock:
            room = len(self._waiting) if self.max_batch is None else self.max_batch - len(self.rows)
            self._joining = _take(self._waiting, room)  # off the queue: running until they join or fail
        try:
            return self._join(self._joining) if self._joining else []
        except Exception as e:  # e.g. a cache or a forward that cannot be had: these rows alone
            return fail(self._joining, e)
        finally:
            self._joining = []

    def _join(self, rows: list[Row]) -> list[RowEvent]:
        self._kernel_sets = {}
        T = max(len(row.prompt) for row in rows)
        M = T if self.rows else self._columns(T, rows)  # alone, the prefill's caches are the batch's
        caches, mask, logits = _prefill_rows(self, rows, M)
        failed = {}
        tok = next_tokens(logits, [row.sampler for row in rows], failed)  # (B,)
        events, keep = [], []
        for r, row in enumerate(rows):
            if r in failed:
                events += fail([row], failed[r])
                continue
            events.append(_emit(row, int(tok[r]), logits[r:r + 1]))
            if row.finish_reason is None:
                keep.append(r)
        if keep:
            sel = torch.tensor(keep, device=mask.device)
            if len(keep) < len(rows):
                for c in caches:
                    c.keep(keep)
            running = (self._caches, self._mask, self._P) if self.rows else None
            batch = joined(running, caches, mask[sel], M, lambda W: self._columns(W, self.rows + rows))
            pending = tok[sel] if not self.rows else torch.cat([self._pending, tok[sel]])
            (self._caches, self._mask, self._P), self._pending = batch, pending  # set at once, all made
            self.rows = self.rows + [rows[r] for r in keep]
        return events

    # -- drafting and verifying --

    def _drafts(self) -> list[list[int]]:
        """Each row's drafts, at most its remaining tokens - 1 (the target adds one of its own)."""
        caps = [row.settings.max_new_tokens - len(row.tokens) - 1 for row in self.rows]
        if self.draft is None:
            return [lookup_drafts(row.prompt + row.tokens, min(self.lookup or row.settings.prompt_lookup, cap))
                    for row, cap in zip(self.rows, caps, strict=True)]
        caps = [max(min(row.settings.draft_tokens, c), 0) for row, c in zip(self.rows, caps, strict=True)]
        self._draft_q = [[] for _ in self.rows]
        if max(caps) > 0:
            self._room(max(caps) + 1)
            self._mask[:, self._P:self._P + max(caps) + 1] = 1
            kernels = self._kernels(1, len(self.rows))
            return _draft_tokens(self.draft, self._caches[1], self._mask[:, :self._P + max(caps) + 1], self._pending,
                                 self.rows, caps, self._draft_q, kernels)
        return [[] for _ in self.rows]

    def _kernels(self, which: int, rows: int) -> Kernels | None:
        """The target's (which 0) or draft's (1) kernel set for `rows` rows, chosen once per row count
        between admissions (it keeps its model's binding; rows joining choose again)."""
        key = (which, rows)
        if key not in self._kernel_sets:
            model = self.model if which == 0 else self.draft
            self._kernel_sets[key] = kernels_for(model, rows, self.pack_weights)
        return self._kernel_sets[key]

    # -- the cache --

    def _room(self, n: int) -> None:
        """Make room for n more columns: pack every row's real columns right-aligned when full."""
        if self._P + n > self._caches[0].max_len:
            M = self._columns(int(self._mask[:, :self._P].sum(-1).max()) + n - 1, self.rows)
            self._caches, self._mask, self._P = pack_columns([(self._caches, self._mask[:, :self._P])], M)

    def _columns(self, W: int, rows: Sequence[Row]) -> int:
        return cache_columns(W, rows, self.model.config.n_ctx, self.draft is not None, self.lookup)

    def _keep(self, keep: list[int], pending: torch.Tensor | None = None) -> None:
        """Keep batch rows `keep` (with each one's pending token, when given)."""
        self._pending = pending if pending is not None else self._pending
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        if not keep:
            self._caches, self._mask, self._pending = [], None, None
            return
        sel = torch.tensor(keep, device=self._mask.device)
        for c in self._caches:
            c.keep(keep)  # in place: no new cache for the rows that stay
        self._mask = self._mask[sel]
        if pending is None:
            self._pending = self._pending[sel]


def _take(waiting: deque[Row], room: int) -> list[Row]:
    """Up to `room` rows from the front of `waiting`, the cancelled ones dropped on the way."""
    rows = []
    while waiting and len(rows) < room:
        row = waiting.popleft()
        if not row.cancelled:
            rows.append(row)
    return rows


def _prefill_rows(engine: SpeculativeEngine, rows: list[Row], M: int
                  ) -> tuple[list[KVCache], torch.Tensor, torch.Tensor]:
    """Each of the engine's models' cache (M >= T columns) of the rows' prompts (left-padded among
    themselves), their mask (b, T) and the target's logits (b, V) after them; each model's forward on
    its kernel set for these rows (decode.prefill)."""
    models = [m for m in (engine.model, engine.draft) if m is not None]
    B, T = len(rows), max(len(row.prompt) for row in rows)
    idx = torch.full((B, T), EOT_ID % models[0].config.n_vocab, dtype=torch.long)  # (b, T)
    mask = torch.zeros(B, T, dtype=torch.long)  # (b, T)
    for r, row in enumerate(rows):
        idx[r, T - len(row.prompt):] = torch.tensor(row.prompt)
        mask[r, T - len(row.prompt):] = 1
    device = models[0].wpe.weight.device
    idx, mask = idx.to(device), mask.to(device)
    padded = bool((mask == 0).any())
    caches, logits = [], None
    for which, m in enumerate(models):
        cache = KVCache.for_model(m, B, M)
        out = prefill(m, idx, mask if padded else None, cache, engine._kernels(which, B))  # (b, V)
        logits = out if logits is None else logits
        caches.append(cache)
    return caches, mask, logits


def _draft_tokens(draft: GPT2, cache: KVCache, mask: torch.Tensor, pending: torch.Tensor, rows: list[Row],
                  caps: list[int], qs: list[list[torch.Tensor]], kernels) -> list[list[int]]:
    """K = max(caps) draft tokens per row, one draft step each after the pending tokens (B,) (the
    last draft is fed too, so the draft's cache columns match the target's); mask (B, P + K + 1).
    Each row keeps its first caps[r]; sampled rows' distributions go to qs[r]."""
    K, P, out = max(caps), cache.length, [[] for _ in rows]
    tok = pending
    for j in range(K + 1):  # the pending token, then each draft
        if j == K:  # the last draft only fills its cache column: no logits
            decode_step(draft, tok[:, None], cache, mask[:, :P + j + 1], kernels, head=False)
            break
        dl = decode_step(draft, tok[:, None], cache, mask[:, :P + j + 1], kernels)  # (B, V)
        if all(row.settings.greedy for row in rows):
            tok = dl.argmax(-1)  # (B,)
        else:
            tok = torch.stack([_draw_draft(row, dl[r:r + 1], qs[r]) for r, row in enumerate(rows)])
        for r, t in enumerate(tok.tolist()):
            out[r].append(t)
    for r, c in enumerate(caps):
        out[r], qs[r][:] = out[r][:c], qs[r][:c]
    return out


def _verify(engine: SpeculativeEngine, drafts: list[list[int]]) -> torch.Tensor:
    """The target's logits (B, K + 1, V) at each row's [pending token, drafts...] (short rows padded)."""
    K = max(map(len, drafts))
    engine._room(K + 1)
    B = len(engine.rows)
    idx = _verify_ids(drafts, engine._pending, engine.model.config.n_vocab, K).to(engine._mask.device)
    P, cache = engine._P, engine._caches[0]
    engine._mask[:, P:P + K + 1] = 1
    mask = engine._mask[:, :P + K + 1]
    # the flat step on B * (K + 1) rows: the weights read about once, as for one token a row
    return decode_tokens(engine.model, idx, cache, mask, engine._kernels(0, B * (K + 1)))  # (B, K + 1, V)


def _verify_ids(drafts: list[list[int]], pending: torch.Tensor, n_vocab: int, K: int) -> torch.Tensor:
    """[pending token, drafts..., padding] per row (B, K + 1), short rows padded with EOT."""
    idx = torch.full((len(drafts), K + 1), EOT_ID % n_vocab, dtype=torch.long)  # (B, K + 1)
    for r, d in enumerate(drafts):
        idx[r, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
    idx[:, 0] = pending.cpu()
    return idx


def _greedy_argmax(rows: list[Row], logits: torch.Tensor) -> list[list[int]] | None:
    """Where every row is plain greedy, their argmax tokens (B, K + 1) from one pass over logits
    (B, K + 1, V), the maxima checked finite in the same pass; else None."""
    if not all(row.settings.plain_greedy for row in rows):
        return None
    top, at = logits.max(-1)  # (B, K + 1) each
    return at.tolist() if torch.isfinite(top).all() else None


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
    scores = token_logprobs(logits, torch.tensor([t], device=logits.device), [row])  # before observe
    row.tokens.append(t)
    row.sampler.observe(t)
    piece, reason = advance(row, t)
    row.finish_reason = reason
    lp, top = scores.get(0, (None, None))
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
    """The row's warped logits at each position (k + 1, V), its penalties and constraints counting
    the drafts before it (as if they were kept): what its sampler would see token by token."""
    probe, out = row.sampler.fork(), []
    for i in range(logits.shape[0]):
        w = probe.warped(logits[i:i + 1])  # (1, V)
        check_finite(w, row.settings)
        out.append(w)
        if i < len(drafts):
            probe.observe(drafts[i])
    return torch.cat(out)
