"""Chunked prefill (vLLM's): the rows joining the batch, each prefilled into its own slot of the
pool (gpt2kit.engine.batch_cache) a chunk per step, beside the running rows' decode steps.

A step prefills at most ``chunk`` prompt tokens over all joining rows, oldest first (always one
chunk, so every joining row gets there): a prompt of n tokens joins after ceil(n / chunk) steps,
and no step stalls the running rows for more than a chunk. Row r's k-th chunk is its
context[k * chunk:][:chunk] whatever else is joining, so its keys and values (and the logits its
first token is drawn from) are what they are when it runs alone. Each chunk is a forward of its
own row (batch 1) through a KVCache view of the row's slot, written in place.

Legend: T a chunk's tokens, V vocab.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpt2kit.decode import prefill

if TYPE_CHECKING:
    from gpt2kit.engine.batch_cache import SlotPool
    from gpt2kit.engine.rows import Row
    from gpt2kit.model import GPT2


@dataclass(eq=False)
class Joining:
    """A row being prefilled into its slot: context[:done] is in the cache. beams: a beam group's
    other rows and their slots, given this row's prefill when it is done (SlotPool.copy)."""

    row: Row
    slot: int
    context: list[int]
    beams: list[tuple[Row, int]] = field(default_factory=list)
    done: int = 0

    @property
    def rows(self) -> list[Row]:
        return [self.row] + [r for r, _ in self.beams]

    @property
    def slots(self) -> list[int]:
        return [self.slot] + [s for _, s in self.beams]


class ChunkedPrefill:
    """The joining rows, oldest first (rows prefilled again after a full context go first)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.rows: deque[Joining] = deque()

    def __len__(self) -> int:
        """The rows holding a slot here (a beam group's every row)."""
        return sum(1 + len(j.beams) for j in self.rows)

    def add(self, joining: list[Joining], *, first: bool = False) -> None:
        if first:
            self.rows.extendleft(reversed(joining))
        else:
            self.rows.extend(joining)

    def clear(self) -> list[Row]:
        rows = [r for j in self.rows for r in j.rows]
        self.rows.clear()
        return rows

    def drop_cancelled(self, pool: SlotPool) -> None:
        """Cancelled rows (a beam group with any row cancelled) leave; their slots are freed."""
        if any(j.row.dropped for j in self.rows):
            for j in self.rows:
                if j.row.dropped:
                    for s in j.slots:
                        pool.release(s)
            self.rows = deque(j for j in self.rows if not j.row.dropped)

    def step(self, model: GPT2, pool: SlotPool) -> list[tuple[Joining, torch.Tensor]]:
        """One step's chunks (module doc); returns the rows now wholly prefilled, each with the
        logits (1, V) of its next token (a beam group's every row has them)."""
        used, ready = 0, []
        device = pool.kv.device
        while self.rows:
            j = self.rows[0]
            T = min(self.chunk, len(j.context) - j.done)
            if used and used + T > self.chunk:
                break
            cache = pool.row_cache(j.slot)  # a view of the row's slot, written in place
            idx = torch.tensor([j.context[j.done:j.done + T]], dtype=torch.long, device=device)  # (1, T)
            logits = prefill(model, idx, None, cache)  # (1, V)
            j.done += T
            used += T
            pool.prefilled(j.slot, cache.length)
            if j.done < len(j.context):
                break  # a whole chunk: this step's budget is spent
            self.rows.popleft()
            if j.beams:  # every slot of a beam group starts from its prompt
                pool.copy([s for _, s in j.beams], [j.slot] * len(j.beams))
            ready.append((j, logits))
        return ready
