"""A server's engine with speculative decoding: the plain engine (gpt2kit.engine.scheduler) and a
speculative one (gpt2kit.engine.speculative) behind the engine's interface
(gpt2kit.engine.rows.EngineInterface), each row sent to one.

Eligible rows — greedy ones, not beams, leased slots nor rows with interventions (so every response
is exactly what the plain engine gives; sampled rows keep their seeded tokens there) whose prompt + max_new_tokens +
draft tokens fit in the context (the speculative engine keeps the whole sequence) — speculate; the
rest run as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpt2kit.engine.rows import fail

if TYPE_CHECKING:
    from gpt2kit.engine.rows import EngineInterface, Row, RowEvent
    from gpt2kit.engine.scheduler import Engine
    from gpt2kit.engine.speculative import SpeculativeEngine


class RoutedEngine:
    """The engine's interface over a plain and a speculative engine; k: the draft tokens per step."""

    def __init__(self, plain: Engine, spec: SpeculativeEngine, k: int) -> None:
        self.plain, self.spec, self.k = plain, spec, k
        self.max_batch = plain.max_batch  # each engine's own; the loop gathers arrivals up to one full batch
        self.n_ctx = plain.model.config.n_ctx

    def eligible(self, row: Row) -> bool:
        s = row.settings
        return (row.beam is None and row.lease is None and row.edits is None and s.greedy
                and len(row.prompt) + s.max_new_tokens + self.k <= self.n_ctx)

    def new_row(self, *args, **kw) -> Row:
        return self.plain.new_row(*args, **kw)

    def new_beam_rows(self, *args, **kw) -> list[Row]:
        return self.plain.new_beam_rows(*args, **kw)  # beams run on the plain engine

    def new_lease(self, *args, **kw) -> Row:
        return self.plain.new_lease(*args, **kw)  # and leases are its slots

    def submit(self, rows: Sequence[Row]) -> None:
        self.spec.submit([r for r in rows if self.eligible(r)])
        self.plain.submit([r for r in rows if not self.eligible(r)])

    def cancel(self, row: Row) -> None:
        row.cancelled = True  # both engines drop a cancelled row at their next step

    @property
    def has_work(self) -> bool:
        return self.plain.has_work or self.spec.has_work

    @property
    def n_running(self) -> int:
        return self.plain.n_running + self.spec.n_running

    @property
    def n_waiting(self) -> int:
        return self.plain.n_waiting + self.spec.n_waiting

    def step(self) -> list[RowEvent]:
        """Both engines' steps; one that raises fails its own rows (an event each), never the other's,
        and the other's events of this step are kept."""
        return _step_alone(self.plain) + _step_alone(self.spec)

    def reset(self) -> list[Row]:
        return self.plain.reset() + self.spec.reset()


def _step_alone(engine: EngineInterface) -> list[RowEvent]:
    """engine's step, or when it raises every row it held, failed (engine.reset())."""
    if not engine.has_work:
        return []
    try:
        return engine.step()
    except Exception as e:  # this engine's rows fail; the caller goes on serving
        return fail(engine.reset(), e)


def serve_engine(model, tokenizer, *, max_batch: int | None, pack_weights: bool | None,
                 draft_model: str | None = None, draft_tokens: int = 4, prompt_lookup: int = 0,
                 prefill_chunk: int | None = None, prefill_idle_budget: int | None = None,
                 prefix_cache=None) -> EngineInterface:
    """The server's engine: the plain Engine (its prefill_chunk, default the engine's, and
    prefill_idle_budget; prefix_cache: where its rows' prompts start from, gpt2kit.prefix_cache), or with
    draft_model (a checkpoint name, loaded like the model, refused unless it shares the model's
    tokenizer) or prompt_lookup a RoutedEngine."""
    from gpt2kit.engine.scheduler import DEFAULT_PREFILL_CHUNK, Engine
    from gpt2kit.engine.speculative import SpeculativeEngine, check_draft_model

    plain = Engine(model, tokenizer, max_batch=max_batch, pack_weights=pack_weights,
                   prefill_chunk=prefill_chunk or DEFAULT_PREFILL_CHUNK, prefill_idle_budget=prefill_idle_budget,
                   prefix_cache=prefix_cache)
    if max_batch is not None:
        plain.reserve()  # its slots now: a cache that cannot be had fails the start-up, not a request
    plain.kernels.warm_up()  # its kernel choices and packed copy before the server answers ready, not in a request
    if draft_model is None and not prompt_lookup:
        return plain
    draft = None
    if draft_model is not None:
        from gpt2kit.checkpoint import load_model, load_tokenizer

        if tokenizer is not None and not load_tokenizer(draft_model).same_vocabulary(tokenizer):
            raise ValueError(f"the draft model {draft_model} has another tokenizer than the model: a draft model "
                             f"must share the target's vocabulary")
        w = model.wpe.weight
        draft = load_model(draft_model, dtype=w.dtype, device=w.device)
        check_draft_model(model, draft, draft_model)  # the server refuses to start, naming the draft
    spec = SpeculativeEngine(model, tokenizer, draft=draft, max_batch=max_batch, pack_weights=pack_weights,
                             lookup=prompt_lookup or None)
    return RoutedEngine(plain, spec, draft_tokens if draft is not None else prompt_lookup)
