"""Beam search and contrastive search on /v1/completions (extensions, docs/serving.md): which
method a request asks for, the checks that are theirs (400s naming the field), their rows or job,
and their choices.

- Beam search, under vLLM's names: ``use_beam_search``, ``length_penalty``, ``early_stopping``;
  the beam width is ``best_of``, default ``n``, and the ``n`` best beams are the choices (vLLM's
  legacy OpenAI server mapped them so; today's vLLM takes ``n`` for both, which is the same request
  when best_of is absent). Each prompt's beams are rows of the server's one engine
  (gpt2kit.engine.beam_rows): they run in the same decode steps as every other request's rows and
  leave their tokens alone.
- Contrastive search, under transformers' names: ``penalty_alpha`` > 0 with ``top_k`` > 1. Each
  prompt holds one slot of the engine's cache (a lease, Engine.new_lease: it waits for a free slot
  as any row does, and counts as one row); the search runs its own forwards in it (the top_k
  candidates as top_k tokens of one forward, gpt2kit.engine.contrastive) on the engine's worker
  thread, one step per engine step (EngineLoop.call_steps), so other requests go on meanwhile.

A search's width (beams per prompt, or contrastive candidates) is at most :func:`width_limit`:
half of max_batch (and MAX_BEAMS), so that a prompt's beams, which run at once, leave room for
other rows, and a contrastive step costs no more than a decode step of that many rows.

Both are deterministic and known only at the end: stream and logprobs are refused.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpt2kit.sampling import MAX_BEAMS
from gpt2kit.serve.errors import APIError

if TYPE_CHECKING:
    import concurrent.futures

    import gpt2kit.serve.schemas as S
    from gpt2kit.engine import Row, RowEvent
    from gpt2kit.sampling import SamplingSettings
    from gpt2kit.serve.job import Job
    from gpt2kit.serve.response import Response
    from gpt2kit.serve.server import Server

log = logging.getLogger("gpt2kit.serve")

BEAM, CONTRASTIVE = "beam search (use_beam_search)", "contrastive search (penalty_alpha)"


@dataclass(frozen=True)
class SearchDone:
    """A contrastive search job's end, put on its request's queue."""

    future: concurrent.futures.Future


def method(body: S.CompletionRequest) -> str | None:
    """BEAM, CONTRASTIVE or None; a search field sent without its search is a 400."""
    beam = bool(body.use_beam_search)
    alpha = body.penalty_alpha or 0.0
    if not beam:
        for name, value, off in (("length_penalty", body.length_penalty, 1.0),
                                 ("early_stopping", body.early_stopping, False)):
            if value is not None and (value is not off if isinstance(off, bool) else value != off):
                raise APIError(400, f"{name} applies to beam search only: send use_beam_search: true, or drop "
                                    f"{name}", param=name)
    if alpha > 0 and beam:
        raise APIError(400, "use_beam_search and penalty_alpha are two decoding methods: choose one",
                       param="penalty_alpha")
    if alpha > 0 and (body.top_k or 0) <= 1:
        raise APIError(400, f"contrastive search (penalty_alpha={alpha:g}) chooses among top_k > 1 candidates, got "
                            f"top_k={body.top_k}", param="top_k")
    return BEAM if beam else CONTRASTIVE if alpha > 0 else None


def width_limit(max_batch: int) -> int:
    """The widest search (beams, or contrastive candidates, per prompt) a server of max_batch runs."""
    return min(MAX_BEAMS, max(1, max_batch // 2))


def check(server: Server, body: S.CompletionRequest, kind: str, n: int, best_of: int) -> int:
    """The checks a search adds (400s naming the field); returns its rows per prompt."""
    if body.stream:
        raise APIError(400, f"stream is not defined for {kind}: the result is known only at the end; drop stream",
                       param="stream")
    if body.logprobs is not None:
        raise APIError(400, f"logprobs are not reported for {kind}; drop logprobs", param="logprobs")
    width, max_batch = width_limit(server.opts.max_batch), server.opts.max_batch
    why = f"half of --max-batch {max_batch}, so that other rows run beside it, and at most {MAX_BEAMS}"
    if kind == CONTRASTIVE:
        if best_of > 1:
            raise APIError(400, f"{kind} is deterministic: n and best_of must be 1, got {best_of}",
                           param="best_of" if body.best_of else "n")
        if body.top_k > width:
            raise APIError(400, f"{kind} over top_k={body.top_k} candidates: this server compares at most {width} "
                                f"({why}" + ("; contrastive search needs --max-batch >= 4)" if width < 2 else ")"),
                           param="top_k")
        return 1  # one slot per prompt
    if best_of > width:
        raise APIError(400, f"{kind} with {best_of} beams: this server runs at most {width} per prompt ({why})",
                       param="best_of" if body.best_of else "n")
    return best_of


def settings_fields(body: S.CompletionRequest, kind: str | None, n: int, best_of: int) -> dict:
    """The SamplingSettings fields of the search."""
    if kind == BEAM:
        return dict(num_beams=best_of, num_return_sequences=n,
                    length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
                    early_stopping=False if body.early_stopping is None else body.early_stopping)
    if kind == CONTRASTIVE:
        return dict(penalty_alpha=body.penalty_alpha)
    return {}


def method_name(kind: str | None, settings: SamplingSettings) -> str | None:
    """The method named in the library's checks (gpt2kit.engine.checks) when the request chose it
    and the settings cannot say so (a beam width of 1 is no beam search there)."""
    return f"beam search (use_beam_search, {settings.num_beams} beams)" if kind == BEAM else None


def submit(server: Server, job: Job, kind: str, settings: SamplingSettings, rows: int, adapter: int = -1) -> None:
    """Start the search: beam groups as engine rows (running LoRA adapter `adapter`; -1 the base), or
    the contrastive job on the worker."""
    from gpt2kit.engine import RowKey

    loop = server.engine_loop
    server.outstanding += rows
    if kind == BEAM:
        for i, p in enumerate(job.prompts):
            job.rows += loop.new_beam_rows(p, settings, key=RowKey(i, i, 0, owner=job))
        for row in job.rows:
            row.adapter = adapter
        job.pending = set(job.rows)
        loop.submit(job.rows)
        return
    job.rows = [loop.new_lease(p, settings, key=RowKey(i, i, 0, owner=job)) for i, p in enumerate(job.prompts)]
    job.side_rows = rows
    loop.submit(job.rows)
    job.side = loop.call_steps(_contrastive(server.model, job.rows, settings))
    aloop = server.aloop
    job.side.add_done_callback(lambda f: aloop.call_soon_threadsafe(job.queue.put_nowait, SearchDone(f)))


def _contrastive(model, rows: list[Row], settings: SamplingSettings):
    """contrastive_in_slots, its result as one Beam (score None) per prompt."""
    from gpt2kit.engine.beam import Beam
    from gpt2kit.engine.contrastive import contrastive_in_slots

    found = yield from contrastive_in_slots(model, rows, settings)
    stops = settings.stop_token_ids
    return [[Beam(t, None, "stop" if t and t[-1] in stops else "length")] for t in found]


def record(server: Server, job: Job, ev: RowEvent | SearchDone) -> None:
    """A search's result: a beam group's event (its rows leave) or the contrastive job's end (500
    if it failed)."""
    if isinstance(ev, SearchDone):
        release(server, job)
        if ev.future.cancelled():
            return
        if ev.future.exception() is not None:
            log.error("contrastive search failed: %s", type(ev.future.exception()).__name__)
            raise APIError(500, "generation failed", code="internal_error")
        new = dict(enumerate(ev.future.result()))
    else:
        new = {ev.row.key.prompt_index: list(ev.beams)}
        for row in ev.row.beam.rows:
            if row in job.pending:
                job.pending.discard(row)
                server.outstanding -= 1
    job.found.update(new)
    if not job.first_token:
        job.first_token = True
        server.metrics.ttft.observe(time.monotonic() - job.arrived)
    server.metrics.generation_tokens.inc(sum(len(b.tokens) for beams in new.values() for b in beams))


def release(server: Server, job: Job) -> None:
    """Cancel a contrastive job still running (it stops before its next step; first, so that it
    never steps in a slot given back) and its slots' rows (the engine frees them at its next step)."""
    if job.side is not None:
        job.side.cancel()
        job.side = None
    if job.side_rows:
        for row in job.rows:
            server.engine_loop.cancel(row)
    server.outstanding -= job.side_rows
    job.side_rows = 0


def choices(job: Job, out: Response, tokenizer) -> list[dict]:
    """The n best beams of each prompt (contrastive: its one sequence), in beam order."""
    found = []
    for i in range(len(job.prompts)):
        for rank, b in enumerate(job.found[i][:job.n]):
            text, _ = out.begin((i, rank), i)
            c = {"text": text + b.text(tokenizer), "index": i * job.n + rank, "logprobs": None,
                 "finish_reason": b.finish_reason}
            if b.score is not None:
                c["score"] = b.score
            found.append(c)
    return found
