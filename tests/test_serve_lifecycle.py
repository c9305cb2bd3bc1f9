"""gpt2kit serve's connection lifecycle, through real servers on 127.0.0.1: disconnects noticed at
once, the SIGTERM drain (a real subprocess), the API key's sources, the Host check, connection
timeouts (raw sockets), the missing-extra hint and the ready line. Nothing here asserts a duration:
where a wait is involved, the test waits for an outcome and bounds the wait generously."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import SMALL, live_server, varied_model  # noqa: E402

import gpt2kit  # noqa: E402
from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.config import GPT2Config  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402
from gpt2kit.serve.auth import resolve_api_key  # noqa: E402

NAME = "tiny"
NO_EOT = {"50256": -100}  # rows run to max_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(varied_model(SMALL, seed=0), d)
    return str(d)


def _wait(cond, what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {limit:g} s")
        time.sleep(0.02)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# --- 1. a client that disconnects ---------------------------------------------------------------

@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """n_ctx 1024, so a request can ask for 1,000 tokens."""
    d = tmp_path_factory.mktemp("long")
    save_model(varied_model(GPT2Config(n_vocab=50257, n_ctx=1024, n_embd=32, n_head=4, n_layer=1), seed=1), d)
    return str(d)


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_client_has_its_rows_cancelled_at_once_with_one_log_line(long_dir, stream):
    calls = [0]

    def loader():
        m = load_model(long_dir)

        def step(*_):  # a token every ~10 ms: events never pause for long
            calls[0] += 1
            time.sleep(0.01)

        m.wte.register_forward_hook(step)
        return m, load_tokenizer(long_dir)

    with live_server(loader, ServeOptions(served_model_name=NAME)) as (url, app):
        records = _Records()
        loggers = [logging.getLogger(n) for n in ("gpt2kit.serve", "uvicorn.error", "uvicorn")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.addHandler(records)
            lg.setLevel(logging.INFO)
        try:
            engine, server = app.state.server.engine_loop.engine, app.state.server
            body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1000, "logit_bias": NO_EOT,
                               "stream": stream}).encode()
            client = socket.create_connection(("127.0.0.1", _port(url)))
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait(lambda: calls[0] >= 5, "the row to generate")
            client.close()
            at_close = calls[0]
            _wait(lambda: not (engine.n_running or engine.n_waiting), "the row to leave the batch")
            # Dropped within a few steps of the disconnect, not after the 1,000 tokens it asked for.
            assert calls[0] - at_close < 500
            assert server.outstanding == 0
            _wait(lambda: any("disconnect" in r.getMessage() or "cancelled" in r.getMessage()
                              for r in records.records), "the log line")
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.removeHandler(records)
                lg.setLevel(level)
    said = [r.getMessage() for r in records.records if "cancelled" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert not [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in records.records]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_disconnected_clients_row_is_freed_within_one_step_as_metrics_show(long_dir):
    """The engine is held inside a forward (a hook waits), the client goes away meanwhile: once the
    held step is let go, /metrics shows the batch empty after at most that one step more, and no
    forward runs for the row after it (it asked for 1,000 tokens)."""
    calls, hold, held, go = [0], threading.Event(), threading.Event(), threading.Event()

    def loader():
        m = load_model(long_dir)

        def step(*_):
            calls[0] += 1
            if hold.is_set():
                held.set()
                go.wait(120)

        m.wte.register_forward_hook(step)
        return m, load_tokenizer(long_dir)

    with live_server(loader, ServeOptions(served_model_name=NAME)) as (url, app):
        server = app.state.server
        body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1000, "logit_bias": NO_EOT,
                           "stream": True}).encode()
        client = socket.create_connection(("127.0.0.1", _port(url)))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            _wait(lambda: calls[0] >= 3, "the row to generate")
            hold.set()
            _wait(held.is_set, "the engine to be held inside a forward")
            client.close()
            _wait(lambda: server.outstanding == 0, "the disconnect to be noticed")
            assert _metric(url, "gpt2kit_batch_size") == 1  # still in the held step
            steps, forwards = _metric(url, "gpt2kit_engine_steps"), calls[0]
        finally:
            go.set()
        _wait(lambda: _metric(url, "gpt2kit_batch_size") == 0, "the row to leave the batch")
        assert _metric(url, "gpt2kit_engine_steps") - steps <= 1  # the held step, no other
        assert calls[0] == forwards and _metric(url, "gpt2kit_queue_length") == 0


# --- 2. SIGTERM: drain, then end cleanly; 7. the ready line --------------------------------------

_SCRIPT = r"""
import os, sys, time
from gpt2kit.checkpoint import load_model, load_tokenizer
from gpt2kit.serve import ServeOptions, create_app, make_server
model_dir, hold, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])

