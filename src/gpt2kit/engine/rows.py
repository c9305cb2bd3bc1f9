"""A row (one sample of one prompt being generated), its routing key and its per-step event; the
declared interfaces of a row group (:class:`RowGroup`) and of an engine (:class:`EngineInterface`);
how an engine gives rows up when it cannot run them (failed with an event each, or back on its queue)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import threading
    from collections import deque
    from collections.abc import Iterator, Sequence

    import torch

    from gpt2kit.engine.batch_cache import SlotPool
    from gpt2kit.engine.beam import Beam
    from gpt2kit.engine.text import RowText
    from gpt2kit.kv_cache import KVCache
    from gpt2kit.sampling import SamplingSettings
    from gpt2kit.sampling.sampler import RowSampler


class RowEdits(Protocol):
    """What a row changes in the network while it runs (gpt2kit.trace.steering.Edits): a forward
    holding such rows runs on the model's own modules inside hooks(model, rows' edits, prompt), where
    prompt (B, T) says which of each row's tokens are prompt tokens."""

    def hooks(self, model, rows: list[RowEdits | None], prompt: torch.Tensor) -> contextlib.AbstractContextManager:
        ...


@dataclass(frozen=True)
class RowKey:
    """Where a row's events go: index is the caller's sequence index (generate: prompt_index *
    num_samples + sample_index); owner the request the row belongs to (the server's job; None for
    generate), so events are routed without guessing at the key's shape."""

    index: int = 0
    prompt_index: int = 0
    sample_index: int = 0
    owner: object | None = None


@runtime_checkable
class RowGroup(Protocol):
    """Rows that join the batch together, are stepped together and leave together, with one event
    at the end on the lead row (a beam search: gpt2kit.engine.beam_rows.BeamGroup)."""

    rows: list[Row]  # in slot order, submitted together

    @property
    def lead(self) -> Row: ...

    @property
    def cancelled(self) -> bool: ...

    def event(self) -> RowEvent: ...


@dataclass(eq=False)
class SlotLease:
    """A slot of the engine's cache lent to a search that runs its own forwards in it (contrastive
    search, gpt2kit.engine.contrastive): cache is a KVCache over that slot while the row holds it,
    None before it joins and after it leaves (cancelled, or taken back by Engine.reset)."""

    cache: KVCache | None = None
    granted: bool = False  # it has held its slot (so a cache of None now means the slot is gone)

    def grant(self, pool: SlotPool, slot: int) -> None:
        self.cache, self.granted = pool.row_cache(slot), True


class Leases:
    """An engine's lent slots (Engine.new_lease): the rows holding one, and which."""

    def __init__(self) -> None:
        self.held: dict[Row, int] = {}

    def __len__(self) -> int:
        return len(self.held)

    @property
    def to_release(self) -> bool:
        """Whether a holder was cancelled (its slot goes back at the engine's next step)."""
        return any(row.dropped for row in self.held)

    def grant(self, join: list[Row], pool: SlotPool) -> list[Row]:
        """A slot to each lease among the joining rows; returns the others."""
        for row in join:
            if row.lease is not None:
                self.held[row] = slot = pool.take()
                row.lease.grant(pool, slot)
        return [row for row in join if row.lease is None]

    def release_dropped(self, pool: SlotPool) -> None:
        if not self.held:
            return
        for row in [r for r in self.held if r.dropped]:
            pool.release(self.held.pop(row))
            row.lease.cache = None

    def take_back(self) -> list[Row]:
        """Every holder, its slot taken back (the engine's reset frees the slots): its search fails
        at its next step."""
        rows, self.held = list(self.held), {}
        for row in rows:
            row.lease.cache = None
        return rows


