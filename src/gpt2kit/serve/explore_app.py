"""`gpt2kit explore`'s web layer: the FastAPI app over an Explorer (gpt2kit.trace.explore, whose doc
lists the routes), its Host check and body limit, and the loopback socket uvicorn serves it on."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel

from gpt2kit.serve.gate import host_allowed
from gpt2kit.trace.explore import Explorer, SessionGone, page


class _Text(BaseModel):
    text: str


class _Stages(_Text):
    layer: int = 0
    head: int = 0
    position: int = -1  # -1: the last
    rows: int = 4
    cols: int = 8


class _Append(BaseModel):
    session: str
    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


class _Steer(BaseModel):
    name: str
    text: str
    scale: float = 1.0


class _Intervene(_Text):
    ablate: list[str] = []
    steer: _Steer | None = None


MAX_BODY_BYTES = 1 << 20  # a request is a text of at most n_ctx tokens and a few numbers


def _error(status: int, message: str, param: str | None):
    return JSONResponse({"error": {"message": message, "param": param}}, status_code=status)


def _answer(fn, param: str | None = None):
    try:
        return fn()
    except SessionGone as e:
        return _error(404, str(e), "session")
    except ValueError as e:  # the request's values (the trace's and the sampler's own messages)
        return _error(400, str(e), param)


def create_app(ex: Explorer):
    """The FastAPI app: the page and the JSON routes (the module doc); 400 with {error: {message,
    param}} for a bad value, 404 for a session that is gone."""
    app = FastAPI(title="gpt2kit explore", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def gate(request: Request, call_next):
        # a page elsewhere that points its own name at 127.0.0.1 (DNS rebinding) sends that name as Host
        if not host_allowed(request.headers.get("host"), request.scope.get("server"), ()):
            return _error(400, f"Host {request.headers.get('host')!r} is not allowed: use 127.0.0.1 or localhost",
                          "host")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # a missing field or a value of the wrong type: the same shape as every other refusal
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{field or 'the body'}: {first.get('msg', 'invalid')}", field)

    _routes(app, ex)
    return app


def _routes(app: FastAPI, ex: Explorer) -> None:
    @app.get("/", response_class=HTMLResponse)
    def index():
        return HTMLResponse(page(ex), headers={"Cache-Control": "no-store"})

    @app.get("/api/info")
    def info():
        return ex.info()

    # Returned as responses, so FastAPI's encoder does not walk the views' many numbers one by one.
    @app.post("/api/trace")
    def trace_route(body: _Text):
        return _answer(lambda: JSONResponse(ex.views(body.text)), "text")

    @app.post("/api/lens")
    def lens_route(body: _Text):
        return _answer(lambda: JSONResponse(ex.lens(body.text)), "text")

    @app.post("/api/stages")
    def stages_route(body: _Stages):
        def run():
            pos = body.position if body.position >= 0 else len(ex.ids(body.text)) + body.position
            return ex.stages(body.text, body.layer, body.head, pos, body.rows, body.cols)
        return _answer(run)

    @app.post("/api/gen/start")
    def gen_start(body: _Text):
        return _answer(lambda: ex.gen_start(body.text), "text")

    @app.post("/api/gen/append")
    def gen_append(b: _Append):
        return _answer(lambda: ex.gen_append(b.session, b.mode, b.temperature, b.top_k, b.top_p, b.min_p, b.seed))

    @app.post("/api/intervene")
    def intervene(b: _Intervene):
        return _answer(lambda: ex.intervene(b.text, b.ablate, None if b.steer is None else b.steer.model_dump()))


def bind(port: int):
    """A listening socket on 127.0.0.1:port (0: a free port); OSError names a port in use."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on 127.0.0.1:{port} ({e.strerror}); choose another --port") from None
    sock.listen(128)  # listening now: a browser opened before uvicorn starts waits in the backlog
    return sock


def server_for(ex: Explorer, log_level: str = "warning"):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(create_app(ex), log_level=log_level, timeout_graceful_shutdown=2))