def loader():
    m = load_model(model_dir)
    def gate(*_):  # every model call waits while the file `hold` exists (and says so)
        if os.path.exists(hold):
            open(hold + ".entered", "w").close()
        while os.path.exists(hold):
            time.sleep(0.01)
    m.wte.register_forward_hook(gate)
    return m, load_tokenizer(model_dir)

make_server(create_app(loader, ServeOptions(served_model_name="tiny", shutdown_grace=grace)), port=0).run()
print("exited cleanly", file=sys.stderr, flush=True)
"""


class _Proc:
    """A server subprocess; its stderr lines collected as they come; url from its ready line."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        src = str(Path(gpt2kit.__file__).resolve().parents[1])
        env = {**os.environ, **(env or {}), "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.p = subprocess.Popen([sys.executable, *argv], env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stderr), daemon=True)
        self.reader.start()
        _wait(lambda: self.ready_line() or self.p.poll() is not None, "the ready line", 300)
        assert self.ready_line(), "".join(self.lines)
        self.url = self.ready_line().split(" on ", 1)[1].split()[0]

    def ready_line(self) -> str | None:
        return next((line for line in self.lines if "ready: serving" in line), None)

    def exit_code(self) -> int:
        """Wait for the process to exit by itself; its stderr is all in self.lines then."""
        code = self.p.wait(120)
        self.reader.join(60)
        return code

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.kill()
        return self.p.wait(60)


def _drain_server(model_dir, tmp_path, grace: float):
    hold = tmp_path / "hold"
    proc = _Proc(["-c", _SCRIPT, model_dir, str(hold), str(grace)])
    hold.touch()  # from here on every step waits for the test
    return proc, hold


def _waiting(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("gpt2kit_queue_length "))


def _start_both(url: str, hold: Path):
    """A non-streaming request held in its prefill and a stream waiting behind it; the
    non-streaming answer arrives in box[0]."""
    box = []
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "logit_bias": NO_EOT}
    t = threading.Thread(target=lambda: box.append(httpx.post(url + "/v1/completions", json=body, timeout=120)))
    t.start()
    entered = Path(str(hold) + ".entered")
    _wait(entered.exists, "the first request's prefill")
    cm = httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
    r = cm.__enter__()
    assert r.status_code == 200
    _wait(lambda: _waiting(url) == 1, "the stream to wait for its turn")
    return t, box, cm, r


def _refusing(url: str) -> bool:
    return httpx.get(url + "/health", timeout=30).status_code == 503


