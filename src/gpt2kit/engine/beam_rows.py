"""Beam search as rows of the shared engine (gpt2kit.engine.scheduler), beside other requests' rows.

One prompt's beam search is a :class:`BeamGroup`: num_beams rows (slots) that join the running
batch together (admitted whole, one prefill of the prompt in the group's first slot, copied to its
others), are stepped by the group's :class:`~gpt2kit.engine.beam.BeamState` instead of a sampler,
and leave together (gpt2kit.generation.generate and the server both run beam search so). Each
step the slots take the surviving beams' keys and values: one gather among the groups' own slots, for every group of
the batch at once (SlotPool.copy, counted in its beam_bytes); other rows' slots are not read or
written, so their tokens are what they are alone. The group gives one event at the end, on its
lead row, with its returned beams (RowEvent.beams).

Legend: B rows in the batch, nb beams of a group, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import gpt2kit.sampling.sampler as sampler
from gpt2kit.engine.beam import BeamState
from gpt2kit.engine.rows import Row, RowEvent, RowKey

if TYPE_CHECKING:
    from gpt2kit.engine.beam import Beam
    from gpt2kit.sampling import SamplingSettings


class BeamGroup:
    """One prompt's beam search: its rows (slots, in batch order), its search state, its result."""

    def __init__(self, prompt: Sequence[int], settings: SamplingSettings, device: torch.device, key: RowKey,
                 max_batch: int | None) -> None:
        nb = settings.num_beams
        if max_batch is not None and nb > max_batch:
            raise ValueError(f"num_beams={nb} rows run at once: at most max_batch={max_batch}")
        self.rows = [Row(list(prompt), settings, None, key=key if k == 0 else RowKey(key.index, key.prompt_index, k,
                                                                                      key.owner), beam=self)
                     for k in range(nb)]
        self.state = BeamState(1, settings, device)
        self.beams: list[Beam] | None = None  # once the search has ended: the returned beams, best first

    @property
    def lead(self) -> Row:
        return self.rows[0]

    @property
    def cancelled(self) -> bool:
        return any(r.cancelled for r in self.rows)

    def step(self, logits: torch.Tensor, idx: list[int], tok: torch.Tensor, src: list[int]) -> None:
        """Step the search on its rows' logits (batch rows idx, in slot order, of logits (B, V)):
        write their tokens into tok (B,) and their cache sources into src (B,); or, when it has
        ended, finish every row."""
        sel = torch.tensor(idx, device=logits.device)
        moves = self.state.step(logits[sel])
        if moves is None:
            self.beams = self.state.results()[0]
            for row in self.rows:
                row.finish_reason = self.beams[0].finish_reason
            return
        t, frm = moves
        tok[sel] = t
        for r, k in zip(idx, frm.tolist(), strict=True):
            src[r] = idx[k]
        for row, seq in zip(self.rows, self.state.running(), strict=True):
            row.tokens = seq  # the beam this slot now holds

    def event(self) -> RowEvent:
        return RowEvent(self.lead, -1, "", self.beams[0].finish_reason, beams=tuple(self.beams))


def choose_tokens(logits: torch.Tensor, rows: list[Row], failed: dict[int, Exception]
                  ) -> tuple[torch.Tensor, list[int] | None]:
    """Each running row's next token (B,) from logits (B, V): its sampler's draw, or its beam
    group's step; and the groups' cache sources (None: no row moves). A row whose choice raises is
    recorded in failed (next_tokens)."""
    if all(row.beam is None for row in rows):
        return sampler.next_tokens(logits, [row.sampler for row in rows], failed), None
    tok = torch.zeros(len(rows), dtype=torch.long, device=logits.device)  # (B,)
    plain = [r for r, row in enumerate(rows) if row.beam is None]
    if plain:
        mine: dict[int, Exception] = {}
        tok[plain] = sampler.next_tokens(logits[plain], [rows[r].sampler for r in plain], mine)
        failed.update({plain[r]: e for r, e in mine.items()})
    return tok, step_groups(logits, rows, tok, failed)


def step_groups(logits: torch.Tensor, rows: list[Row], tok: torch.Tensor,
                failed: dict[int, Exception]) -> list[int] | None:
    """Step every beam group among the batch's rows (logits (B, V), tok (B,) filled in for their
    rows); returns the batch's cache sources (row r continues row src[r]'s cache), None when no
    row moves. A group whose step raises fails alone (its rows in failed)."""
    groups: dict[BeamGroup, list[int]] = {}
    for r, row in enumerate(rows):
        if row.beam is not None:
            groups.setdefault(row.beam, []).append(r)
    src = list(range(len(rows)))
    for group, idx in groups.items():
        assert [rows[r] for r in idx] == group.rows, "a beam group's rows keep their slot order"
        try:
            group.step(logits, idx, tok, src)
        except Exception as e:  # this group alone fails, as a row whose sampling raises
            failed.update(dict.fromkeys(idx, e))
    return None if src == list(range(len(rows))) else src


def prefill_index(rows: list[Row]) -> tuple[list[int], list[int]]:
    """The joining rows to prefill (a beam group's first slot only) and, for every joining row, the
    index among those whose prefill it takes."""
    first, of = [], []
    seen: dict[BeamGroup, int] = {}
    for r, row in enumerate(rows):
        if row.beam is not None and row.beam in seen:
            of.append(seen[row.beam])
            continue
        if row.beam is not None:
            seen[row.beam] = len(first)
        of.append(len(first))
        first.append(r)
    return first, of


def admit(waiting, room: int) -> list[Row]:
    """Take rows from the front of the waiting deque, in order, while room allows (room: rows),
    a beam group whole or not yet (it waits at the front, so no later row passes it); rows dropped
    since they were queued are discarded."""
    join: list[Row] = []
    while waiting:
        head = waiting[0]
        n = len(head.beam.rows) if head.beam is not None else 1
        if not head.dropped and len(join) + n > room:
            break
        taken = [waiting.popleft() for _ in range(n)]
        assert head.beam is None or taken == head.beam.rows, "a beam group's rows are submitted together"
        if not head.dropped:
            join.extend(taken)
    return join
