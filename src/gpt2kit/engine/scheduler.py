"""The iteration-level scheduler: rows wait, take a slot of the cache when one is free, are
prefilled into it in chunks while the running rows decode, and leave the batch the step they
finish (Orca's and vLLM's scheduling, with vLLM's chunked prefill).

Each row computes what it would alone: its keys and values live in a slot of its own
(gpt2kit.engine.batch_cache: a pool of per-row slots; joining, leaving and growing never copy
another row's; a beam group, gpt2kit.engine.beam_rows, copies among its own slots only); its prompt
is prefilled in chunks of ``prefill_chunk`` tokens, at most that many prompt tokens per step over
all joining rows while rows decode, so the running rows get a token every step while a long prompt
joins, and up to ``prefill_idle_budget`` while none decodes (nothing to protect: a burst joining an
idle engine gets its first tokens after one step; a row's chunk boundaries depend only on its own
prompt, so its prefill is the same alone or beside others); it samples with its own
gpt2kit.sampling.sampler.RowSampler (its settings, its generator seeded from (seed, sample index), its
penalties' token sets), so what it draws does not depend on its neighbours; its text
(gpt2kit.engine.text), finish and log-probs come from gpt2kit.engine.outputs.

Slots: max_batch of them (an engine without max_batch starts with as many as rows are waiting at
its first step and adds slots as rows join: the one case that copies, SlotPool.grow), each of
max_len columns (default n_ctx: the longest context a row reaches); a row holds its slot from its
first prefill chunk until it ends.

Past the context (GPT-2 has learned positions 0..n_ctx-1, so the cache cannot simply slide): the
model sees at most n_ctx tokens of a row. When a row's sequence (a prompt, or prompt + generated
tokens) would exceed n_ctx, its context is cut to its most recent ``window`` tokens (default
n_ctx // 2) and the row is prefilled again with that window, in its own slot.

With a proposer (gpt2kit.engine.speculate), the rows it decides on (greedy ones, or sampled too;
no beams, leases or interventions; their whole sequence and a step's drafts in the context) speculate
once their first token is sampled: each step drafts and verifies several tokens for them in their
own slots, before the other rows are fed as always.

With a prefix_cache (gpt2kit.prefix_cache), a joining row starts from the keys and values of the
blocks of its prompt that earlier rows left there and prefills only the rest, and leaves its own
(gpt2kit.engine.prefill); None: every prompt is prefilled whole.

Legend: B rows in the batch, T (padded) context length, V vocab.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import Kernels, decode_step, kernels_for
from gpt2kit.engine.batch_cache import SlotPool
from gpt2kit.engine.beam_rows import BeamGroup, admit, choose_tokens, prefill_index
from gpt2kit.engine.checks import check_request
from gpt2kit.engine.outputs import advance, token_logprobs
from gpt2kit.engine.prefill import ChunkedPrefill, Joining
from gpt2kit.engine.rows import Leases, Row, RowEdits, RowEvent, RowKey, SlotLease, edited, requeued_on_error
from gpt2kit.engine.speculate import Proposer, Speculation
from gpt2kit.engine.text import RowText
from gpt2kit.lora import adapter_rows
from gpt2kit.sampling import SamplingSettings
from gpt2kit.sampling.sampler import RowSampler
from gpt2kit.validate import check_int

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.prefix_cache import PrefixCache
    from gpt2kit.tokenizer import Tokenizer


DEFAULT_PREFILL_CHUNK = 128  # prompt tokens prefilled per step at most (Engine's prefill_chunk)


def _pool_with_room(pool: SlotPool | None, model: GPT2, max_batch: int | None, max_len: int, n_running: int,
                    n: int) -> SlotPool:
    """The engine's slots, made on first use, with `n` free: an engine without max_batch adds slots (the
    one copy: SlotPool.grow)."""
    if pool is None:
        pool = SlotPool.for_model(model, max_batch or n, max_len)
    if pool.n_free < n:
        pool.grow(max(2 * pool.n_slots, n_running + n))
    return pool


class Engine:
    """The iteration-level scheduler (module doc); at most max_batch rows hold a slot at once.
    prefill_chunk: prompt tokens per step while rows decode (a prompt's chunk size);
    prefill_idle_budget: the same while none decodes (>= prefill_chunk; None: one chunk of every
    joining row); max_len: columns per slot (default n_ctx; :meth:`new_row` refuses more);
    proposer: the rows it decides on draft and verify several tokens a step (gpt2kit.engine.speculate).
    Not thread-safe except :meth:`submit` and :meth:`cancel` (gpt2kit.engine.EngineLoop runs one
    in a worker thread)."""

    def __init__(self, model: GPT2, tokenizer: Tokenizer | None = None, *, max_batch: int | None = None,
                 pack_weights: bool | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_len: int | None = None, prefill_idle_budget: int | None = None,
                 prefix_cache: PrefixCache | None = None, proposer: Proposer | None = None) -> None:
        n_ctx = model.config.n_ctx
        if max_batch is not None:
            check_int("max_batch", max_batch, ">= 1", lambda v: v >= 1)
        check_int("prefill_chunk", prefill_chunk, ">= 1", lambda v: v >= 1)
        if prefill_idle_budget is not None:
            check_int("prefill_idle_budget", prefill_idle_budget, f">= prefill_chunk={prefill_chunk}",
                      lambda v: v >= prefill_chunk)
        if max_len is not None:
            check_int("max_len", max_len, f"in [1, n_ctx={n_ctx}]", lambda v: 1 <= v <= n_ctx)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.pack_weights, self.prefill_chunk = max_batch, pack_weights, prefill_chunk
        self.prefill_idle_budget = prefill_idle_budget
        self.max_len, self.device = max_len or n_ctx, model.wte.weight.device
        self.pool: SlotPool | None = None  # the slots, made at the first join
        self.rows: list[Row] = []  # decoding, in slot order
        self._slots: list[int] = []  # the slot of each of self.rows
        self._joining = ChunkedPrefill(prefill_chunk, prefix_cache)  # rows being prefilled, oldest first
        self._waiting: deque[Row] = deque()
        self._leased = Leases()  # rows lent a slot (new_lease)
        self._lock = threading.Lock()
        self._logits: torch.Tensor | None = None  # (B, V): each decoding row's next-token logits
        self._unfed: torch.Tensor | None = None  # (B,): tokens sampled last step, fed at the next
        self.kernels = KernelSets(model, max_batch, pack_weights)  # the steps' and the prefill's kernel sets
        self.spec = Speculation(model, proposer, pack_weights)  # its speculating rows (none without a proposer)

    # -- rows in and out (any thread) --

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, *, seed: int | None = None,
                sample_index: int = 0, logprobs: int | None = None, key: RowKey | None = None,
                edits: RowEdits | None = None) -> Row:
        """A row for a prompt of valid token ids. seed: the run's seed (resolve_seed(settings) for
        one call); rows with equal (seed, sample_index) draw the same random numbers."""
        _check_row(self, prompt, settings)
        if not settings.greedy and seed is None:
            raise ValueError("a sampled row needs a seed (gpt2kit.sampling.sampler.resolve_seed)")
        sampler = RowSampler(settings, prompt, self.model.config.n_vocab, seed, sample_index, self.device,
                             self.tokenizer)
        text = RowText(self.tokenizer, settings.stop_strings) if self.tokenizer is not None else None
        self.kernels.plain &= edits is None  # steps with interventions run the model's own forward
        row = Row(list(prompt), settings, sampler, text, logprobs, key or RowKey(0, 0, sample_index), edits=edits)
        row.speculate = self.spec.speculates(row)
        return row

    def new_beam_rows(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None
                      ) -> list[Row]:
        """One prompt's beam search (settings.num_beams rows, gpt2kit.engine.beam_rows), to submit
        together; the first row (key) gets the group's one event."""
        _check_row(self, prompt, settings, "beam search" if settings.num_beams == 1 else None)
        return BeamGroup(prompt, settings, self.device, key or RowKey(), self.max_batch).rows

    def new_lease(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None) -> Row:
        """A row that joins as any other, never fed: row.lease.cache is then a KVCache over its slot,
        for a search's own forwards (gpt2kit.engine.contrastive); cancelling it frees the slot."""
        if self.max_batch is None:
            raise ValueError("a slot lease needs an engine with max_batch (slots that never move)")
        _check_row(self, prompt, settings)
        return Row(list(prompt), settings, None, key=key or RowKey(), lease=SlotLease())

    def submit(self, rows: Sequence[Row]) -> None:
        """Queue rows; they join the batch, in order, as slots allow."""
        with self._lock:
            self._waiting.extend(rows)

    def cancel(self, row: Row) -> None:
        """Drop a row: waiting, it never runs; running, it leaves the batch at the next step."""
        row.cancelled = True

    @property
    def n_running(self) -> int:
        """Rows holding a slot: decoding (speculating too), being prefilled, or lent (new_lease)."""
        return len(self.rows) + len(self._joining) + len(self._leased) + len(self.spec.rows)

    @property
    def n_prefilling(self) -> int:
        return len(self._joining)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._joining or self._waiting or self._leased.to_release or self.spec.rows)

    def reserve(self) -> SlotPool:
        """Make the max_batch slots now (the server does, so a pool that cannot be had fails at start-up)."""
        if self.pool is None:
            self.pool = SlotPool.for_model(self.model, self.max_batch or 1, self.max_len)
        return self.pool

    def reset(self) -> list[Row]:
        """Drop every row, running and waiting; returns them (after an error, to fail them)."""
        with self._lock:
            dropped = (self.rows + self._joining.clear() + list(self._waiting) + self._leased.take_back()
                       + self.spec.clear())
            self._waiting.clear()
        self.rows, self._slots = [], []
        if self.pool is not None:
            self.pool.release_all()
        self._logits = self._unfed = None
        self.kernels.forget()  # chosen again (the model may have changed: hooks, training)
        return dropped

    # -- one iteration --

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """Draft and verify for the speculating rows, feed the others' last tokens, admit waiting rows,
        prefill (one chunk's budget, prefill_idle_budget when no row decodes), sample each decoding row's
        next token; an event per token a row gained, sampled ones before the forward that feeds them."""
        self._drop_cancelled()  # a row cancelled since the last step costs the forward nothing
        events = self.spec.step(self.pool) if self.spec.rows else []  # several tokens a row (engine.speculate)
        if self._unfed is not None and self.rows:  # feed each decoding row's newest token
            self._logits = feed(self.model, self.kernels, self.pool, self.rows, self._slots, self._unfed)
        self._unfed = None
        self._drop_cancelled()
        self._admit()
        budget = self.prefill_chunk if self.rows else self.prefill_idle_budget  # rows decoding: keep their pace
        ready = self._joining.step(self.model, self.pool, budget, self.kernels.prefill()) if self._joining.rows else []
        ready, failed = self.spec.admit(ready, self.pool) if self.spec.draft else (ready, [])  # its draft slots
        events += failed
        if ready:  # prefilled rows join the decoding ones, with the logits of their first token
            self.rows, self._slots, self._logits = in_slot_order(
                self.rows + [r for j, _ in ready for r in j.rows], self._slots + [s for j, _ in ready for s in j.slots],
                torch.cat(([self._logits] if self.rows else []) + [lg.expand(len(j.rows), -1) for j, lg in ready]))
        if not self.rows:
            return events
        n_rows = len(self.rows)
        tok, sampled, keep, src = sample_rows(self.rows, self._logits)
        self._logits = None
        if src is not None:  # beams move to the slots of the beams they continue (their group's own)
            self.pool.copy(self._slots, [self._slots[s] for s in src])
        self._keep(keep)
        tok = tok[keep] if len(keep) < n_rows else tok
        full = self._joining.rejoin_full(self.rows, self._slots, self.pool, self.model.config.n_ctx)
        go = [r for r, row in enumerate(self.rows) if row.speculate] if self.spec.proposer else []
        if full or go:  # prefilled again, in their slots, with a window of their sequence; or speculating now
            self.spec.add([self.rows[r] for r in go], [self._slots[r] for r in go], tok[go].tolist())
            keep = [r for r in range(len(self.rows)) if r not in full and not self.rows[r].speculate]
            self._keep(keep, release=False)
            tok = tok[keep]
        self._unfed = tok if self.rows else None
        return events + sampled

    def _drop_cancelled(self) -> None:
        self._keep([r for r, row in enumerate(self.rows) if not row.dropped])
        if self.spec.rows:
            self.spec.drop_cancelled(self.pool)
        self._leased.release_dropped(self.pool)
        if self._joining.rows:
            self._joining.drop_cancelled(self.pool)

    def _admit(self) -> None:
        """Waiting rows into free slots (an engine without max_batch adds slots), oldest first."""
        if not self._waiting:
            return
        with self._lock:
            room = len(self._waiting) if self.max_batch is None else self.max_batch - self.n_running
            join = admit(self._waiting, room)  # in order; a beam group whole
        if not join:
            return
        with requeued_on_error(self._waiting, self._lock, join):  # none lost off the queue: reset() fails them
            self.pool = _pool_with_room(self.pool, self.model, self.max_batch, self.max_len, self.n_running, len(join))
        join = self._leased.grant(join, self.pool)  # leases hold their slots now: reset() takes them back
        if not join:
            return
        with requeued_on_error(self._waiting, self._lock, join):
            n_ctx = self.model.config.n_ctx
            contexts = [row.context(n_ctx, row.settings.window_for(n_ctx)) for row in join]
            joining = joinings(join, [self.pool.take() for _ in join], contexts)
        self._joining.add(joining)

    def _keep(self, keep: list[int], *, release: bool = True) -> None:
        """Keep only decoding rows `keep`; the others' slots are freed (release) or kept (re-prefill)."""
        if len(keep) == len(self.rows):
            return
        if release:
            for s in set(self._slots) - {self._slots[r] for r in keep}:
                self.spec.release(self.pool, s)  # and its draft slot, where a speculating row held one
        self.rows = [self.rows[r] for r in keep]
        self._slots = [self._slots[r] for r in keep]
        sel = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self._logits is not None:
            self._logits = self._logits[sel] if keep else None
        if self._unfed is not None:
            self._unfed = self._unfed[sel] if keep else None


