"""/v1/completions: planning a request (checks, rows, admission), accounting for its rows' events
(rows, work tokens, latency metrics) and answering it, whole or as server-sent events, with one
builder for both (serve/response.py); the request's state is serve/job.py's Job.

A request whose client goes away has its rows cancelled, and the engine drops them at its next
step. Admission is bounded: at most max_batch rows run and max_queue wait; a request that would
exceed that gets 429 with Retry-After, and one over its share (half of that, gpt2kit.serve.limits)
a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import gpt2kit.serve.schemas as S
import gpt2kit.serve.search as search
from gpt2kit.sampling import EOT_ID, SamplingSettings
from gpt2kit.serve.errors import APIError, error_body
from gpt2kit.serve.interventions import edits_for
from gpt2kit.serve.job import Choice, Job
from gpt2kit.serve.lifecycle import DISCONNECTED, SHUTDOWN
from gpt2kit.serve.limits import check_work, logit_bias_ids, request_share, work_tokens
from gpt2kit.serve.logprobs import prompt_logprobs
from gpt2kit.serve.response import Response, choice_obj, usage

if TYPE_CHECKING:
    from fastapi import Request

    from gpt2kit.config import GPT2Config
    from gpt2kit.engine import RowEvent
    from gpt2kit.serve.server import Server

log = logging.getLogger("gpt2kit.serve")


# --- planning ---------------------------------------------------------------------------------


def plan(server: Server, body: S.CompletionRequest, more_stops: tuple[str, ...] = ()) -> Job:
    """Check a request against the model and the limits (400/404/429 name what is wrong), then
    submit its rows. more_stops: stop strings besides the request's own (a chat template's turn marker)."""
    from gpt2kit.engine import RowKey
    from gpt2kit.sampling.sampler import resolve_seed

    adapter = server.check_model(body.model)
    cfg = server.model.config
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported: GPT-2 only continues text", param="suffix")
    prompts, texts = _prompts(server, body.prompt)
    echo = bool(body.echo)
    n = body.n or 1
    best_of = body.best_of or n
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    kind = search.method(body)  # beam or contrastive search, or None
    edits = edits_for(server, body)
    if edits is not None and (kind or (echo and body.logprobs is not None)):
        raise APIError(400, "interventions apply to sampled or greedy rows, not to beam or contrastive search nor to "
                            "echoed prompt log-probs", param="interventions")
    if adapter >= 0:
        _check_adapter_request(body, kind)
    per_prompt = search.check(server, body, kind, n, best_of) if kind else best_of  # rows per prompt
    if not kind and body.stream and best_of > n:
        raise APIError(400, "best_of cannot be streamed: drop stream or best_of", param="best_of")
    longest = max(map(len, prompts))
    max_tokens = body.max_tokens if body.max_tokens is not None else max(cfg.n_ctx - longest, 0)
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens 0 is only allowed with echo (prompt log-probs)", param="max_tokens")
    cap = server.opts.max_tokens_per_request
    if cap is not None and max_tokens > cap:
        raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit {cap}", param="max_tokens")
    if longest + max_tokens > cfg.n_ctx:
        raise APIError(400, f"This model's maximum context length is {cfg.n_ctx} tokens, however you requested "
                            f"{longest + max_tokens} tokens ({longest} in your prompt; {max_tokens} for the "
                            f"completion). Please reduce your prompt or completion length.",
                       param="max_tokens", code="context_length_exceeded")
    # beam and contrastive search take no stop strings: a template's turn marker is not theirs
    settings = _settings(body, max_tokens, cfg, server.tokenizer, kind, n, best_of, () if kind else more_stops,
                         [len(p) for p in prompts] if max_tokens > 0 else [])  # no rows: echo scoring only
    rows = len(prompts) * per_prompt if max_tokens > 0 else 0
    limit = server.opts.max_batch + server.opts.max_queue
    share = request_share(limit)
    if rows > share:
        param = "prompt" if per_prompt == 1 else "best_of" if body.best_of else "n"
        raise APIError(400, f"this request needs {rows} rows ({len(prompts)} prompts x {per_prompt}); one request "
                            f"may hold at most {share}, half of this server's {limit} (--max-batch + --max-queue)",
                       param=param)
    scored = sum(map(len, prompts)) if echo and body.logprobs is not None else 0
    work = work_tokens(prompts, max_tokens, per_prompt, bool(scored))
    check_work(work, server.work_tokens, limit * cfg.n_ctx, share * cfg.n_ctx)  # scoring counts as generation does
    if rows and server.outstanding + rows > limit:
        raise APIError(429, f"the server is at capacity ({server.outstanding} rows running or queued, limit "
                            f"{limit}); retry shortly", code="server_overloaded", headers={"Retry-After": "1"})
    job = Job(f"cmpl-{uuid.uuid4().hex}", int(time.time()), time.monotonic(), prompts, texts, body, n, best_of,
              asyncio.Queue(), work=work, scoring=scored)
    server.work_tokens += work
    server.metrics.scoring_tokens.inc(scored)
    server.metrics.prompt_tokens.inc(sum(map(len, prompts)))
    if rows and kind:
        search.submit(server, job, kind, settings, rows, adapter)
    elif rows:
        seed = resolve_seed(settings)
        want = body.logprobs if body.logprobs is not None else (0 if best_of > n else None)
        loop = server.engine_loop
        for i, p in enumerate(prompts):
            for j in range(best_of):
                row = loop.new_row(p, settings, seed=seed, sample_index=j, logprobs=want,
                                   key=RowKey(i * best_of + j, i, j, owner=job), edits=edits)
                row.adapter = adapter
                job.rows.append(row)
                job.choices[row] = Choice(i, j)
        job.pending = set(job.rows)
        server.outstanding += rows
        loop.submit(job.rows)
    return job


def _check_adapter_request(body: S.CompletionRequest, kind: str | None) -> None:
    """What a LoRA adapter's rows do not run: their own forwards outside the engine's batch."""
    if kind == search.CONTRASTIVE:
        raise APIError(400, f"{kind} is not served for a LoRA adapter; it runs on the base model",
                       param="penalty_alpha")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs (prompt log-probs) is not served for a LoRA adapter; it runs on the "
                            "base model", param="echo")


def _settings(body: S.CompletionRequest, max_tokens: int, cfg: GPT2Config, tokenizer, kind: str | None, n: int,
              best_of: int, more_stops: tuple[str, ...], prompt_lens: list[int]):
    """The request's SamplingSettings (with kind: its search's), checked as the library checks them
    (gpt2kit.engine.checks); a value refused is a 400."""
    from gpt2kit.engine.checks import check_request  # the engine (torch) loads with the model, not before

    n_vocab = cfg.n_vocab
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    bias = logit_bias_ids(body.logit_bias, n_vocab)
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        settings = SamplingSettings(
            max_new_tokens=max(max_tokens, 1), temperature=temperature,
            top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
            top_p_mode=body.top_p_mode or "openai",
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=bias, seed=None if body.seed is None else body.seed % 2**63,
            stop_token_ids=(EOT_ID,) if EOT_ID < n_vocab and not body.ignore_eos else (),
            stop_strings=tuple(dict.fromkeys([*stops, *more_stops])), strict=True,
            **body.warper_settings(tokenizer, n_vocab, max_tokens), **search.settings_fields(body, kind, n, best_of))
        check_request(prompt_lens, settings, n_ctx=cfg.n_ctx, n_vocab=n_vocab, tokenizer=tokenizer is not None,
                      method=search.method_name(kind, settings))
        if settings.structured is not None:  # compiled here, so a grammar the vocabulary refuses is a 400
            from gpt2kit.sampling.structured import matcher_factory

            matcher_factory(tokenizer).check(settings.structured)
        return settings
    except ValueError as e:
        raise APIError(400, str(e), param=_param(e, body)) from None
    except ImportError as e:  # the structured extra is not installed
        raise APIError(400, f"this server cannot constrain outputs: {e}",
                       param="response_format" if body.response_format else "structured_outputs") from None


# SamplingSettings' names of the request's fields where the two differ
_FIELDS = {"stop_strings": "stop", "min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens",
           "num_samples": "n", "num_return_sequences": "n"}


def _param(e: ValueError, body: S.CompletionRequest) -> str | None:
    """The request field a SamplingSettings refusal is about (validate.SettingError names its
    setting, e.g. "stop_strings" or "logit_bias[5]"), or None."""
    name = getattr(e, "name", None)
    if name is None:
        return None
    if name == "num_beams":
        return "best_of" if body.best_of else "n"
    if name == "structured":
        return "response_format" if body.response_format is not None else "structured_outputs"
    name = _FIELDS.get(name, name.split()[0].split("[")[0])
    return name if name in type(body).model_fields else None


def _prompts(server: Server, prompt) -> tuple[list[list[int]], list[str]]:
    tok, n_vocab = server.tokenizer, server.model.config.n_vocab
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            t = tok.encode(p, allow_special=True) if p else [tok.eot_token]
            texts.append(p if p else tok.eot_text)
        else:
            t = list(p)
            bad = [x for x in t if x >= min(n_vocab, tok.n_vocab)]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                    f"[0, {min(n_vocab, tok.n_vocab)})", param="prompt")
            texts.append(tok.decode(t))
        if any(x >= n_vocab for x in t):
            raise APIError(400, f"the prompt has a token id >= the model's vocabulary {n_vocab}", param="prompt")
        ids.append(t)
    return ids, texts


# --- accounting -------------------------------------------------------------------------------


def cancel(server: Server, job: Job, why: str | None = None) -> None:
    """Drop the job's unfinished rows (the engine leaves them at its next step) and release its
    work; why: logged as one line when rows were still running."""
    if job.watcher is not None:
        job.watcher.cancel()
    if why is not None and job.pending:
        log.info("%s: %s; cancelled %d unfinished row(s)", job.id, why, len(job.pending))
    for row in job.pending:
        server.engine_loop.cancel(row)
    server.outstanding -= len(job.pending)
    job.pending = set()
    search.release(server, job)
    server.work_tokens -= job.work
    server.metrics.scoring_tokens.dec(job.scoring)
    job.work = job.scoring = 0


async def next_event(server: Server, job: Job, request: Request) -> RowEvent:
    """The job's next row event; cancels the job and raises APIError if the client went away
    (noticed at once: a watcher waits on the connection), the shutdown grace ran out or the
    row failed."""
    if job.watcher is None:
        job.watcher = server.life.watch(request.receive, job.queue)
    ev = await job.queue.get()
    if ev is DISCONNECTED:
        cancel(server, job, "client disconnected")
        raise APIError(499, "the client disconnected", code="client_disconnected")  # sent to no one
    if ev is SHUTDOWN:
        cancel(server, job, "the server's shutdown grace ran out")
        raise APIError(503, "the server shut down before this request finished (its --shutdown-grace ran "
                            "out); retry", code="server_shutting_down")
    if isinstance(ev, search.SearchDone) or (ev.error is None and ev.beams is not None):
        try:
            search.record(server, job, ev)
        except APIError:
            cancel(server, job)
            raise
        return ev
    if ev.error is not None:  # a failed step (RowEvent.failed)
        cancel(server, job)
        raise APIError(500, "generation failed", code="internal_error")
    _account(server, job, ev)
    return ev


def _account(server: Server, job: Job, ev: RowEvent) -> None:
    now = time.monotonic()
    c = job.choices[ev.row]
    if not job.first_token:
        job.first_token = True
        server.metrics.ttft.observe(now - job.arrived)
    elif c.last:
        server.metrics.tpot.observe(now - c.last)
    c.last = now
    server.metrics.generation_tokens.inc()
    c.tokens.append(ev.token)
    c.text += ev.text
    if ev.logprob is not None:
        c.logprobs.append(ev.logprob)
        c.tops.append(ev.top_logprobs)
    if ev.finish_reason is not None:
        c.finish_reason = ev.finish_reason
        if ev.row in job.pending:
            job.pending.discard(ev.row)
            server.outstanding -= 1


async def echo_logprobs(server: Server, job: Job, request: Request) -> list[tuple[list, list]] | None:
    """The prompts' log-probs for echo, scored one prompt per worker job (between decode steps);
    a client gone stops it before the next prompt."""
    if not job.body.echo or job.body.logprobs is None:
        return None
    out = []
    for p in job.prompts:
        if await request.is_disconnected():
            cancel(server, job)
            raise asyncio.CancelledError
        out.append(await server.run_in_worker(prompt_logprobs, server.model, p, job.body.logprobs,
                                              server.prefix_cache))
        job.scoring -= len(p)
        job.work -= len(p)
        server.work_tokens -= len(p)
        server.metrics.scoring_tokens.dec(len(p))
        server.metrics.scored_tokens.inc(len(p))
    return out


async def complete(server: Server, job: Job, request: Request) -> dict:
    try:
        prompt_lp = await echo_logprobs(server, job, request)
        while job.pending or job.side is not None:
            await next_event(server, job, request)
    finally:
        cancel(server, job)
    out = Response(server.tokenizer, job, prompt_lp)
    choices = search.choices(job, out, server.tokenizer) if job.found else _choices(job, out)
    # system_fingerprint named, so that the route's exclude_unset drops only the choices' unset score
    return {**out.envelope(choices), "usage": usage(job), "system_fingerprint": None}


def _choices(job: Job, out: Response) -> list[dict]:
    """Each prompt's n choices: its rows, or with best_of the n of highest mean log-prob."""
    choices = []
    for i in range(len(job.prompts)):
        mine = [c for c in job.choices.values() if c.prompt_index == i]
        if job.best_of > job.n:
            mine = sorted(mine, key=lambda c: -c.mean_logprob())[: job.n]
        if not mine:  # max_tokens 0 with echo: the prompt alone
            mine = [Choice(i, j, finish_reason="length") for j in range(job.n)]
        for rank, c in enumerate(mine):
            text, lp = out.begin(c, i)
            lp = out.tokens(c, c.tokens, c.logprobs, c.tops, lp)
            choices.append(choice_obj(text + c.text, i * job.n + rank, lp, c.finish_reason))
    return choices


