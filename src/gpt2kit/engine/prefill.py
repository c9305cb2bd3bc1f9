"""Chunked prefill (vLLM's): the rows joining the batch, each prefilled into its own slot of the
pool (gpt2kit.engine.batch_cache) a chunk per step, beside the running rows' decode steps.

A step prefills at most one chunk of each joining row, oldest first, within a budget of prompt
tokens (always one chunk, so every joining row gets there): while rows decode the budget is
``chunk``, so no step stalls the running rows for more than a chunk; while none decodes there is
nothing to protect and the budget is the engine's ``prefill_idle_budget`` (default: every joining
row's next chunk), so a burst of prompts joining an idle engine is prefilled in one step, not one
chunk's worth a step. A prompt of n tokens joins after ceil(n / chunk) steps either way. Row r's
k-th chunk is its context[k * chunk:][:chunk] whatever else is joining, so its keys and values (and
the logits its first token is drawn from) are what they are when it runs alone. A step's first
chunks (a burst of prompts joining together, as generate's batches and a server's clients send
them) are one forward wherever their slots are (each row's keys and values written into its own
slot: holes left between running rows by rows that finished apart do not split the burst), and its
later chunks at the same cache length in consecutive slots one forward through a KVCache view of
those slots, written in place; each right-padded to the longest chunk (decode.prefill_ragged:
causal attention keeps the padding out of every row's tokens; its keys and values land past the
row's length, columns the pool zeroes before any step reads them); any other chunk is a forward of
its own row. One forward for the burst matters for short prompts: a forward of a few tokens is
bound by reading the weights, so 8 one-row forwards of 16 tokens cost several times one of (8, 16)
(measured in docs/serving.md).

With a prefix cache (gpt2kit.prefix_cache), a joining row (a row prefilled again with a window of
its sequence too) starts, at its first step here, from the blocks of its context the cache holds
(:meth:`ChunkedPrefill.reuse`: written into its slot, SlotPool.fill), at most all but its last
token, which always runs so the row has its logits; its chunks then cut the rest. A row whose
prefill is done leaves its context's whole blocks in the cache for the next ones.

Legend: T a chunk's tokens, V vocab.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode.step import prefill_ragged
from gpt2kit.engine.rows import edited
from gpt2kit.lora import adapter_rows

if TYPE_CHECKING:
    from gpt2kit.decode import Kernels
    from gpt2kit.engine.batch_cache import SlotPool
    from gpt2kit.engine.rows import Row
    from gpt2kit.model import GPT2
    from gpt2kit.prefix_cache import PrefixCache


def _namespace(row: Row) -> tuple[str, int] | None:
    """The prefix cache's namespace for a row's blocks: the LoRA adapter it runs, or the base's (None)."""
    return ("adapter", row.adapter) if row.adapter >= 0 else None


@dataclass(eq=False)
class Joining:
    """A row being prefilled into its slot: context[:done] is in the cache. beams: a beam group's
    other rows and their slots, given this row's prefill when it is done (SlotPool.copy)."""

    row: Row
    slot: int
    context: list[int]
    beams: list[tuple[Row, int]] = field(default_factory=list)
    done: int = 0
    looked_up: bool = False  # in the prefix cache (ChunkedPrefill.reuse)

    @property
    def rows(self) -> list[Row]:
        return [self.row] + [r for r, _ in self.beams]

    @property
    def slots(self) -> list[int]:
        return [self.slot] + [s for _, s in self.beams]


