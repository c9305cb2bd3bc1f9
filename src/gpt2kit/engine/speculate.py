"""Speculative decoding as rows of the one scheduler (gpt2kit.engine.scheduler), vLLM v1's
per-row proposers: a row that speculates drafts up to k tokens a step (from a prompt-lookup match,
or from a small draft model), the target checks them all in one forward over [its pending token,
drafts] in the row's own slot of the engine's pool, and the row keeps the prefix
gpt2kit.engine.drafts accepts plus one token of the target's own. Greedy output is the target's
greedy output token for token; sampled output is distributed exactly as the target's (the rejection
rule).

Which rows speculate is decided once, when the engine makes the row (:meth:`Proposer.speculates`):
the engine has a proposer; the row is no beam, lease nor row with interventions; it is greedy, or
the proposer drafts for sampled rows too (generate, where the settings ask for it; a server drafts
for greedy requests only, so a sampled request keeps its seeded tokens); and its whole sequence
with a step's drafts fits in the context (prompt + max_new_tokens + k <= n_ctx: it is never
prefilled again with a window). Every other row decodes as it would without a proposer.

A speculating row joins as any row (chunked prefill into its slot; its first token from that
prefill, sampled as every row's is) and then leaves the engine's plain decode for
:class:`Speculation`. Its slot holds its context but the pending token; a step writes [pending,
drafts] at the columns [P, P + T) of the step's rows (SlotPool.step_cache with T tokens a row:
rows with fewer drafts padded, their extra positions read by no one), and SlotPool.settle keeps
each row's accepted ones, moved to its own columns: a row's length is what it accepted, with no
holes and no mask past the step. A draft model keeps its keys and values in a pool of its own
that mirrors the target's slots (same slot, same length): its prompt is prefilled when the row's
target prefill is done, its k + 1 draft steps (the last only fills its cache) decode there, and its
lengths follow the target's after the verify. Prompt lookup needs no cache.

Drafts are clipped to what the row has left (the target adds one token of its own) and to the
slots' columns. A step or admission of speculating rows that raises fails those rows (an event
each, their slots freed); the engine's other rows go on.

Legend: B rows of a step (one past the highest slot), T tokens a row in a verify (k + 1), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import Kernels, decode_step, decode_tokens, kernels_for
from gpt2kit.engine.batch_cache import SlotPool
from gpt2kit.engine.drafts import accept_drafts, greedy_accept, lookup_drafts
from gpt2kit.engine.outputs import advance, token_logprobs
from gpt2kit.engine.prefill import Joining, prefill_slots
from gpt2kit.engine.rows import Row, RowEvent, fail
from gpt2kit.sampling.sampler import check_finite, warp

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.sampling import SamplingSettings


def check_draft_model(model: GPT2, draft: GPT2, name: str | None = None) -> None:
    """ValueError unless draft can draft for model: the same vocabulary, device and dtype, and a context
    at least the target's (the draft's slots hold every column the target's do). name: the draft's
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


@dataclass(frozen=True)
class Proposer:
    """Where an engine's speculating rows get their drafts: a draft model, or prompt lookup (draft
    None). k: tokens drafted a step for every row (0: each row's own settings, draft_tokens with a
    draft model, prompt_lookup without). sampled: sampled rows speculate too (False: greedy rows only)."""

    draft: GPT2 | None = None
    k: int = 0
    sampled: bool = True

    def tokens(self, settings: SamplingSettings) -> int:
        """Draft tokens a step for a row of these settings."""
        return self.k or (settings.draft_tokens if self.draft is not None else settings.prompt_lookup)

    def speculates(self, row: Row, n_ctx: int) -> bool:
        """Whether the row speculates (module doc): the one place this is decided."""
        s, k = row.settings, self.tokens(row.settings)
        return (k > 0 and row.beam is None and row.lease is None and row.edits is None
                and (s.greedy or self.sampled) and len(row.prompt) + s.max_new_tokens + k <= n_ctx)


