"""A live gpt2kit server for tests: uvicorn in a thread on a free 127.0.0.1 port, a tiny model."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx


@contextlib.contextmanager
def live_server(loader, opts=None, *, wait_ready: bool = True):
    import uvicorn

    from gpt2kit.serve import create_app

    app = create_app(loader, opts)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    if wait_ready:
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts and opts.api_key else {}
        while time.monotonic() < deadline:
            if httpx.get(url + "/health", headers=headers).status_code == 200:
                break
            time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