class KernelSets:
    """An engine's kernel sets (gpt2kit.decode.kernels_for): its decode step's, for the step's row
    count (chosen again when that changes; each set keeps the model's binding between steps), and its
    prefill's: a batching engine's (max_batch None or > 1) few-row set, prepacked where packing
    applies (decode.packed: the copy batched decode steps use), so prompt chunks run on the flat
    network's products (decode.prefill_ragged); an engine of one row makes no second copy of the
    matrices: its prompts take decode.prefill's own path (decode.path.prompt_kernels)."""

    def __init__(self, model: GPT2, max_batch: int | None, pack: bool | None) -> None:
        self.plain = getattr(model, "adapter_bank", None) is None  # False: a step must set rows' adapters
        self.model, self.max_batch, self.pack = model, max_batch, pack
        self._step: tuple[int, Kernels | None] | None = None  # (rows, the set for them)
        self._prefill: tuple[Kernels | None] | None = None  # (the prefill's set,), made at first use

    def step(self, rows: int) -> Kernels | None:
        if self._step is None or self._step[0] != rows:
            self._step = (rows, kernels_for(self.model, rows, self.pack))
        return self._step[1]

    def prefill(self) -> Kernels | None:
        if self._prefill is None:
            batches = self.max_batch is None or self.max_batch > 1
            self._prefill = (kernels_for(self.model, max(2, self.max_batch or 2), self.pack) if batches else None,)
        return self._prefill[0]

    def warm_up(self) -> None:
        """Choose a one-row step's, a full step's and the prefill's sets now (their measurements and
        packed copies), not at the first requests' steps: a server calls it before it answers ready."""
        self.step(1)
        if self.max_batch is None or self.max_batch > 1:
            self.step(self.max_batch or 2)
        self.prefill()

    def forget(self) -> None:
        self._step = self._prefill = None