class ChunkedPrefill:
    """The joining rows, oldest first (rows prefilled again after a full context go first)."""

    def __init__(self, chunk: int, prefix_cache: PrefixCache | None = None) -> None:
        self.chunk, self.prefix_cache = chunk, prefix_cache
        self.rows: deque[Joining] = deque()

    def __len__(self) -> int:
        """The rows holding a slot here (a beam group's every row)."""
        return sum(1 + len(j.beams) for j in self.rows)

    def add(self, joining: list[Joining], *, first: bool = False) -> None:
        if first:
            self.rows.extendleft(reversed(joining))
        else:
            self.rows.extend(joining)

    def reuse(self, model: GPT2, pool: SlotPool) -> None:
        """Each row new here (its slot empty) starts from the blocks of its context the prefix
        cache holds, all but its last token at most (module doc). A row with interventions neither
        reads nor leaves blocks: its keys and values are not the model's own; a LoRA adapter's rows
        keep theirs apart (_namespace)."""
        for j in self.rows:
            if not j.looked_up and j.row.edits is None:
                j.looked_up = True
                blocks = self.prefix_cache.lookup_blocks(model, j.context, len(j.context) - 1, _namespace(j.row))
                if blocks:
                    j.done = pool.fill(j.slot, blocks)

    def clear(self) -> list[Row]:
        rows = [r for j in self.rows for r in j.rows]
        self.rows.clear()
        return rows

    def rejoin_full(self, rows: list[Row], slots: list[int], pool: SlotPool, n_ctx: int) -> list[int]:
        """The decoding rows (in slots) whose context is full: each is prefilled again, first, in its
        own slot, with a window of its sequence (Row.context); returns their indices."""
        full = [r for r, s in enumerate(slots) if pool.lengths[s] >= n_ctx]
        again = []
        for r in full:
            pool.restart(slots[r])
            again.append(Joining(rows[r], slots[r], rows[r].context(n_ctx, rows[r].settings.window_for(n_ctx))))
        self.add(again, first=True)
        return full

    def drop_cancelled(self, pool: SlotPool) -> None:
        """Cancelled rows (a beam group with any row cancelled) leave; their slots are freed."""
        if any(j.row.dropped for j in self.rows):
            for j in self.rows:
                if j.row.dropped:
                    for s in j.slots:
                        pool.release(s)
            self.rows = deque(j for j in self.rows if not j.row.dropped)

    def step(self, model: GPT2, pool: SlotPool, budget: int | None, kernels: Kernels | None = None
             ) -> list[tuple[Joining, torch.Tensor]]:
        """One step's chunks (module doc): each joining row's next chunk, oldest first, while they
        fit in `budget` prompt tokens (None: every row's), the first always; returns the rows now
        wholly prefilled, each with the logits (1, V) of its next token (a beam group's every row
        has them). kernels: the kernel set the forwards run on (decode.prefill_ragged; None: the
        model's own forward)."""
        if self.prefix_cache is not None:
            self.reuse(model, pool)
        used, work = 0, []  # work: (joining row, its chunk's length T)
        for j in self.rows:
            T = min(self.chunk, len(j.context) - j.done)
            if used and budget is not None and used + T > budget:
                break
            work.append((j, T))
            used += T
        logits = {}
        for group in same_shape_runs(work):
            for (j, _), lg in zip(group, prefill_slots(model, pool, group, kernels), strict=True):
                logits[j] = lg
        ready = []
        for j, T in work:
            j.done += T
            if j.done < len(j.context):
                continue
            if self.prefix_cache is not None and j.row.edits is None:
                self.prefix_cache.store_blocks(model, j.context, pool.kv[:, j.slot], _namespace(j.row))
            if j.beams:  # every slot of a beam group starts from its prompt
                pool.copy([s for _, s in j.beams], [j.slot] * len(j.beams))
            ready.append((j, logits[j]))
        if ready:
            finished = {j for j, _ in ready}
            self.rows = deque(j for j in self.rows if j not in finished)
        return ready


def same_shape_runs(work: list[tuple[Joining, int]]) -> list[list[tuple[Joining, int]]]:
    """A step's chunks (row, T) in groups that one forward takes: every first chunk (nothing cached:
    one forward writes each row's slot wherever it is, SlotPool.first_chunk_cache), and the later
    chunks of one cache length (done) in consecutive slots (one view of the pool holds them and no
    other row's columns are touched)."""
    first = sorted((w for w in work if w[0].done == 0), key=lambda w: w[0].slot)
    groups: list[list[tuple[Joining, int]]] = [first] if first else []
    runs: list[list[tuple[Joining, int]]] = []
    for j, T in sorted((w for w in work if w[0].done > 0), key=lambda w: w[0].slot):
        last = runs[-1][-1][0] if runs else None
        if last is not None and last.slot + 1 == j.slot and last.done == j.done:
            runs[-1].append((j, T))
        else:
            runs.append([(j, T)])
    return groups + runs


def prefill_slots(model: GPT2, pool: SlotPool, group: list[tuple[Joining, int]], kernels: Kernels | None = None
                  ) -> list[torch.Tensor]:
    """One forward of a group's chunks, right-padded to the longest (decode.prefill_ragged),
    through a view of their slots (or, for first chunks in slots apart, a cache writing each
    row's own slot), written in place; each row's logits (1, V)."""
    first, done = group[0][0], group[0][0].done
    T = max(t for _, t in group)
    slots = [j.slot for j, _ in group]
    if slots == list(range(first.slot, first.slot + len(group))):
        cache = pool.rows_cache(first.slot, len(group))
    else:
        cache = pool.first_chunk_cache(slots)
    pad = EOT_ID % model.config.n_vocab
    idx = torch.tensor([j.context[done:done + t] + [pad] * (T - t) for j, t in group], dtype=torch.long,
                       device=pool.kv.device)  # (b, T)
    hooks = edited(model, [j.row for j, _ in group], _prompt_tokens(group, done, T))
    with adapter_rows(model, [j.row.adapter for j, _ in group]):
        if hooks is None:
            logits = prefill_ragged(model, idx, [t - 1 for _, t in group], cache, kernels)  # (b, V)
        else:
            with hooks:  # on the model's own modules, where the hooks fire
                logits = prefill_ragged(model, idx, [t - 1 for _, t in group], cache, None)
    for j, t in group:
        pool.prefilled(j.slot, done + t)
    return list(logits.split(1))


def _prompt_tokens(group: list[tuple[Joining, int]], done: int, T: int) -> torch.Tensor:
    """(b, T) bool: which of each chunk's tokens are its row's prompt tokens (a row prefilled again
    after a full context has generated tokens in its window)."""
    at = torch.arange(done, done + T)
    return torch.stack([at + j.row.start < len(j.row.prompt) for j, _ in group])
