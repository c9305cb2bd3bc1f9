"""The HTTP layer: FastAPI routes and the ASGI middleware (API key, request counter; the body's
size and deadline in serve/gate.py) over the server's state (serve/server.py: the model and its
engine loop, a worker thread, so the event loop never waits on the model). What /v1/completions
computes is serve/completions.py, what /v1/chat/completions adds serve/chat.py (its template
serve/template.py); log-probs are formatted in serve/logprobs.py. GET / is the playground page
(serve/playground.py); with --allow-runtime-lora, vLLM's adapter loading routes (serve/adapters.py).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, StreamingResponse

import gpt2kit.serve.adapters as adapters
import gpt2kit.serve.chat as chat
import gpt2kit.serve.playground as playground
import gpt2kit.serve.schemas as S
import gpt2kit.serve.template as template
from gpt2kit.serve.completions import complete, plan, stream
from gpt2kit.serve.errors import APIError, error_body, install
from gpt2kit.serve.gate import Gate
from gpt2kit.serve.options import ServeOptions
from gpt2kit.serve.server import Server

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer

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
              "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_TEXT_200 = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "vLLM's success text"}}


# --- the app ----------------------------------------------------------------------------------


class _Guard:
    """ASGI middleware: the API key (every path but /health and the page at /), the body-size limit (413) and the
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
            if opts.api_key is not None and path not in ("/health", playground.PATH):
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
    playground.install(app)

    _completion_routes(app, server)
    _info_routes(app, server)
    _token_routes(app, server)
    if opts.allow_runtime_lora:  # else not served: 404, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING
        _adapter_routes(app, server)
    app.openapi = functools.partial(_openapi, app, server)
    app.add_middleware(Gate, server=server)  # inside _Guard: its answers are counted and need the key
    app.add_middleware(_Guard, server=server)
    return app


def _completion_routes(app: FastAPI, server: Server) -> None:
    # exclude_unset: a choice's score (beam search) is in the response only where it was set
    @app.post("/v1/completions", response_model=S.Completion, response_model_exclude_unset=True,
              responses={**_STREAM_200, **_ERRORS})
    async def completions(body: S.CompletionRequest, request: Request):
        server.require_ready()
        job = plan(server, body)
        if body.stream:
            return StreamingResponse(stream(server, job, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await complete(server, job, request)

    @app.post("/v1/chat/completions", response_model=S.ChatCompletion, response_model_exclude_unset=True,
              responses={**_STREAM_200, **_ERRORS})
    async def chat_completions(body: S.ChatRequest, request: Request):
        server.require_ready()
        server.check_model(body.model)
        prompt = template.render(server.chat_template, body, server.tokenizer.eot_text)
        job = plan(server, chat.completion_request(body, prompt), server.chat_stops)
        if body.stream:
            return StreamingResponse(chat.stream(server, job, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return chat.response(await complete(server, job, request))


def _info_routes(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models", response_model=S.ModelList, responses=_ERRORS)
    async def models():
        server.require_ready()
        return {"object": "list", "data": [_card(server), *(_card(server, name) for name in server.adapters)]}

    @app.get("/v1/models/{model:path}", response_model=S.ModelCard, responses=_ERRORS)  # names may hold "/"
    async def model_card(model: str):
        server.require_ready()
        server.check_model(model)
        return _card(server, model if model in server.adapters else None)

    @app.get("/health", response_model=S.Health, responses={503: _ERRORS[503]})
    async def health():
        server.require_ready()
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, 401: _ERRORS[401]})
    async def metrics():
        return PlainTextResponse(server.metrics.render().decode(), media_type="text/plain; version=0.0.4")


def _token_routes(app: FastAPI, server: Server) -> None:
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


def _adapter_routes(app: FastAPI, server: Server) -> None:
    """vLLM's runtime LoRA updating (serve/adapters.py), answered in plain text as vLLM answers."""
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses={**_TEXT_200, **_ERRORS})
    async def load_lora_adapter(body: S.LoadLoRAAdapterRequest):
        return PlainTextResponse(await adapters.load(server, body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses={**_TEXT_200, **_ERRORS})
    async def unload_lora_adapter(body: S.UnloadLoRAAdapterRequest):
        return PlainTextResponse(await adapters.unload(server, body.lora_name))


def _openapi(app: FastAPI, server: Server) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for item in schema.get("paths", {}).values():  # validation errors are 400 here, never 422
            for op in item.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        if not server.ready:  # the token ids' bound comes with the model: this document is not the last
            return schema
        _token_id_bounds(schema.get("components", {}).get("schemas", {}), server)
        app.openapi_schema = schema
    return app.openapi_schema


def _card(server: Server, adapter: str | None = None) -> dict:
    """The base's card, or a LoRA adapter's: its base as parent and its directory as root (vLLM's)."""
    from gpt2kit.quant.modules import quantization  # torch is loaded by now: the model is
    q = quantization(server.model)
    base = server.opts.served_model_name
    lineage = {"root": base, "parent": None} if adapter is None else \
        {"root": server.adapter_roots[adapter], "parent": base}
    return {"id": adapter or base, "object": "model", "created": server.started, "owned_by": "gpt2kit",
            "max_model_len": server.model.config.n_ctx, "quantization": q and q["scheme"]} | lineage


def _token_id_bounds(schemas: dict, server: Server) -> None:
    """Each request field of token ids gets its vocabulary's last id as `maximum` (its `minimum` is 0),
    the bound its 400 enforces: detokenize's tokens the tokenizer's, a prompt's both's, suppress_tokens
    the model's."""
    n_model, n_tok = server.model.config.n_vocab, server.tokenizer.n_vocab
    for name, field, n in (("DetokenizeRequest", "tokens", n_tok), ("CompletionRequest", "prompt", min(n_model, n_tok)),
                           ("CompletionRequest", "suppress_tokens", n_model),
                           ("ChatRequest", "suppress_tokens", n_model)):
        _cap_ids(schemas.get(name, {}).get("properties", {}).get(field), n - 1)


def _cap_ids(node: object, top: int) -> None:
    """`maximum: top` on every integer schema with minimum 0 under node (a token id)."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = top
        for v in node.values():
            _cap_ids(v, top)
    elif isinstance(node, list):
        for v in node:
            _cap_ids(v, top)
