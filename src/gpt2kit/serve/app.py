"""The HTTP layer: FastAPI routes over gpt2kit.generate's engine (run by an EngineLoop in a worker
thread, so the event loop never waits on the model) and gpt2kit.score.

Every row of every request joins the one running batch at the next decode step and leaves it when
it finishes (continuous batching); a request whose client goes away has its rows cancelled, and
the engine drops them at its next step. Admission is bounded: at most max_batch rows run and
max_queue wait; a request that would exceed that gets 429 with Retry-After.

Log-probs are the model's raw distribution (log_softmax of the float32 logits, before temperature,
penalties, bias or top-k/p). Tokens in `logprobs.tokens` and keys of `top_logprobs` are the token's
text when its bytes are valid UTF-8 alone, else ``bytes:\\xNN...`` (OpenAI's convention); should two
ids still share a key in one top_logprobs dict, the later is keyed ``token_id:N`` (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, StreamingResponse

import gpt2kit.serve.schemas as S
from gpt2kit.serve.errors import APIError, error_body, install
from gpt2kit.serve.gate import Gate
from gpt2kit.serve.lifecycle import DISCONNECTED, SHUTDOWN, Lifecycle
from gpt2kit.serve.limits import check_work, logit_bias_ids, work_tokens
from gpt2kit.serve.metrics import Metrics

if TYPE_CHECKING:
    from gpt2kit.generate import Row, RowEvent
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer

log = logging.getLogger("gpt2kit.serve")

_ERRORS = {s: {"model": S.ErrorResponse, "description": d} for s, d in (
    (400, "bad request (param names the field)"), (401, "missing or wrong API key"),
    (404, "unknown model"), (413, "body too large"), (429, "overloaded (see Retry-After)"),
    (503, "the model is loading"))}
# Each server-sent event: `data: {chunk JSON}`, the last one `data: [DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_STREAM_200 = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}},
                     "description": "the completion, or with stream: server-sent events"}}
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
              "/detokenize")


@dataclass
class ServeOptions:
    served_model_name: str = "gpt2"
    max_batch: int = 8
    max_queue: int = 64
    max_tokens_per_request: int | None = None
    api_key: str | None = None
    chat_template: str | None = None  # the template's text (Jinja2), or None: no chat endpoint
    max_body_bytes: int = 1 << 20
    pack_weights: bool | None = None
    # Connection lifecycle (serve/gate.py, serve/runner.py; docs/serving.md): seconds.
    shutdown_grace: float = 20.0  # after SIGTERM: in-flight requests may finish; then they are ended
    read_timeout: float = 30.0  # for a request's headers, then again for its body
    keep_alive_timeout: float = 5.0  # an idle connection after a response
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the loopback ones; "*": any

    def __post_init__(self) -> None:
        for name, least in (("shutdown_grace", 0.0), ("read_timeout", 1e-3), ("keep_alive_timeout", 1e-3)):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not least <= value < float("inf"):
                raise ValueError(f"ServeOptions.{name} must be a finite number of seconds >= {least:g}, "
                                 f"got {value!r}")
        self.allowed_hosts = tuple(self.allowed_hosts)


# --- per-request state ------------------------------------------------------------------------


@dataclass(eq=False)
class _Choice:
    prompt_index: int
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    last: float = 0.0  # time of the last token (per-token latency)

    def mean_logprob(self) -> float:
        return sum(self.logprobs) / max(len(self.logprobs), 1)


@dataclass(eq=False)
class _Job:
    id: str
    created: int
    arrived: float
    prompts: list[list[int]]
    prompt_texts: list[str]
    body: S.CompletionRequest
    n: int
    best_of: int
    queue: asyncio.Queue
    rows: list[Row] = field(default_factory=list)
    choices: dict[Row, _Choice] = field(default_factory=dict)
    pending: set = field(default_factory=set)
    first_token: bool = False
    watcher: asyncio.Task | None = None  # waits for the client to disconnect (serve/lifecycle.py)
    work: int = 0  # tokens of work it holds against the server's limit (gpt2kit.serve.limits)
    scoring: int = 0  # of which prompt tokens still to score for echo log-probs


class _Offsets:
    """Character offsets of tokens in a text made of their bytes (the decoder replaces bad bytes)."""

    def __init__(self, tokenizer: Tokenizer, start: int = 0) -> None:
        self.tok, self.pos = tokenizer, start
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> int:
        at = self.pos
        with contextlib.suppress(ValueError):
            self.pos += len(self.utf8.decode(self.tok.decode_bytes([token])))
        return at


def token_key(tokenizer: Tokenizer, t: int) -> str:
    """How token t is named in logprobs: its text when its bytes are valid UTF-8 alone, else
    ``bytes:\\xNN...``, and ``token_id:N`` for an id the tokenizer does not know."""
    try:
        b = tokenizer.decode_bytes([t])
    except ValueError:
        return f"token_id:{t}"
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def top_dict(tokenizer: Tokenizer, top) -> dict[str, float]:
    """top_logprobs of one position, (id, log-prob) pairs -> {key: log-prob}; an id whose key is
    already taken is keyed token_id:N, so no alternative is ever lost."""
    out: dict[str, float] = {}
    for t, lp in top:
        k = token_key(tokenizer, t)
        out[f"token_id:{t}" if k in out else k] = lp
    return out


# --- the server -------------------------------------------------------------------------------


class Server:
    """The model, its engine loop and the bookkeeping the routes share (one per app)."""

    def __init__(self, loader: Callable[[], tuple[GPT2, Tokenizer]], opts: ServeOptions) -> None:
        self.loader, self.opts = loader, opts
        self.model: GPT2 | None = None
        self.tokenizer: Tokenizer | None = None
        self.engine_loop = None
        self.ready = False
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.outstanding = 0  # rows admitted and not finished (event-loop thread only)
        self.work_tokens = 0  # tokens of work admitted and not finished (gpt2kit.serve.limits; event loop)
        self.started = int(time.time())
        self.life = Lifecycle()
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.metrics = Metrics(lambda: self.engine_loop.engine.n_running if self.engine_loop else 0,
                               lambda: self.engine_loop.engine.n_waiting if self.engine_loop else 0)
        self.metrics.work_tokens.set_function(lambda: self.work_tokens)

    # -- lifecycle --

    def start(self) -> None:
        self.aloop = asyncio.get_running_loop()
        threading.Thread(target=self._load, name="gpt2kit-load", daemon=True).start()

    def _load(self) -> None:
        from gpt2kit.generate import Engine, EngineLoop

        try:
            model, tokenizer = self.loader()
            model.eval()
            engine = Engine(model, tokenizer, max_batch=self.opts.max_batch, pack_weights=self.opts.pack_weights)
            self.engine_loop = EngineLoop(engine, self._on_events, self._on_error).start()
            self.model, self.tokenizer = model, tokenizer
            self.ready = True
        except Exception as e:  # reported by /health and to the CLI
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error(e)

    def stop(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.stop()

    def require_ready(self) -> None:
        if not self.ready:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            raise APIError(503, "the model is loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})

    # -- engine events (worker thread -> event loop) --

    def _on_events(self, events: list[RowEvent]) -> None:
        self.aloop.call_soon_threadsafe(self._dispatch, events)

    def _on_error(self, rows: list[Row], exc: BaseException) -> None:
        log.error("generation step failed: %s", type(exc).__name__)
        self.aloop.call_soon_threadsafe(self._dispatch, [(row, exc) for row in rows])

    def _dispatch(self, events: list) -> None:
        for ev in events:
            row = ev[0] if isinstance(ev, tuple) else ev.row
            job = row.key[0]
            job.queue.put_nowait(ev)

    # -- helpers --

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.opts.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{self.opts.served_model_name}` (send that name, or start the server with "
                                f"--served-model-name to choose it)", param="model", code="model_not_found")

    def token_key(self, t: int) -> str:
        return token_key(self.tokenizer, t)

    def top_dict(self, top) -> dict[str, float] | None:
        return None if top is None else top_dict(self.tokenizer, top)

    def piece(self, t: int) -> str | list[int]:
        b = self.tokenizer.decode_bytes([t])
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return list(b)

    async def run_in_worker(self, fn, *args):
        return await asyncio.wrap_future(self.engine_loop.call(fn, *args))

    # -- /v1/completions --

    def plan(self, body: S.CompletionRequest) -> _Job:
        """Check a request against the model and the limits; 400/404/429 name what is wrong."""
        from gpt2kit.sampling import EOT_ID, SamplingSettings, resolve_seed

        self.check_model(body.model)
        cfg = self.model.config
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported: GPT-2 only continues text", param="suffix")
        prompts, texts = self._prompts(body.prompt)
        echo = bool(body.echo)
        n = body.n or 1
        best_of = body.best_of or n
        if best_of < n:
            raise APIError(400, f"best_of ({best_of}) must be >= n ({n})", param="best_of")
        if body.stream and best_of > n:
            raise APIError(400, "best_of cannot be streamed: drop stream or best_of", param="best_of")
        longest = max(map(len, prompts))
        max_tokens = body.max_tokens if body.max_tokens is not None else max(cfg.n_ctx - longest, 0)
        if max_tokens == 0 and not echo:
            raise APIError(400, "max_tokens 0 is only allowed with echo (prompt log-probs)", param="max_tokens")
        cap = self.opts.max_tokens_per_request
        if cap is not None and max_tokens > cap:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit {cap}", param="max_tokens")
        if longest + max_tokens > cfg.n_ctx:
            raise APIError(400, f"This model's maximum context length is {cfg.n_ctx} tokens, however you requested "
                                f"{longest + max_tokens} tokens ({longest} in your prompt; {max_tokens} for the "
                                f"completion). Please reduce your prompt or completion length.",
                           param="max_tokens", code="context_length_exceeded")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        bias = logit_bias_ids(body.logit_bias, cfg.n_vocab)
        temperature = 1.0 if body.temperature is None else body.temperature
        try:
            settings = SamplingSettings(
                max_new_tokens=max(max_tokens, 1), temperature=temperature,
                top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                top_p_mode=body.top_p_mode or "openai",
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=bias, seed=None if body.seed is None else body.seed % 2**63,
                stop_token_ids=(EOT_ID,) if EOT_ID < cfg.n_vocab else (), stop_strings=tuple(stops), strict=True)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rows = len(prompts) * best_of if max_tokens > 0 else 0
        limit = self.opts.max_batch + self.opts.max_queue
        if rows > limit:
            raise APIError(400, f"this request needs {rows} rows (prompts x best_of/n); this server runs at most "
                                f"{limit} (--max-batch + --max-queue)", param="n")
        scored = sum(map(len, prompts)) if echo and body.logprobs is not None else 0
        work = work_tokens(prompts, max_tokens, best_of, bool(scored))
        check_work(work, self.work_tokens, limit * cfg.n_ctx)  # scoring counts as generation does
        if rows and self.outstanding + rows > limit:
            raise APIError(429, f"the server is at capacity ({self.outstanding} rows running or queued, limit "
                                f"{limit}); retry shortly", code="server_overloaded", headers={"Retry-After": "1"})
        job = _Job(f"cmpl-{uuid.uuid4().hex}", int(time.time()), time.monotonic(), prompts, texts, body, n, best_of,
                   asyncio.Queue(), work=work, scoring=scored)
        self.work_tokens += work
        self.metrics.scoring_tokens.inc(scored)
        self.metrics.prompt_tokens.inc(sum(map(len, prompts)))
        if rows:
            seed = resolve_seed(settings)
            want = body.logprobs if body.logprobs is not None else (0 if best_of > n else None)
            engine = self.engine_loop.engine
            for i, p in enumerate(prompts):
                for j in range(best_of):
                    row = engine.new_row(p, settings, seed=seed, sample_index=j, logprobs=want, key=(job, i, j))
                    job.rows.append(row)
                    job.choices[row] = _Choice(i, j)
            job.pending = set(job.rows)
            self.outstanding += rows
            self.engine_loop.submit(job.rows)
        return job

    def _prompts(self, prompt) -> tuple[list[list[int]], list[str]]:
        tok, n_vocab = self.tokenizer, self.model.config.n_vocab
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

    def cancel(self, job: _Job, why: str | None = None) -> None:
        """Drop the job's unfinished rows (the engine leaves them at its next step); why: logged
        as one line when rows were still running."""
        if job.watcher is not None:
            job.watcher.cancel()
        if why is not None and job.pending:
            log.info("%s: %s; cancelled %d unfinished row(s)", job.id, why, len(job.pending))
        for row in job.pending:
            self.engine_loop.cancel(row)
        self.outstanding -= len(job.pending)
        job.pending = set()
        self.work_tokens -= job.work
        self.metrics.scoring_tokens.dec(job.scoring)
        job.work = job.scoring = 0

    async def next_event(self, job: _Job, request: Request):
        """The job's next row event; cancels the job and raises APIError if the client went away
        (noticed at once: a watcher waits on the connection) or the shutdown grace ran out."""
        if job.watcher is None:
            job.watcher = self.life.watch(request.receive, job.queue)
        ev = await job.queue.get()
        if ev is DISCONNECTED:
            self.cancel(job, "client disconnected")
            raise APIError(499, "the client disconnected", code="client_disconnected")  # sent to no one
        if ev is SHUTDOWN:
            self.cancel(job, "the server's shutdown grace ran out")
            raise APIError(503, "the server shut down before this request finished (its --shutdown-grace ran "
                                "out); retry", code="server_shutting_down")
        if isinstance(ev, tuple):  # (row, exception) from a failed step
            self.cancel(job)
            raise APIError(500, "generation failed", code="internal_error")
        self._account(job, ev)
        return ev

    def _account(self, job: _Job, ev: RowEvent) -> None:
        now = time.monotonic()
        c = job.choices[ev.row]
        if not job.first_token:
            job.first_token = True
            self.metrics.ttft.observe(now - job.arrived)
        elif c.last:
            self.metrics.tpot.observe(now - c.last)
        c.last = now
        self.metrics.generation_tokens.inc()
        c.tokens.append(ev.token)
        c.text += ev.text
        if ev.logprob is not None:
            c.logprobs.append(ev.logprob)
            c.tops.append(ev.top_logprobs)
        if ev.finish_reason is not None:
            c.finish_reason = ev.finish_reason
            if ev.row in job.pending:
                job.pending.discard(ev.row)
                self.outstanding -= 1

    def prompt_logprobs(self, tokens: list[int], top: int) -> tuple[list[float | None], list]:
        """(log-probs of the prompt's tokens, first None; top-N alternatives), via gpt2kit.score."""
        import torch

        from gpt2kit.score import score_tokens

        if len(tokens) < 2:
            return [None], [None]
        lps = score_tokens(self.model, tokens[1:], eot_token=tokens[0])
        tops: list = [None] + [() for _ in lps]
        if top:
            with torch.inference_mode():
                logits = self.model(torch.tensor([tokens], device=self.model.wte.weight.device)).logits[0, :-1]
                best = torch.log_softmax(logits.float(), -1).topk(top, dim=-1)
            tops = [None] + [tuple(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(),
                                                                             best.values.tolist(), strict=True)]
        return [None, *lps], tops

    async def echo_logprobs(self, job: _Job, request: Request) -> list[tuple[list, list]] | None:
        """The prompts' log-probs for echo, scored one prompt per worker job (between decode steps);
        a client gone stops it before the next prompt."""
        if not job.body.echo or job.body.logprobs is None:
            return None
        out = []
        for p in job.prompts:
            if await request.is_disconnected():
                self.cancel(job)
                raise asyncio.CancelledError
            out.append(await self.run_in_worker(self.prompt_logprobs, p, job.body.logprobs))
            job.scoring -= len(p)
            job.work -= len(p)
            self.work_tokens -= len(p)
            self.metrics.scoring_tokens.dec(len(p))
            self.metrics.scored_tokens.inc(len(p))
        return out

    def logprobs_obj(self, tokens, lps, tops, offsets: _Offsets) -> dict:
        return {"tokens": [self.token_key(t) for t in tokens], "token_logprobs": list(lps),
                "top_logprobs": [self.top_dict(t) for t in tops], "text_offset": [offsets.feed(t) for t in tokens]}

    def usage(self, job: _Job) -> dict:
        prompt = sum(map(len, job.prompts))
        done = sum(len(c.tokens) for c in job.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def complete(self, job: _Job, request: Request) -> dict:
        try:
            prompt_lp = await self.echo_logprobs(job, request)
            while job.pending:
                await self.next_event(job, request)
        finally:
            self.cancel(job)
        body, choices = job.body, []
        for i, p in enumerate(job.prompts):
            mine = [c for c in job.choices.values() if c.prompt_index == i]
            if job.best_of > job.n:
                mine = sorted(mine, key=lambda c: -c.mean_logprob())[: job.n]
            if not mine:  # max_tokens 0 with echo: the prompt alone
                mine = [_Choice(i, j, finish_reason="length") for j in range(job.n)]
            for rank, c in enumerate(mine):
                text = (job.prompt_texts[i] if body.echo else "") + c.text
                lp = None
                if body.logprobs is not None:
                    off = _Offsets(self.tokenizer)
                    if body.echo:
                        plp, ptop = prompt_lp[i]
                        lp = self.logprobs_obj(p, plp, ptop, off)
                    else:
                        for t in p:
                            off.feed(t)
                    gen = self.logprobs_obj(c.tokens, c.logprobs, c.tops, off)
                    lp = gen if lp is None else {k: lp[k] + gen[k] for k in gen}
                choices.append({"text": text, "index": i * job.n + rank, "logprobs": lp,
                                "finish_reason": c.finish_reason})
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": body.model,
                "choices": choices, "usage": self.usage(job)}

    async def stream(self, job: _Job, request: Request) -> AsyncIterator[str]:
        body = job.body
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        offsets: dict[tuple[int, int], _Offsets] = {}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            obj: dict[str, Any] = {"id": job.id, "object": "text_completion", "created": job.created,
                                   "model": body.model, "choices": choices}
            if include_usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            prompt_lp = await self.echo_logprobs(job, request)
            for i, p in enumerate(job.prompts):
                for j in range(job.n):
                    off = offsets[(i, j)] = _Offsets(self.tokenizer)
                    lp = None
                    if body.logprobs is not None and body.echo:
                        lp = self.logprobs_obj(p, *prompt_lp[i], off)
                    else:
                        for t in p:
                            off.feed(t)
                    if body.echo:
                        yield chunk([{"text": job.prompt_texts[i], "index": i * job.n + j, "logprobs": lp,
                                      "finish_reason": None if job.rows else "length"}])
            while job.pending:
                ev = await self.next_event(job, request)
                c = job.choices[ev.row]
                lp = None
                if body.logprobs is not None:
                    lp = self.logprobs_obj([ev.token], [ev.logprob], [ev.top_logprobs],
                                           offsets[(c.prompt_index, c.sample_index)])
                if ev.text or lp is not None or ev.finish_reason:
                    yield chunk([{"text": ev.text, "index": c.prompt_index * job.n + c.sample_index,
                                  "logprobs": lp, "finish_reason": ev.finish_reason}])
            if include_usage:
                yield chunk([], self.usage(job))
            yield "data: [DONE]\n\n"
        except APIError as e:  # an error event, then [DONE]: the stream ends as every stream does
            yield f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # Starlette saw the client leave (or uvicorn gave up at shutdown)
            self.cancel(job, "stream cancelled (client gone, or the server stopping)")
            raise
        finally:
            self.cancel(job)


# --- the app ----------------------------------------------------------------------------------


class _Guard:
    """ASGI middleware: the API key (every path but /health), the body-size limit (413) and the
    request counter, before FastAPI sees the request."""

    def __init__(self, app, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts, path = self.server.opts, scope["path"]
        status = {"code": 500}

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            headers = dict(scope.get("headers") or [])
            if opts.api_key is not None and path != "/health":
                got = headers.get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(got.encode(), f"Bearer {opts.api_key}".encode()):
                    return await _send_error(send_counted, 401, "Incorrect or missing API key: send "
                                             "'Authorization: Bearer KEY'", code="invalid_api_key")
            await self.app(scope, receive, send_counted)  # the body's size and deadline: serve/gate.py
        finally:
            if path in _ENDPOINTS:
                self.server.metrics.requests.labels(path, str(status["code"])).inc()


async def _send_error(send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(loader: Callable[[], tuple[GPT2, Tokenizer]], opts: ServeOptions | None = None) -> FastAPI:
    """The server app. loader() -> (model, tokenizer) runs in a thread at startup; until it returns
    every endpoint answers 503 (loading)."""
    opts = opts or ServeOptions()
    server = Server(loader, opts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        yield
        server.stop()

    app = FastAPI(title="gpt2kit", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions for GPT-2 checkpoints (gpt2kit serve)")
    app.state.server = server
    install(app)

    @app.post("/v1/completions", response_model=S.Completion, responses={**_STREAM_200, **_ERRORS})
    async def completions(body: S.CompletionRequest, request: Request):
        server.require_ready()
        job = server.plan(body)
        if body.stream:
            return StreamingResponse(server.stream(job, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await server.complete(job, request)

    @app.post("/v1/chat/completions", response_model=S.ChatCompletion, responses=_ERRORS)
    async def chat(body: S.ChatRequest, request: Request):
        server.require_ready()
        if opts.chat_template is None:
            raise APIError(400, "GPT-2 has no chat format: start the server with --chat-template FILE (a Jinja2 "
                                "template over `messages`) to enable /v1/chat/completions; or use /v1/completions",
                           param="messages", code="chat_template_missing")
        if body.stream:
            raise APIError(400, "streaming chat is not supported; use /v1/completions with stream", param="stream")
        prompt = _render_chat(opts.chat_template, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        req = S.CompletionRequest(
            model=body.model, prompt=prompt, max_tokens=max_tokens if max_tokens is not None else 16,
            temperature=body.temperature, top_p=body.top_p, n=body.n, stop=body.stop,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            logit_bias=body.logit_bias, seed=body.seed, user=body.user)
        out = await server.complete(server.plan(req), request)
        return {"id": out["id"].replace("cmpl-", "chatcmpl-"), "object": "chat.completion",
                "created": out["created"], "model": out["model"], "usage": out["usage"],
                "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                             "finish_reason": c["finish_reason"], "logprobs": None} for c in out["choices"]]}

    @app.get("/v1/models", response_model=S.ModelList, responses=_ERRORS)
    async def models():
        server.require_ready()
        return {"object": "list", "data": [_card(server)]}

    @app.get("/v1/models/{model:path}", response_model=S.ModelCard, responses=_ERRORS)  # names may hold "/"
    async def model_card(model: str):
        server.require_ready()
        server.check_model(model)
        return _card(server)

    @app.get("/health", response_model=S.Health, responses={503: _ERRORS[503]})
    async def health():
        server.require_ready()
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, 401: _ERRORS[401]})
    async def metrics():
        return PlainTextResponse(server.metrics.render().decode(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize", response_model=S.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: S.TokenizeRequest):
        server.require_ready()
        server.check_model(body.model)
        ids = server.tokenizer.encode(body.prompt, allow_special=body.add_special_tokens is not False)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.model.config.n_ctx,
                "pieces": [server.piece(t) for t in ids]}

    @app.post("/detokenize", response_model=S.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: S.DetokenizeRequest):
        server.require_ready()
        server.check_model(body.model)
        n = server.tokenizer.n_vocab
        bad = [t for t in body.tokens if t >= n]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {n})", param="tokens")
        return {"prompt": server.tokenizer.decode(body.tokens), "pieces": [server.piece(t) for t in body.tokens]}

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for item in schema.get("paths", {}).values():  # validation errors are 400 here, never 422
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(Gate, server=server)  # inside _Guard: its answers are counted and need the key
    app.add_middleware(_Guard, server=server)
    return app


def _card(server: Server) -> dict:
    from gpt2kit.quant import quantization  # torch is loaded by now: the model is
    q = quantization(server.model)
    return {"id": server.opts.served_model_name, "object": "model", "created": server.started,
            "owned_by": "gpt2kit", "max_model_len": server.model.config.n_ctx,
            "quantization": q and q["scheme"]}


def _render_chat(template: str, body: S.ChatRequest) -> str:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise APIError(400, "--chat-template needs Jinja2: pip install 'gpt2kit[serve]'") from None
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=[m.model_dump() for m in body.messages],
                                                add_generation_prompt=True)
    except Exception as e:  # a template error is the request's (or the operator's) problem
        raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param="messages") from None