def runs_adapter(engine: Engine, index: int) -> bool:
    """Whether a row the engine holds (waiting, being prefilled, decoding, lent a slot; a cancelled one
    until its next step drops it) runs LoRA adapter `index` (Row.adapter): a server unloading an
    adapter waits for this to turn False (gpt2kit.serve.adapters). Call it where the engine steps."""
    with engine._lock:
        waiting = list(engine._waiting)
    joining = [r for j in engine._joining.rows for r in j.rows]
    return any(r.adapter == index for r in (*waiting, *joining, *engine.rows, *engine.spec.rows, *engine._leased.held))


def sample_rows(rows: list[Row], logits: torch.Tensor
                ) -> tuple[torch.Tensor, list[RowEvent], list[int], list[int] | None]:
    """Each row's next token from logits (B, V): the tokens (B,), one event per row (a beam group's
    one event on its lead row, when it ends), the rows that go on (a row whose own sampling fails
    ends alone: its neighbours go on), and the beam groups' cache sources (None: none move)."""
    failed = {}
    tok, src = choose_tokens(logits, rows, failed)  # (B,)
    scores = token_logprobs(logits, tok, rows)
    events, keep = [], []
    for r, (row, t) in enumerate(zip(rows, tok.tolist(), strict=True)):
        if r in failed:
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
    return tok, events, keep, src


