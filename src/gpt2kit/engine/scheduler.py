"""The iteration-level scheduler: rows wait, join the running batch at the next step after a
prefill of their own, and leave it the step they finish (Orca's and vLLM's scheduling).

Each row computes what it would alone: its cache columns are laid out by
gpt2kit.engine.batch_cache (right-aligned, left-padded, positions from the mask); it samples with
its own gpt2kit.sampler.RowSampler (its settings, its generator seeded from (seed, sample index),
its penalties' token sets), so what it draws does not depend on its neighbours; its text, finish
and log-probs come from gpt2kit.engine.outputs.

Past the context (GPT-2 has learned positions 0..n_ctx-1, so the cache cannot simply slide): the
model sees at most n_ctx tokens of a row. When a row's sequence (a prompt, or prompt + generated
tokens) would exceed n_ctx, its context is cut to its most recent ``window`` tokens (default
n_ctx // 2) and the row re-joins the batch with one prefill of that window.

Legend: B rows in the batch, T (padded) context length, V vocab.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import Kernels, decode_step, kernels_for, prefill
from gpt2kit.engine.batch_cache import BatchCache
from gpt2kit.engine.beam_rows import BeamGroup, admit, choose_tokens, prefill_index
from gpt2kit.engine.outputs import RowText, advance, token_logprobs
from gpt2kit.engine.rows import Row, RowEvent, RowKey
from gpt2kit.kv_cache import KVCache
from gpt2kit.sampler import RowSampler
from gpt2kit.sampling import SamplingSettings
from gpt2kit.validate import check_int

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer


class Engine:
    """The iteration-level scheduler: rows wait, join the running batch at the next :meth:`step`
    (at most max_batch run at once), and leave it when they finish or are cancelled.

    Not thread-safe except :meth:`submit` and :meth:`cancel`; gpt2kit.engine.EngineLoop runs one
    in a worker thread.
    """

    def __init__(self, model: GPT2, tokenizer: Tokenizer | None = None, *, max_batch: int | None = None,
                 pack_weights: bool | None = None) -> None:
        if max_batch is not None:
            check_int("max_batch", max_batch, ">= 1", lambda v: v >= 1)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch = max_batch
        self.pack_weights = pack_weights
        self.device = model.wte.weight.device
        self.rows: list[Row] = []  # running, in cache order
        self._waiting: deque[Row] = deque()
        self._lock = threading.Lock()
        self._batch = BatchCache(model.config.n_ctx)
        self._logits: torch.Tensor | None = None  # (B, V): each running row's next-token logits
        self._unfed: torch.Tensor | None = None  # (B,): tokens sampled last step, fed at the next
        self._kernels: Kernels | None = None  # the decode kernel set (gpt2kit.decode.kernels_for)
        self._kernels_for: int | None = None  # the batch size _kernels was chosen for

    # -- rows in and out (any thread) --

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, *, seed: int | None = None,
                sample_index: int = 0, logprobs: int | None = None, key: RowKey | None = None) -> Row:
        """A row for a prompt of valid token ids. seed: the run's seed (resolve_seed(settings) for
        one call); rows with equal (seed, sample_index) draw the same random numbers."""
        if settings.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer=...")
        if not settings.greedy and seed is None:
            raise ValueError("a sampled row needs a seed (gpt2kit.sampler.resolve_seed)")
        sampler = RowSampler(settings, prompt, self.model.config.n_vocab, seed, sample_index, self.device)
        text = RowText(self.tokenizer, settings.stop_strings) if self.tokenizer is not None else None
        return Row(list(prompt), settings, sampler, text, logprobs, key or RowKey(sample_index=sample_index))

    def new_beam_rows(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None
                      ) -> list[Row]:
        """One prompt's beam search (settings.num_beams rows, gpt2kit.engine.beam_rows), to submit
        together; the first row (key) gets the group's one event."""
        return BeamGroup(prompt, settings, self.device, key or RowKey(), self.model.config.n_ctx, self.max_batch).rows

    def submit(self, rows: Sequence[Row]) -> None:
        """Queue rows; they join the batch at the next step, in order, as room allows."""
        with self._lock:
            self._waiting.extend(rows)

    def cancel(self, row: Row) -> None:
        """Drop a row: waiting, it never runs; running, it leaves the batch at the next step."""
        row.cancelled = True

    @property
    def n_running(self) -> int:
        return len(self.rows)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._waiting)

    def reset(self) -> list[Row]:
        """Drop every row, running and waiting; returns them (after an error, to fail them)."""
        with self._lock:
            dropped = self.rows + list(self._waiting)
            self._waiting.clear()
        self.rows = []
        self._batch.clear()
        self._logits = self._unfed = None
        return dropped

    # -- one iteration --

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """Feed the tokens the last step sampled, admit waiting rows, then give every running row
        its next token; one event per row. The forward that feeds a step's tokens runs at the start
        of the next step, so a step's events are returned as soon as its tokens are sampled (a
        row's first token: after its prefill and one sample)."""
        self._feed_unfed()
        self._keep([r for r, row in enumerate(self.rows) if not row.dropped])
        self._admit()
        if not self.rows:
            return []
        rows, failed = self.rows, {}
        tok, src = choose_tokens(self._logits, rows, failed)  # (B,), beam groups' cache sources
        scores = token_logprobs(self._logits, tok, rows)
        events, keep = [], []
        for r, (row, t) in enumerate(zip(rows, tok.tolist(), strict=True)):
            if r in failed:  # this row alone fails; its neighbours go on (issue 18)
                row.finish_reason, row.error = "error", failed[r]
                events.append(RowEvent.failed(row, failed[r]))
                continue
            if row.beam is not None:  # its group set its tokens; it ends with the group
                if row.finish_reason is None:
                    keep.append(r)
                elif row is row.beam.lead:
                    events.append(row.beam.event())
                continue
            row.tokens.append(t)
            row.sampler.observe(t)
            piece, reason = advance(row, t)
            row.finish_reason = reason
            lp, top = scores.get(r, (None, None))
            events.append(RowEvent(row, t, piece, reason, lp, top))
            if reason is None:
                keep.append(r)
        if src is not None:
            self._batch.reorder(src)  # beams move to the slots of the beams they continue
        self._keep(keep)
        tok = tok[keep] if len(keep) < len(rows) else tok
        # A row whose context is full re-joins with a window of its sequence (module doc).
        n_ctx = self.model.config.n_ctx
        full = [r for r, n in enumerate(self._batch.lengths) if n >= n_ctx]
        if full:
            with self._lock:
                self._waiting.extendleft(reversed([self.rows[r] for r in full]))
            keep = [r for r in range(len(self.rows)) if r not in set(full)]
            self._keep(keep)
            tok = tok[keep]
        self._unfed = tok if self.rows else None
        return events

    def _feed_unfed(self) -> None:
        """Feed the tokens sampled at the last step to the rows still running (a row cancelled
        since is dropped first, so it costs the forward nothing)."""
        tok, self._unfed = self._unfed, None
        if tok is None:
            return
        live = [r for r, row in enumerate(self.rows) if not row.dropped]
        if len(live) < len(self.rows):
            self._keep(live)
            tok = tok[live]
        if self.rows:
            self._feed(tok)

    def _admit(self) -> None:
        with self._lock:
            room = len(self._waiting) if self.max_batch is None else self.max_batch - len(self.rows)
            join = admit(self._waiting, room)  # in order; a beam group whole
        if join:
            self._join(join)

    def _window(self, row: Row) -> int:
        return row.settings.window_for(self.model.config.n_ctx)

    def _to_feed(self) -> int:
        """The most tokens a running row may still be fed (the cache's room at a rebuild)."""
        return max(row.settings.max_new_tokens - len(row.tokens) for row in self.rows)

    def _join(self, rows: list[Row]) -> None:
        """Prefill the joining rows (left-padded among themselves) and add them to the batch."""
        n_ctx, n_vocab = self.model.config.n_ctx, self.model.config.n_vocab
        first, of = prefill_index(rows)  # a beam group's prompt is prefilled once
        contexts = [rows[r].context(n_ctx, self._window(rows[r])) for r in first]
        B, T = len(contexts), max(map(len, contexts))
        idx = torch.full((B, T), EOT_ID % n_vocab, dtype=torch.long)  # (B, T)
        mask = torch.ones(B, T, dtype=torch.long)  # (B, T)
        for r, ctx in enumerate(contexts):
            idx[r, T - len(ctx):] = torch.tensor(ctx)
            mask[r, : T - len(ctx)] = 0
        idx, mask = idx.to(self.device), mask.to(self.device)
        padded = any(len(c) < T for c in contexts)
        cache = KVCache.for_model(self.model, B, T)
        logits = prefill(self.model, idx, mask if padded else None, cache)  # (B, V)
        kv = cache.kv
        if len(first) < len(rows):  # every slot of a beam group starts from its prompt
            sel = torch.tensor(of, device=self.device)
            kv, mask, logits, contexts = kv[:, sel], mask[sel], logits[sel], [contexts[i] for i in of]
        if self.rows:
            logits = torch.cat([self._logits, logits])
        self.rows = self.rows + rows
        self._logits = logits
        self._batch.join(kv, mask, [len(c) for c in contexts], self._to_feed())

    def _keep(self, keep: list[int]) -> None:
        """Keep only batch rows `keep` (the others finished, were cancelled or re-join)."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        sel = self._batch.keep(keep)
        self._logits = None if not keep else self._logits[sel]

    def _feed(self, tok: torch.Tensor) -> None:
        """Feed each running row's newest token tok (B,); their next logits become pending."""
        if self._batch.full:
            self._batch.trim(self._to_feed())
        mask = self._batch.step_mask()  # (B, P + 1) or None
        B = len(self.rows)
        if self._kernels_for != B:
            self._kernels, self._kernels_for = kernels_for(self.model, B, self.pack_weights), B
        self._logits = decode_step(self.model, tok[:, None], self._batch.cache, mask, self._kernels)
        self._batch.advance()