@dataclass(eq=False)
class Row:
    """One sequence being generated (one sample of one prompt), one beam slot of a prompt's beam
    search (beam: its group, gpt2kit.engine.beam_rows; no sampler), or a slot lent to a search that
    runs its own forwards (lease). Made by Engine.new_row, Engine.new_beam_rows or Engine.new_lease."""

    prompt: list[int]
    settings: SamplingSettings
    sampler: RowSampler | None
    text: RowText | None = None  # with a tokenizer
    logprobs: int | None = None  # report each token's log-prob and the top N alternatives; None: no
    key: RowKey = field(default_factory=RowKey)  # the caller's label
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error", once finished
    error: Exception | None = None  # why it failed (finish_reason "error")
    cancelled: bool = False
    start: int = 0  # the context is (prompt + tokens)[start:]
    drafted: int = 0  # speculative decoding: draft tokens proposed for this row, and those kept
    accepted: int = 0
    beam: RowGroup | None = None  # beam search: the group this slot belongs to
    lease: SlotLease | None = None  # a slot held for a search's own forwards (Engine.new_lease): never fed
    edits: RowEdits | None = None  # interventions applied to its forwards
    adapter: int = -1  # the LoRA adapter it runs (its index in model.adapter_bank), -1 the base
    speculate: bool = False  # it drafts and verifies several tokens a step (gpt2kit.engine.speculate)

    @property
    def dropped(self) -> bool:
        """Cancelled, or one of its beam group's rows is (a group runs whole or not at all)."""
        return self.cancelled or (self.beam is not None and self.beam.cancelled)

    def context(self, n_ctx: int, window: int) -> list[int]:
        """The tokens the model sees: the whole sequence, or once it passes n_ctx its most recent
        `window` tokens (from then on the window start only moves when the context fills again)."""
        seq = self.prompt + self.tokens
        if len(seq) - self.start > n_ctx:
            self.start = len(seq) - window
        return seq[self.start:]


@dataclass(frozen=True)
class RowEvent:
    """What one row did in one step: the token it added, the text that token made safe to emit
    ('' without a tokenizer), and with Row.logprobs its log-prob and the top N (id, log-prob)
    alternatives, all under the model's raw distribution (log_softmax of the logits, before any
    warper). finish_reason is set on the row's last event. A failed row's event (RowEvent.failed:
    its own sampling raised, or the whole step did) has finish_reason "error", token -1 and the
    exception in error. A beam group ends with one event, on its lead row: token -1, beams its
    returned sequences, best first (its rows give no event before); the one event shape for every
    outcome."""

    row: Row
    token: int
    text: str
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    error: BaseException | None = None
    beams: tuple[Beam, ...] | None = None

    @classmethod
    def failed(cls, row: Row, error: BaseException) -> RowEvent:
        return cls(row, -1, "", "error", error=error)


@runtime_checkable
class EngineInterface(Protocol):
    """What a caller of an engine types against (gpt2kit.engine.EngineLoop, the server,
    gpt2kit.generation): rows are made by the engine that runs them, queued with submit, and stepped;
    step returns one RowEvent per token a row gained (several for one row in a speculative step), a
    row that fails alone an event of its own. Only the new_* methods, submit and cancel may be called
    from another thread than the one stepping. Engine (scheduler.py) is the engine, its speculating
    rows among the others (speculate.py)."""

    max_batch: int | None  # rows holding a slot at once (None: as many as wait)

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, *, seed: int | None = None,
                sample_index: int = 0, logprobs: int | None = None, key: RowKey | None = None) -> Row: ...

    def new_beam_rows(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None
                      ) -> list[Row]: ...

    def new_lease(self, prompt: Sequence[int], settings: SamplingSettings, *, key: RowKey | None = None) -> Row: ...

    def submit(self, rows: Sequence[Row]) -> None: ...

    def cancel(self, row: Row) -> None: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def n_running(self) -> int: ...

    @property
    def n_waiting(self) -> int: ...

    def step(self) -> list[RowEvent]: ...

    def reset(self) -> list[Row]:
        """Drop every row, running and waiting; returns them (after an error, to fail them)."""
        ...


def fail(rows: list[Row], error: BaseException) -> list[RowEvent]:
    """Rows that end with error (finish_reason "error"), one RowEvent.failed each: rows an engine
    drops because its step or their admission raised, so that no caller waits on them."""
    for row in rows:
        row.finish_reason, row.error = "error", error
    return [RowEvent.failed(row, error) for row in rows]


def edited(model, rows: list[Row | None], prompt: torch.Tensor) -> contextlib.AbstractContextManager | None:
    """The hooks of a forward over rows (None: a slot riding along) whose tokens are prompt tokens where
    prompt (B, T) says; None when no row carries edits (the forward may then run on any kernel set)."""
    edits = [None if r is None else r.edits for r in rows]
    first = next((e for e in edits if e is not None), None)
    return None if first is None else first.hooks(model, edits, prompt)


@contextlib.contextmanager
def requeued_on_error(waiting: deque[Row], lock: threading.Lock, rows: list[Row]) -> Iterator[None]:
    """Rows an engine took off the front of waiting go back there, in order, if the block raises
    (admission could not be had): the engine's reset() then fails them with the rest."""
    try:
        yield
    except BaseException:
        with lock:
            waiting.extendleft(reversed(rows))
        raise