def feed(model: GPT2, kernels: KernelSets, pool: SlotPool, rows: list[Row], slots: list[int], tok: torch.Tensor
         ) -> torch.Tensor:
    """Feed each decoding row (rows in slots) its newest token tok (B,); their next logits (B, V)."""
    cache, mask = pool.step_cache(slots)  # over slots [0, hi); mask (hi, P + 1) or None
    B, P = cache.kv.shape[1], cache.length
    sel = None
    if B > len(rows):  # slots without a decoding row ride along; their outputs are dropped
        sel = torch.tensor(slots, dtype=torch.long, device=tok.device)
        tok = torch.full((B,), EOT_ID % model.config.n_vocab, dtype=tok.dtype,
                         device=tok.device).index_copy_(0, sel, tok)
    logits = feed_forward(model, kernels, rows, slots, tok, cache, mask)
    pool.advance(slots, P)
    return logits if sel is None else logits[sel]


def feed_forward(model: GPT2, kernels: KernelSets, rows: list[Row], slots: list[int], tok: torch.Tensor, cache,
                 mask) -> torch.Tensor:
    """decode_step of tok (B,) over a step's slots (rows in slots; Row.edits a row's interventions,
    Row.adapter its LoRA adapter; a slot riding along runs the base); with interventions, on the model's
    own forward inside their hooks (the fed tokens are generated ones)."""
    B = tok.shape[0]
    if kernels.plain:  # no row of this engine ever carried interventions, and the model has one set of weights
        return decode_step(model, tok[:, None], cache, mask, kernels.step(B))  # (B, V)
    at = by_slot(rows, slots, B)
    hooks = edited(model, at, torch.zeros(B, 1, dtype=torch.bool))
    with adapter_rows(model, [-1 if r is None else r.adapter for r in at]), hooks or contextlib.nullcontext():
        return decode_step(model, tok[:, None], cache, mask, None if hooks else kernels.step(B))  # (B, V)


