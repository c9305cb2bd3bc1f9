"""What one request may ask of gpt2kit serve, through the real HTTP clients on loopback:
sampling values that used to overflow, a row that fails alone, echo scoring counted against the
limits (and stopped for a client gone, and shown in /metrics), logit_bias keys, union-field
messages, chunked bodies, and served names with "/"."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from helpers import SMALL, live_server, varied_model  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.generation import generate  # noqa: E402
from gpt2kit.sampling import SamplingSettings  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402

NAME = "runs/stdlib"  # a served name with "/", as the default for a directory is


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(varied_model(SMALL, seed=0), d)
    return str(d)


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(lambda: (load_model(model_dir), load_tokenizer(model_dir)),
                     ServeOptions(served_model_name=NAME, max_batch=8, max_queue=64)) as (url, app):
        yield url, app


def _err(r, status, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def _post(url, body, timeout=60):
    return httpx.post(url + "/v1/completions", json={"model": NAME, **body}, timeout=timeout)


def _metric(url, name):
    m = re.search(rf"^{name} ([0-9.e+]+)$", httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else None


# --- bad 1: sampling values that overflowed, and a row that fails alone -----------------------

def test_tiny_temperature_is_greedy_and_a_tiny_penalty_is_400(server, model_dir):
    url = server[0]
    greedy = _post(url, {"prompt": "Hello", "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    for t in (1e-45, 5e-6):
        r = _post(url, {"prompt": "Hello", "max_tokens": 12, "temperature": t, "seed": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy
    e = _err(_post(url, {"prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1e-45}), 400,
             "repetition_penalty")
    assert "0.01" in e["message"]


def _nan_position_model(model_dir, pos, delay=0.0):
    m = load_model(model_dir)
    with torch.no_grad():
        m.wpe.weight[pos] = float("nan")  # a row reaching position pos gets NaN logits; the others never do
    if delay:
        m.wte.register_forward_hook(lambda *a: time.sleep(delay))
    return m, load_tokenizer(model_dir)


def test_a_request_whose_sampling_fails_fails_alone(model_dir):
    tok = load_tokenizer(model_dir)
    with live_server(lambda: _nan_position_model(model_dir, 40, delay=0.05),
                     ServeOptions(served_model_name=NAME)) as (url, app):
        model = app.state.server.model
        want = generate(model, ["Hi"], SamplingSettings(max_new_tokens=36, temperature=0, stop_token_ids=(),
                                                        logit_bias={50256: -100}), tokenizer=tok)[0].text
        body = {"model": NAME, "prompt": "Hi", "max_tokens": 36, "temperature": 0, "stream": True,
                "logit_bias": {"50256": -100}}
        got = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            got.append(first)
            # A sampled row of 36 tokens reaches position 40 (NaN) at its 5th token, while the greedy one runs.
            bad = _post(url, {"prompt": list(range(300, 336)), "max_tokens": 10, "seed": 3})
            got += [x for x in lines if x]
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "internal_error"
        events = [json.loads(x[len("data: "):]) for x in got if x.startswith("data: ") and x != "data: [DONE]"]
        assert got[-1] == "data: [DONE]" and all("error" not in e for e in events)
        assert "".join(c["text"] for e in events for c in e["choices"]) == want
        assert _post(url, {"prompt": "Hi", "max_tokens": 3}).status_code == 200  # the server goes on


# --- bad 5: echo scoring is work, counted in tokens, stopped for a client gone, in /metrics -----

def _gated(model_dir, gate):
    def wait(*_):  # every forward waits for the test's go (returns None: the output stays)
        gate.wait(60)

    m = load_model(model_dir)
    m.wte.register_forward_hook(wait)
    return m, load_tokenizer(model_dir)


def test_echo_scoring_is_admitted_in_tokens_and_stops_for_a_client_gone(model_dir):
    gate = threading.Event()
    # 4 rows: 4 x 64 = 256 tokens of work; one request's share: 2 rows, 128 tokens
    opts = ServeOptions(served_model_name=NAME, max_batch=1, max_queue=3)
    prompts = [[100 + i] * 20 for i in range(5)]  # 100 tokens to score
    echo = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    with live_server(lambda: _gated(model_dir, gate), opts) as (url, app):
        _echo_scoring_checks(url, gate, echo, prompts)


def _send(url, body) -> socket.socket:
    """A client that sends a request and reads nothing (a raw socket, closed when the test says)."""
    port = int(url.rsplit(":", 1)[1])
    raw = json.dumps({"model": NAME, **body}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (port, len(raw), raw))
    return s


def _wait_metric(url, name, value):
    deadline = time.monotonic() + 60
    while _metric(url, name) != value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metric(url, name) == value


def _echo_scoring_checks(url, gate, echo, prompts):
    try:
        e = _err(_post(url, {**echo, "prompt": prompts * 2}), 400, "prompt")  # 200 tokens: over one request's share
        assert "200 tokens" in e["message"] and "at most 128 of this server's 256" in e["message"]
        # Two clients that send 100 tokens to score each, then leave; the worker is held inside the first prompt.
        leavers = [_send(url, echo)]
        _wait_metric(url, "gpt2kit_scoring_tokens", 100)
        leavers.append(_send(url, echo))
        _wait_metric(url, "gpt2kit_scoring_tokens", 200)
        assert _metric(url, "gpt2kit_work_tokens") == 200
        # The admitted 200 tokens count against everyone.
        _err(_post(url, {**echo, "prompt": prompts[:3]}), 429)  # 60 more tokens to score
        _err(_post(url, {"prompt": [1], "max_tokens": 60}), 429)  # a 61-token generation row
        for s in leavers:
            s.close()
        gate.set()
        _wait_metric(url, "gpt2kit_work_tokens", 0)
        assert _metric(url, "gpt2kit_scoring_tokens") == 0
        assert _metric(url, "gpt2kit_scored_tokens_total") < 200  # each stopped after the prompt in hand
        r = _post(url, {**echo, "prompt": prompts[:2]})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert _metric(url, "gpt2kit_scored_tokens_total") >= 40
    finally:
        gate.set()  # never leave the worker waiting


def test_one_request_holds_at_most_half_the_servers_rows_and_work(server):
    """max_batch 8 + max_queue 64 = 72 rows and 72 x 64 tokens of work; one request may hold half
    (36 rows, 36 x 64 = 2304 tokens), so that it never leaves every other client a 429."""
    url = server[0]
    e = _err(_post(url, {"prompt": ["x"] * 37, "max_tokens": 1}), 400, "prompt")
    assert "needs 37 rows" in e["message"] and "at most 36, half of this server's 72" in e["message"]
    _err(_post(url, {"prompt": "x", "max_tokens": 1, "n": 37}), 400, "n")
    _err(_post(url, {"prompt": "x", "max_tokens": 1, "n": 2, "best_of": 37}), 400, "best_of")
    scored = {"prompt": [[100 + i] * 60 for i in range(40)], "max_tokens": 0, "echo": True, "logprobs": 0}
    e = _err(_post(url, scored), 400, "prompt")  # 2400 tokens to score
    assert "needs 2400 tokens of work" in e["message"] and "at most 2304" in e["message"]
    assert _post(url, {"prompt": ["x"] * 36, "max_tokens": 1}).status_code == 200  # its share, whole
    r = _post(url, {**scored, "prompt": scored["prompt"][:38]})  # 2280 tokens
    assert r.status_code == 200 and len(r.json()["choices"]) == 38


# --- bad 7: logit_bias keys are canonical decimal ids ---------------------------------------

@pytest.mark.parametrize("key", ["\u00b2", "\u0661\u0662", "0005", "05", "+5", "-1", " 5", "5 ", "1e3", "",
                                 "\uff15", "50257"])
def test_logit_bias_keys_must_be_canonical_ids(server, key):
    e = _err(_post(server[0], {"prompt": "x", "max_tokens": 1, "logit_bias": {key: 1}}), 400, "logit_bias")
    assert repr(key) in e["message"]


def test_logit_bias_canonical_ids_apply(server):
    url = server[0]
    forced = {"prompt": "x", "max_tokens": 3, "temperature": 0}
    for key in ("0", "7", "50256"):
        r = _post(url, {**forced, "logit_bias": {key: 100}, "logprobs": 0})
        assert r.status_code == 200, r.text
    r = _post(url, {**forced, "logit_bias": {"5": 100}, "logprobs": 0}).json()
    assert r["choices"][0]["logprobs"]["tokens"] == ["&"] * 3  # token 5 is "&"


# --- weak: union-field messages, chunked bodies, served names with "/" ------------------------

@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": [-1]}, "prompt.0", "greater than or equal to 0 (got -1)"),
    ({"prompt": [[1, -2]]}, "prompt.0.1", "greater than or equal to 0 (got -2)"),
    ({"prompt": "x", "stop": ["a"] * 1000}, "stop", "at most 4 items"),
    ({"prompt": []}, "prompt", "at least 1 item"),
    ({"prompt": [["a"]]}, "prompt.0.0", "valid integer"),
])
def test_union_field_errors_name_the_real_problem(server, body, param, needle):
    e = _err(_post(server[0], body), 400, param)
    assert needle in e["message"] and "valid string" not in e["message"]


def test_a_chunked_body_over_the_limit_is_413(server):
    def chunks():
        for _ in range(160):  # 10 MiB, without a Content-Length
            yield b" " * 65536

    r = httpx.post(server[0] + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(server[0] + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                    content=iter([b'{"model": "runs/stdlib", ', b'"prompt": "x", "max_tokens": 1}']))
    assert ok.status_code == 200, ok.text  # a chunked body within the limit still parses


def test_a_served_name_with_a_slash_is_addressable(server):
    url = server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(url + "/v1/models/runs/stdlib").json()["id"] == NAME
    e = _err(httpx.get(url + "/v1/models/runs/other"), 404, "model")
    assert "runs/stdlib" in e["message"]
    with pytest.raises(openai.NotFoundError) as info:  # a wrong name is a 404 that names the served one
        client.completions.create(model="gpt2", prompt="x", max_tokens=1)
    assert "runs/stdlib" in str(info.value) and "--served-model-name" in str(info.value)