async def stream(server: Server, job: Job, request: Request) -> AsyncIterator[str]:
    """The completion as server-sent events: each chunk (stream_objects), then `data: [DONE]`."""
    async with contextlib.aclosing(stream_objects(server, job, request)) as objects:
        async for obj in objects:
            yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def stream_objects(server: Server, job: Job, request: Request) -> AsyncIterator[dict]:
    """The streamed completion's chunks (`text_completion` objects) as they come; an error ends them
    with an error body (the stream then ends as every stream does). Chat streams these too."""
    body = job.body
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(out: Response, choices: list[dict], usage: dict | None = None) -> dict:
        obj = out.envelope(choices)
        if include_usage:
            obj["usage"] = usage
        return obj

    try:
        out = Response(server.tokenizer, job, await echo_logprobs(server, job, request))
        for i in range(len(job.prompts)):
            for j in range(job.n):
                text, lp = out.begin((i, j), i)
                if body.echo:
                    yield chunk(out, [choice_obj(text, i * job.n + j, lp, None if job.rows else "length")])
        while job.pending:
            ev = await next_event(server, job, request)
            c = job.choices[ev.row]
            lp = out.tokens((c.prompt_index, c.sample_index), [ev.token], [ev.logprob], [ev.top_logprobs])
            if ev.text or lp is not None or ev.finish_reason:
                yield chunk(out, [choice_obj(ev.text, c.prompt_index * job.n + c.sample_index, lp, ev.finish_reason)])
        if include_usage:
            yield chunk(out, [], usage(job))
    except APIError as e:
        yield error_body(e.status, e.message, e.param, e.code)
    except asyncio.CancelledError:  # Starlette saw the client leave (or uvicorn gave up at shutdown)
        cancel(server, job, "stream cancelled (client gone, or the server stopping)")
        raise
    finally:
        cancel(server, job)