def by_slot(rows: list[Row], slots: list[int], B: int) -> list[Row | None]:
    """The rows at their slots' batch indices of a step over B slots (None: a slot riding along)."""
    out: list[Row | None] = [None] * B
    for row, slot in zip(rows, slots, strict=True):
        out[slot] = row
    return out


def in_slot_order(rows: list[Row], slots: list[int], logits: torch.Tensor
                  ) -> tuple[list[Row], list[int], torch.Tensor]:
    """Rows, their slots and their logits (B, V), sorted by slot."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    if order == list(range(len(slots))):
        return rows, slots, logits
    return [rows[i] for i in order], [slots[i] for i in order], logits[torch.tensor(order, device=logits.device)]


def joinings(rows: list[Row], slots: list[int], contexts: list[list[int]]) -> list[Joining]:
    """The joining rows' prefills: a beam group's prompt once, in its first slot, its other slots
    given it when it is done."""
    first, of = prefill_index(rows)
    return [Joining(rows[r], slots[r], contexts[r], [(rows[b], slots[b]) for b in range(len(rows)) if of[b] == i
                                                      and b != r]) for i, r in enumerate(first)]


def _check_row(engine: Engine, prompt: Sequence[int], settings: SamplingSettings, method: str | None = None) -> None:
    """The request's check (gpt2kit.engine.checks), then whether a row of it fits the engine's slots."""
    cfg = engine.model.config
    check_request([len(prompt)], settings, n_ctx=cfg.n_ctx, n_vocab=cfg.n_vocab,
                  tokenizer=engine.tokenizer is not None, method=method)
    check_columns(len(prompt), settings.max_new_tokens, cfg.n_ctx, engine.max_len)


def check_columns(n_prompt: int, max_new_tokens: int, n_ctx: int, max_len: int) -> None:
    """A ValueError when a row of this prompt and max_new_tokens needs more than max_len columns."""
    need = columns_needed(n_prompt, max_new_tokens, n_ctx)
    if need > max_len:
        raise ValueError(f"a row of {n_prompt} prompt tokens and max_new_tokens={max_new_tokens} "
                         f"needs {need} cache columns; this engine's slots hold max_len={max_len}")


def columns_needed(prompt_len: int, max_new_tokens: int, n_ctx: int) -> int:
    """The cache columns a row of this prompt and max_new_tokens reaches (its last token is never
    fed), at most n_ctx (a longer row is prefilled again with a window)."""
    return min(n_ctx, max(prompt_len, prompt_len + max_new_tokens - 1))