class Speculation:
    """An engine's speculating rows (module doc), in slot order, each with its pending token; the
    draft model's pool; the drafts proposed and kept over every row (a server's acceptance rate).
    proposer None: an engine whose rows never speculate."""

    def __init__(self, model: GPT2, proposer: Proposer | None, pack: bool | None = None) -> None:
        draft = proposer.draft if proposer is not None else None
        if draft is not None:
            check_draft_model(model, draft)
        self.model, self.proposer, self.draft, self.pack = model, proposer, draft, pack
        self.rows: list[Row] = []
        self.slots: list[int] = []
        self.pending: list[int] = []  # each row's newest token, not yet fed
        self.draft_pool: SlotPool | None = None  # the draft model's slots, mirroring the engine's pool
        self.drafted = self.accepted = 0
        self._kernel_sets: dict[tuple[int, int], Kernels | None] = {}  # (model's index, rows) -> its set

    def speculates(self, row: Row) -> bool:
        """Whether a new row speculates (the engine has a proposer, and Proposer.speculates)."""
        return self.proposer is not None and self.proposer.speculates(row, self.model.config.n_ctx)

    def admit(self, ready: list[tuple[Joining, torch.Tensor]], pool: SlotPool
              ) -> tuple[list[tuple[Joining, torch.Tensor]], list[RowEvent]]:
        """The rows the engine's chunked prefill made ready: with a draft model, the speculating ones'
        prompts are prefilled into the draft's slots (one forward); when that raises those rows fail
        (an event each, their slots freed). Returns the ready rows that go on and those events."""
        joining = [j for j, _ in ready if j.row.speculate]
        if self.draft is None or not joining:
            return ready, []
        try:
            prefill_draft(self, pool, joining)
        except Exception as e:  # e.g. a draft pool that cannot be had: these rows alone
            for j in joining:
                self.release(pool, j.slot)
            return [(j, lg) for j, lg in ready if not j.row.speculate], fail([j.row for j in joining], e)
        return ready, []

    def add(self, rows: list[Row], slots: list[int], tokens: list[int]) -> None:
        """Rows that sampled their first token (tokens: theirs, not yet fed) speculate from the next step."""
        if not rows:
            return
        merged = sorted(zip(self.slots + slots, self.rows + rows, self.pending + tokens, strict=True),
                        key=lambda x: x[0])
        self.slots, self.rows, self.pending = (list(x) for x in zip(*merged, strict=True))

    def drop_cancelled(self, pool: SlotPool | None) -> None:
        if any(row.cancelled for row in self.rows):
            self._keep(pool, [r for r, row in enumerate(self.rows) if not row.cancelled])

    def clear(self) -> list[Row]:
        """Every row, dropped (the engine's reset frees its pool's slots; the draft's go with them)."""
        rows, self.rows, self.slots, self.pending = self.rows, [], [], []
        if self.draft_pool is not None:
            self.draft_pool.release_all()
        self._kernel_sets = {}
        return rows

    def step(self, pool: SlotPool) -> list[RowEvent]:
        """Draft and verify once for every speculating row; one event per token a row gained. A step
        that raises fails these rows (their slots freed); the engine's others go on."""
        try:
            return self._step(pool)
        except Exception as e:
            rows = list(self.rows)
            self._keep(pool, [])
            return fail(rows, e)

    def _step(self, pool: SlotPool) -> list[RowEvent]:
        rows, slots = self.rows, self.slots
        P = max(pool.lengths[s] for s in slots)  # the step's width; its tokens go to [P, P + T)
        room = pool.n_cols - P - 1  # >= 0: a row that goes on has a token left, so n <= n_cols - 1
        caps = [min(self.proposer.tokens(row.settings), row.settings.max_new_tokens - len(row.tokens) - 1, room)
                for row in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]  # the draft's distributions, sampled rows
        if self.draft is None:
            drafts = [lookup_drafts(row.prompt + row.tokens, c) for row, c in zip(rows, caps, strict=True)]
        else:
            drafts = draft_tokens(self, slots, caps, qs)
        logits = verify(self, pool, drafts)  # (b, T, V)
        T = logits.shape[1]
        argmax = _greedy_argmax(rows, logits)
        events, keep, kept = [], [], []
        for r, row in enumerate(rows):
            q = qs[r] if self.draft is not None else None
            try:
                n, nxt = greedy_accept(argmax[r], drafts[r]) if argmax else _accept(row, logits[r], drafts[r], q)
            except Exception as e:  # this row alone fails, as in the engine's step
                events += fail([row], e)
                kept.append(0)
                continue
            row.drafted, row.accepted = row.drafted + len(drafts[r]), row.accepted + n
            self.drafted, self.accepted = self.drafted + len(drafts[r]), self.accepted + n
            kept.append(1 + n)  # the pending token and the drafts kept are in the cache now
            new = list(drafts[r][:n]) + [nxt]
            for i, t in enumerate(new):
                events.append(_emit(row, t, logits[r, i:i + 1]))
                if row.finish_reason is not None:
                    break
            if row.finish_reason is None:
                keep.append(r)
                self.pending[r] = new[-1]
        pool.settle(slots, P, T, kept)
        if self.draft_pool is not None:
            for s in slots:
                self.draft_pool.lengths[s] = pool.lengths[s]
        self._keep(pool, keep)
        return events

    def kernels(self, which: int, rows: int) -> Kernels | None:
        """The target's (which 0) or draft's (1) kernel set for `rows` rows, chosen once per row count
        (it keeps its model's binding)."""
        key = (which, rows)
        if key not in self._kernel_sets:
            self._kernel_sets[key] = kernels_for(self.model if which == 0 else self.draft, rows, self.pack)
        return self._kernel_sets[key]

    def _keep(self, pool: SlotPool | None, keep: list[int]) -> None:
        """Keep rows `keep`; the others' slots (and draft slots) are freed."""
        if len(keep) == len(self.rows):
            return
        for r in set(range(len(self.rows))) - set(keep):
            self.release(pool, self.slots[r])
        self.rows = [self.rows[r] for r in keep]
        self.slots = [self.slots[r] for r in keep]
        self.pending = [self.pending[r] for r in keep]

    def release(self, pool: SlotPool | None, slot: int) -> None:
        """Free `slot` in the engine's pool and its mirror in the draft's (a row that ended, speculating or not)."""
        if pool is not None:
            pool.release(slot)
        if self.draft_pool is not None and slot < self.draft_pool.n_slots:
            self.draft_pool.release(slot)