def test_sigterm_refuses_new_requests_and_lets_in_flight_ones_finish(model_dir, tmp_path):
    proc, hold = _drain_server(model_dir, tmp_path, grace=300)
    try:
        line = proc.ready_line()
        assert "serving 'tiny' on http://127.0.0.1:" in line and "float32" in line and "quantization none" in line
        t, box, cm, r = _start_both(proc.url, hold)
        proc.p.send_signal(signal.SIGTERM)
        _wait(lambda: _refusing(proc.url), "503 while draining")
        e = httpx.post(proc.url + "/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=30)
        assert e.status_code == 503 and e.json()["error"]["code"] == "server_shutting_down"
        hold.unlink()  # the held requests may go on now
        events = [x for x in r.read().decode().split("\n\n") if x]
        cm.__exit__(None, None, None)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(x[len("data: "):]) for x in events[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        t.join(120)
        assert box[0].status_code == 200 and box[0].json()["usage"]["completion_tokens"] == 3
        assert proc.exit_code() == 0 and any("exited cleanly" in x for x in proc.lines)
    finally:
        hold.unlink(missing_ok=True)
        proc.stop()


def test_sigterm_ends_what_outlasts_the_grace_cleanly(model_dir, tmp_path):
    proc, hold = _drain_server(model_dir, tmp_path, grace=0.2)
    try:
        t, box, cm, r = _start_both(proc.url, hold)
        proc.p.send_signal(signal.SIGTERM)  # the model never moves: only the grace can end them
        events = [x for x in r.read().decode().split("\n\n") if x]
        cm.__exit__(None, None, None)
        assert events[-1] == "data: [DONE]", events
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == "server_shutting_down" and "--shutdown-grace" in err["message"]
        t.join(120)
        assert box[0].status_code == 503
        err = box[0].json()["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable"
        hold.unlink()  # let the worker's step return, so the process can exit
        assert proc.exit_code() == 0
        assert any("grace ran out" in x for x in proc.lines)
    finally:
        hold.unlink(missing_ok=True)
        proc.stop()


# --- 3. the API key from the environment or a file -----------------------------------------------

def test_api_key_from_the_environment_is_not_on_the_command_line(model_dir):
    key = "env-s3cret-key"
    proc = _Proc(["-m", "gpt2kit.cli", "serve", "--model", model_dir, "--port", "0", "--served-model-name", NAME],
                 env={"GPT2KIT_API_KEY": key})
    try:
        assert key.encode() not in Path(f"/proc/{proc.p.pid}/cmdline").read_bytes()
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        assert httpx.get(proc.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert "ready: serving 'tiny'" in proc.ready_line()  # the CLI's own ready line
        proc.p.send_signal(signal.SIGTERM)  # idle: stops at once
        assert proc.exit_code() == 0
    finally:
        proc.stop()


def test_api_key_sources(tmp_path, capsys, monkeypatch):
    f = tmp_path / "key"
    f.write_text("file-s3cret\n")
    f.chmod(0o600)
    assert resolve_api_key(None, str(f), environ={}) == ("file-s3cret", [])
    assert resolve_api_key(None, None, environ={"GPT2KIT_API_KEY": "e"}) == ("e", [])
    assert resolve_api_key(None, None, environ={}) == (None, [])
    key, warnings = resolve_api_key("k", None, environ={})
    assert key == "k" and "process list" in warnings[0]
    with pytest.raises(ValueError, match="one way"):
        resolve_api_key("k", None, environ={"GPT2KIT_API_KEY": "e"})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="one key"):
        resolve_api_key(None, str(tmp_path / "empty"), environ={})
    f.chmod(0o644)
    from gpt2kit.cli import main

    monkeypatch.delenv("GPT2KIT_API_KEY", raising=False)
    assert main(["serve", "--model", "/no/such/model", "--port", "0", "--api-key-file", str(f)]) == 1
    err = capsys.readouterr().err
    assert "readable by other users" in err and "chmod 600" in err
    assert main(["serve", "--model", "/no/such/model", "--api-key-file", str(tmp_path / "nope")]) == 1
    assert "cannot read the API key file" in capsys.readouterr().err.strip().splitlines()[-1]


# --- 4. the Host check ----------------------------------------------------------------------------

def test_a_loopback_server_refuses_foreign_host_headers(model_dir):
    loader = lambda: (load_model(model_dir), load_tokenizer(model_dir))  # noqa: E731
    with live_server(loader, ServeOptions(served_model_name=NAME, allowed_hosts=("models.internal",))) as (url, _):
        port = _port(url)
        for ok in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost", f"LOCALHOST:{port}",
                   "models.internal", f"models.internal:{port}"):
            assert httpx.get(url + "/health", headers={"Host": ok}).status_code == 200, ok
        for bad in (f"evil.example:{port}", "evil.example", f"localhost:{port + 1}", f"127.0.0.1.evil.example:{port}",
                    f"localhost:{port}x"):
            r = httpx.post(url + "/v1/completions", headers={"Host": bad}, json={"model": NAME, "prompt": "x"})
            assert r.status_code == 400, bad
            e = r.json()["error"]
            assert e["code"] == "invalid_host" and e["type"] == "invalid_request_error" and "--allowed-hosts" in \
                e["message"]
    with live_server(loader, ServeOptions(served_model_name=NAME, allowed_hosts=("*",))) as (url, _):
        assert httpx.get(url + "/health", headers={"Host": "anything.example"}).status_code == 200


# --- 5. idle and half-sent connections ------------------------------------------------------------

def _until_closed(s: socket.socket) -> bytes:
    s.settimeout(60)  # far beyond the server's timeouts: only a server that never closes reaches it
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def test_idle_and_half_sent_connections_are_timed_out(model_dir):
    loader = lambda: (load_model(model_dir), load_tokenizer(model_dir))  # noqa: E731
    opts = ServeOptions(served_model_name=NAME, read_timeout=0.5, keep_alive_timeout=0.5)
    with live_server(loader, opts) as (url, _):
        addr = ("127.0.0.1", _port(url))
        with socket.create_connection(addr) as s:  # half a head
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
            got = _until_closed(s)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
        with socket.create_connection(addr) as s:  # a whole head, half a body
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\": ")
            got = _until_closed(s)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
        with socket.create_connection(addr) as s:  # nothing at all
            assert _until_closed(s) == b""
        with socket.create_connection(addr) as s:  # a whole request, then idle: keep-alive ends
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = _until_closed(s)
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b'{"status":"ok"}')
        assert httpx.get(url + "/health").status_code == 200  # the server itself is fine


def test_timeouts_are_validated():
    with pytest.raises(ValueError, match="read_timeout"):
        ServeOptions(read_timeout=0)
    with pytest.raises(ValueError, match="shutdown_grace"):
        ServeOptions(shutdown_grace=float("nan"))


# --- 6. the missing extra is named ----------------------------------------------------------------

def test_serve_without_prometheus_client_names_the_extra():
    src = str(Path(gpt2kit.__file__).resolve().parents[1])
    code = ("import sys; sys.modules['prometheus_client'] = None; from gpt2kit.cli import main; "
            "sys.exit(main(['serve', '--model', 'x']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": src})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "prometheus_client" in last and "pip install 'gpt2kit[serve]'" in last, r.stderr
