"""OpenAI's error body on every non-2xx answer: {"error": {"message", "type", "param", "code"}}.

Handlers turn every failure into that shape: our own APIError, FastAPI's request validation
(400 naming the field, never 422), Starlette's HTTP errors (404, 405, ...), malformed JSON and,
last, any unexpected exception (500 with no traceback and no detail leaked).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("gpt2kit.serve")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _best(errors: list[dict]) -> dict:
    """The error to report. pydantic reports a union field once per member (prompt: as a string,
    as strings, as ids, as id lists), in declaration order, so the first one always blamed the
    string member. Among the first field's errors, take a value error (an id below 0, a list over
    its limit) over a type error, the deepest over a shallower; type errors that tie name every
    type they wanted."""
    if not errors:
        return {}
    field = errors[0].get("loc", ())[:2]
    mine = [e for e in errors if e.get("loc", ())[:2] == field]
    rank = sorted(mine, key=lambda e: (e.get("type", "").endswith("_type"), -len(e.get("loc", ()))))
    best = rank[0]
    if best.get("type", "").endswith("_type"):
        ties = [e for e in rank if e.get("type", "").endswith("_type") and len(e["loc"]) == len(best["loc"])]
        wants = list(dict.fromkeys(e.get("msg", "").removeprefix("Input should be ") for e in ties))
        if len(wants) > 1:
            best = {**best, "msg": "Input should be " + ", ".join(wants[:-1]) + " or " + wants[-1]}
    return best


def _validation(exc: RequestValidationError) -> JSONResponse:
    err = _best(list(exc.errors()))
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid" or (kind == "model_attributes_type" and not loc):
        return error_response(400, "the request body is not valid JSON: send a JSON object")
    # Union members add their type names to loc (e.g. prompt.str, prompt.list[int]); keep the field path.
    param = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool"))
    what = err.get("msg", "invalid value")
    if kind == "extra_forbidden":
        what = "unrecognized request argument"
    elif kind == "missing":
        what = "missing required field"
    shown = json.dumps(err.get("input"), default=str)[:80] if kind not in ("missing",) else ""
    return error_response(400, f"{param or 'body'}: {what}" + (f" (got {shown})" if shown else ""),
                          param or None)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(status, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s: %s", request.url.path, type(exc).__name__)
        return error_response(500, "internal server error", code="internal_error")
