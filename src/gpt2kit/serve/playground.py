"""The playground page at GET /: one self-contained HTML file (serve/assets/playground.html) that
calls this server's own API from the browser (completions and chat, streamed, with log-probs).

The page holds no data, so it is served without the API key; it asks for the key and sends it on
its API calls, which the key guards as always. Its Content-Security-Policy lets it reach this
server only (connect-src 'self') and use only its own script and style (by hash), so nothing is fetched
from elsewhere and nothing injected could run.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PATH = "/"


@cache
def _page() -> tuple[str, str]:
    """(the page, its Content-Security-Policy)."""
    html = resources.files("gpt2kit.serve").joinpath("assets", "playground.html").read_text(encoding="utf-8")
    csp = (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp


def _hashes(html: str, tag: str) -> str:
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                    for s in re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S))


def install(app: FastAPI) -> None:
    """GET / answers the page (not in the OpenAPI document: it is no API)."""

    @app.get(PATH, include_in_schema=False)
    async def playground() -> HTMLResponse:
        html, csp = _page()
        return HTMLResponse(html, headers={"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                                           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})