def prefill_draft(spec: Speculation, pool: SlotPool, joining: list[Joining]) -> None:
    """The draft model's keys and values of the joining rows' contexts, each in its slot of the draft's
    pool (made, or grown, to mirror the engine's pool), in one forward (engine.prefill.prefill_slots)."""
    draft = spec.draft
    if spec.draft_pool is None:
        spec.draft_pool = SlotPool.for_model(draft, pool.n_slots, pool.n_cols)
    elif spec.draft_pool.n_slots < pool.n_slots:
        spec.draft_pool.grow(pool.n_slots)
    for j in joining:
        spec.draft_pool.hold(j.slot)
    group = [(Joining(j.row, j.slot, j.context), len(j.context)) for j in sorted(joining, key=lambda j: j.slot)]
    prefill_slots(draft, spec.draft_pool, group, spec.kernels(1, max(2, len(group))))


def _spread(tok: torch.Tensor, slots: list[int], B: int, n_vocab: int) -> torch.Tensor:
    """Rows' tokens tok (b, ...) at their slots' indices of a step over B slots; EOT for slots riding along."""
    if B == len(slots):
        return tok
    out = torch.full((B, *tok.shape[1:]), EOT_ID % n_vocab, dtype=tok.dtype, device=tok.device)
    return out.index_copy_(0, torch.tensor(slots, device=tok.device), tok)


def draft_tokens(spec: Speculation, slots: list[int], caps: list[int], qs: list[list[torch.Tensor]]
                 ) -> list[list[int]]:
    """K = max(caps) draft tokens a row, one draft step each after the pending tokens, in the draft's
    slots (the last draft is fed too, so the draft's slots hold what the target's will); each row
    keeps its first caps[r]; sampled rows' distributions go to qs[r]."""
    draft, dpool, rows = spec.draft, spec.draft_pool, spec.rows
    K, out = max(caps), [[] for _ in rows]
    device = draft.wpe.weight.device
    tok = torch.tensor(spec.pending, dtype=torch.long, device=device)  # (b,)
    greedy = all(row.settings.greedy for row in rows)
    for j in range(K + 1):  # the pending token, then each draft
        cache, mask = dpool.step_cache(slots)
        B, P = cache.kv.shape[1], cache.length
        idx = _spread(tok, slots, B, draft.config.n_vocab)[:, None]  # (B, 1)
        dl = decode_step(draft, idx, cache, mask, spec.kernels(1, B), head=j < K)  # (B, V), None at the last
        dpool.advance(slots, P)
        if j == K:
            break
        dl = dl if B == len(slots) else dl[torch.tensor(slots, device=device)]  # (b, V)
        if greedy:
            tok = dl.argmax(-1)  # (b,)
        else:
            tok = torch.stack([_draw_draft(row, dl[r:r + 1], qs[r]) for r, row in enumerate(rows)])
        for r, t in enumerate(tok.tolist()):
            out[r].append(t)
    for r, c in enumerate(caps):
        out[r], qs[r][:] = out[r][:c], qs[r][:c]
    return out


def verify(spec: Speculation, pool: SlotPool, drafts: list[list[int]]) -> torch.Tensor:
    """The target's logits (b, T, V) at each row's [pending token, drafts...] in its slot (rows with
    fewer drafts padded; T = 1 + the most drafts): the flat step on B * T rows of products, the
    weights read about once, as for one token a row (decode.decode_tokens)."""
    T = 1 + max(map(len, drafts))
    n_vocab = spec.model.config.n_vocab
    idx = torch.full((len(drafts), T), EOT_ID % n_vocab, dtype=torch.long)  # (b, T)
    for r, d in enumerate(drafts):
        idx[r, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
    idx[:, 0] = torch.tensor(spec.pending, dtype=torch.long)
    cache, mask = pool.step_cache(spec.slots, T)
    B = cache.kv.shape[1]
    idx = _spread(idx.to(pool.kv.device), spec.slots, B, n_vocab)  # (B, T)
    logits = decode_tokens(spec.model, idx, cache, mask, spec.kernels(0, B * T))  # (B, T, V)
    return logits if B == len(spec.slots) else logits[torch.tensor(spec.slots, device=logits.device)]


def _greedy_argmax(rows: list[Row], logits: torch.Tensor) -> list[list[int]] | None:
    """Where every row is plain greedy, their argmax tokens (b, T) from one pass over logits
    (b, T, V), the maxima checked finite in the same pass; else None."""
    if not all(row.settings.plain_greedy for row in rows):
        return None
    top, at = logits.max(-1)  # (b, T) each
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


def _accept(row: Row, logits: torch.Tensor, drafts: list[int], q: list[torch.Tensor] | None) -> tuple[int, int]:
    """(drafts kept, the target's next token) for one row; logits (T, V) of its step; q the draft
    model's distributions of its drafts (None: prompt lookup's point masses)."""
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
