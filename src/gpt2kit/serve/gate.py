"""ASGI middleware in front of the routes: the Host check (DNS rebinding), 503 while the server
drains for a shutdown, and the body: read whole before the routes see it, within its deadline
(408) and under the byte limit (413, chunked bodies included: FastAPI would call one "error
parsing the body", a 400).

Host: a web page can make a browser send requests to a loopback server by pointing its own name at
127.0.0.1 (DNS rebinding); the browser then sends the page's name as Host. So a request that came
in on a loopback address must name the server by a loopback name (localhost, 127.0.0.1, [::1],
with the server's port if any) or one of ServeOptions.allowed_hosts (a name, or name:port; "*"
turns the check off). On any other address the check applies only when allowed_hosts is given.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json

from gpt2kit.serve.errors import error_body
from gpt2kit.serve.limits import read_body, replay

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, int | None]:
    """'name:port' / '[v6]:port' / 'name' -> (lower-case name, port or None); port -1 if malformed."""
    value = value.strip().lower()
    name, sep, port = value.rpartition(":")
    if not sep or (name.startswith("[") and not name.endswith("]")) or (not name.startswith("[") and ":" in name):
        return value, None  # no port (a bare IPv6 literal in brackets, or a plain name)
    return name, int(port) if port.isdigit() else -1


def host_allowed(host_header: str | None, server: tuple | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request's Host may reach this server (see the module doc)."""
    if "*" in allowed or host_header is None:
        return True  # no Host at all is HTTP/1.0 from a program; browsers always send one
    local = server is not None and isinstance(server[0], str) and _is_loopback(server[0])
    if not local and not allowed:
        return True
    name, port = _split_host(host_header)
    if port == -1:
        return False
    for entry in allowed:
        e_name, e_port = _split_host(entry)
        if e_name == name and (e_port is None or e_port == port):
            return True
    my_port = server[1] if server is not None else None
    return local and name in _LOOPBACK_NAMES and (port is None or port == my_port)


class Gate:
    """The middleware; `server` is the app's Server (its opts and lifecycle)."""

    def __init__(self, app, server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts = self.server.opts
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host")
        host = None if host is None else host.decode("latin-1")
        if not host_allowed(host, scope.get("server"), tuple(opts.allowed_hosts)):
            return await send_error(send, 400, f"Host {host!r} is not allowed: this server answers on a loopback "
                                    f"address only to localhost, 127.0.0.1 or [::1] (DNS rebinding protection); "
                                    f"add names with --allowed-hosts", code="invalid_host")
        if self.server.life.draining:
            return await send_error(send, 503, "the server is shutting down; retry on another instance",
                                    code="server_shutting_down",
                                    headers=[(b"retry-after", b"1"), (b"connection", b"close")])
        limit = opts.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await send_error(send, 413, f"the request body is larger than {limit} bytes",
                                    code="request_too_large")
        try:  # the whole body before the app sees it: a chunked body is limited too, and it has a deadline
            messages = await asyncio.wait_for(read_body(receive, limit), opts.read_timeout)
        except asyncio.TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within {opts.read_timeout:g} s "
                                    f"(--read-timeout)", code="request_timeout",
                                    headers=[(b"connection", b"close")])
        if messages is None:
            return await send_error(send, 413, f"the request body is larger than {limit} bytes",
                                    code="request_too_large")
        await self.app(scope, replay(messages, receive), send)


async def send_error(send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer with OpenAI's error body, before the app has started a response."""
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
