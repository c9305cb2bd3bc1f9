"""gpt2kit serve against the official openai client and raw httpx (SSE wire format), on loopback,
with a tiny random model saved and loaded through the real checkpoint loader. Numbers are compared
with the library (generate, score) and the CLI; tolerances are stated where floats are compared."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from helpers import (  # noqa: E402
    SMALL,
    live_server,
    varied_model,
)

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.generation import generate  # noqa: E402
from gpt2kit.sampling import SamplingSettings  # noqa: E402
from gpt2kit.score import score_text, score_tokens  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(varied_model(SMALL, seed=0), d)
    return str(d)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(lambda: (load_model(model_dir), load_tokenizer(model_dir)),
                     ServeOptions(served_model_name=NAME, max_batch=8, max_queue=64)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse(url, body, **kw):
    """POST a streaming request; the parsed `data:` events (the last one must be [DONE])."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60, **kw) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def joined(chunks, n):
    texts = [""] * n
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
    return texts


# --- exactness --------------------------------------------------------------------------------

def test_greedy_equals_cli_generate(client, model_dir, capsys, tok):
    from gpt2kit.cli import main

    argv = ["generate", "--model", model_dir, "--greedy", "--json", "-n", "20", "--ignore-eot", "Hello world"]
    assert main(argv) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = client.completions.create(model=NAME, prompt="Hello world", max_tokens=20, temperature=0, logprobs=0,
                                  logit_bias={"50256": -100})  # no <|endoftext|>, as --ignore-eot
    c = r.choices[0]
    assert c.text == cli["text"] and c.finish_reason == "length"
    from gpt2kit.serve.logprobs import token_key
    assert c.logprobs.tokens == [token_key(tok, t) for t in cli["tokens"]]
    assert r.usage.prompt_tokens == len(tok.encode("Hello world")) and r.usage.completion_tokens == 20


@pytest.fixture(scope="module")
def gpt2_init_dir(tmp_path_factory):
    """GPT-2's own init: log-probs of order 1-10, so 1e-5 is a tight absolute tolerance (the varied
    model's reach -70, where float32 rounding alone is 1e-5)."""
    from helpers import random_model

    d = tmp_path_factory.mktemp("gpt2init")
    save_model(random_model(SMALL, seed=2), d)
    return str(d)


def test_echo_prompt_logprobs_equal_score(gpt2_init_dir, tok):
    model = load_model(gpt2_init_dir)  # as `gpt2kit score` loads it
    with live_server(lambda: (load_model(gpt2_init_dir), load_tokenizer(gpt2_init_dir)),
                     ServeOptions(served_model_name=NAME)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        _check_echo(client, model, tok)


def test_echo_top_logprobs_come_from_one_forward_per_prompt(gpt2_init_dir, tok):
    """Echo with logprobs > 0 runs the model over each prompt once (log-probs and their top
    alternatives from the same forward), and the alternatives are the full forward's top-k."""
    from gpt2kit.serve.logprobs import top_dict

    calls = []

    def loader():
        m = load_model(gpt2_init_dir)
        m.register_forward_hook(lambda *a: calls.append(1))
        return m, load_tokenizer(gpt2_init_dir)

    model = load_model(gpt2_init_dir)
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello there, world"]
    with live_server(loader, ServeOptions(served_model_name=NAME)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        before = len(calls)
        r = client.completions.create(model=NAME, prompt=texts, max_tokens=0, echo=True, logprobs=3)
        assert len(calls) - before == len(texts)
    for text, choice in zip(texts, r.choices, strict=True):
        ids = tok.encode(text)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)  # (T - 1, V)
        top = logp.topk(3)
        got = choice.logprobs
        assert got.top_logprobs[0] is None
        assert [list(d) for d in got.top_logprobs[1:]] == [list(top_dict(tok, [(t, 0.0) for t in row]))
                                                          for row in top.indices.tolist()]
        torch.testing.assert_close(torch.tensor([list(d.values()) for d in got.top_logprobs[1:]]), top.values,
                                   rtol=0, atol=1e-5)
        want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.token_logprobs[1:]), want, rtol=0, atol=1e-5)


def test_echo_scoring_computes_a_shared_context_once(gpt2_init_dir):
    """lm-eval's multiple-choice requests (one context, each ending its own request, max_tokens 0,
    echo, logprobs): with the prefix cache the context runs through the model once (a forward hook
    counts the tokens), the log-probs and top alternatives equal a server without it (1e-5), and
    /metrics counts the tokens reused."""
    import re

    context = torch.randint(0, SMALL.n_vocab, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    endings = [[101, 7, 99], [202, 5, 17, 3, 8], [303], [404, 1, 2, 6]]
    results, runs = {}, []

    def loader():
        m = load_model(gpt2_init_dir)
        m.register_forward_hook(lambda mod, a, kw, o: runs.append(a[0].shape[1]), with_kwargs=True)
        return m, load_tokenizer(gpt2_init_dir)

    for tokens in (2048, 0):
        runs.clear()
        with live_server(loader, ServeOptions(served_model_name=NAME, prefix_cache_tokens=tokens)) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            results[tokens] = [client.completions.create(model=NAME, prompt=context + e, max_tokens=0, echo=True,
                                                         logprobs=2).choices[0].logprobs for e in endings]
            hits = float(re.search(r"^gpt2kit_prefix_cache_hit_tokens_total (\S+)$",
                                   httpx.get(url + "/metrics").text, re.M).group(1))
        if tokens:
            # The first prompt runs whole; each later one from the context's last token (the earlier
            # prompt went on past it, so the distribution there is computed again) to its end.
            assert runs == [40 + 3] + [1 + len(e) for e in endings[1:]]
            assert hits == 3 * 39
        else:
            assert runs == [40 + len(e) for e in endings] and hits == 0
    for got, want in zip(results[2048], results[0], strict=True):
        assert got.tokens == want.tokens and got.text_offset == want.text_offset
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(got.token_logprobs[1:]), torch.tensor(want.token_logprobs[1:]),
                                   rtol=0, atol=1e-5)
        assert [list(d) for d in got.top_logprobs[1:]] == [list(d) for d in want.top_logprobs[1:]]
        torch.testing.assert_close(torch.tensor([list(d.values()) for d in got.top_logprobs[1:]]),
                                   torch.tensor([list(d.values()) for d in want.top_logprobs[1:]]), rtol=0, atol=1e-5)


def _check_echo(client, model, tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = [tok.eot_token] + tok.encode(text)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "<|endoftext|>" + text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = score_text(model, tok, text).logprobs  # the score CLI's numbers (<|endoftext|> context)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), torch.tensor(want), rtol=0, atol=1e-5)
    # A prompt without <|endoftext|>: token i is scored given tokens [0, i) (OpenAI's convention).
    ids = tok.encode(text)
    r = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=2)
    got = r.choices[0].logprobs
    want = score_tokens(model, ids[1:], eot_token=ids[0])
    torch.testing.assert_close(torch.tensor(got.token_logprobs[1:]), torch.tensor(want), rtol=0, atol=1e-5)
    assert all(len(d) == 2 for d in got.top_logprobs[1:])
    assert got.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]


def _metric(url: str, name: str) -> float:
    import re

    return float(re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


def test_generation_starts_from_a_cached_prefix(model_dir, tok):
    """Completions whose prompts share a 40-token prefix: with the prefix cache (the default) the
    second prefills only past its 32 cached tokens (two blocks of 16; a hook on wte counts the
    prefilled tokens), its tokens equal a server without the cache and its log-probs within 1e-5;
    /metrics counts the lookups, the hits and the tokens reused."""
    prefix = torch.randint(0, SMALL.n_vocab, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = [prefix + [11, 12, 13], prefix + [21, 22]]
    results, prefilled = {}, []

    def loader():
        m = load_model(model_dir)
        m.wte.register_forward_hook(lambda mod, a, o: prefilled.append(a[0].numel()) if a[0].shape[1] > 1 else None)
        return m, load_tokenizer(model_dir)

    for tokens in (2048, 0):
        prefilled.clear()
        with live_server(loader, ServeOptions(served_model_name=NAME, prefix_cache_tokens=tokens)) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            results[tokens] = [client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0,
                                                         logprobs=2).choices[0] for p in prompts]
            counts = [_metric(url, f"gpt2kit_prefix_cache_{m}_total") for m in ("lookups", "hits", "hit_tokens")]
        if tokens:
            assert sum(prefilled) == 43 + 42 - 32 and counts == [2, 1, 32]
        else:
            assert sum(prefilled) == 43 + 42 and counts == [0, 0, 0]
    for got, want in zip(results[2048], results[0], strict=True):
        assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs.token_logprobs),
                                   torch.tensor(want.logprobs.token_logprobs), rtol=0, atol=1e-5)


def test_seeded_sample_same_with_and_without_concurrent_traffic(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=24, seed=1234, temperature=1.3, top_p=0.98, n=2)
    alone = [c.text for c in client.completions.create(**kw).choices]
    others = []

    def traffic(i):
        others.append(client.completions.create(model=NAME, prompt=f"Noise {i} " * (i + 1), max_tokens=30,
                                                temperature=1.0).choices[0].text)

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    busy = [c.text for c in client.completions.create(**kw).choices]
    for t in threads:
        t.join()
    assert busy == alone and len(others) == 5
    assert alone[0] != alone[1]  # two different samples
    assert [c.text for c in client.completions.create(**{**kw, "seed": 99}).choices] != alone


def test_penalties_and_logit_bias_match_the_library(client, model, tok):
    prompt = "The cat sat on the mat."
    for kw, settings in [
        ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
        ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        ({"logit_bias": {"262": 5.0}}, {"logit_bias": {262: 5.0}}),
        ({"extra_body": {"repetition_penalty": 1.3, "top_k": 5}}, {"repetition_penalty": 1.3, "top_k": 5}),
    ]:
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, **kw)
        s = SamplingSettings(max_new_tokens=16, temperature=0, **settings)
        assert r.choices[0].text == generate(model, prompt, s, tokenizer=tok)[0].text, kw
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    pen = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                    frequency_penalty=2.0).choices[0].text
    assert pen != plain
    forced = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0,
                                       logit_bias={"4930": 100}).choices[0].text
    assert forced == tok.decode([4930] * 5)


def test_n_and_best_of(client):
    kw = dict(model=NAME, prompt=["A", "B b"], max_tokens=8, seed=7, logprobs=0)
    four = client.completions.create(n=4, **kw)
    assert [c.index for c in four.choices] == list(range(8))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    for p in range(2):
        cands = four.choices[4 * p:4 * p + 4]
        ranked = sorted(cands, key=lambda c: -sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs))
        assert [c.text for c in best.choices[2 * p:2 * p + 2]] == [c.text for c in ranked[:2]]
    assert best.usage.completion_tokens == 64  # every candidate's tokens are counted


def test_top_logprobs_keys_never_collapse(tok):
    from gpt2kit.serve.logprobs import token_key, top_dict

    keys = [token_key(tok, t) for t in range(tok.n_vocab)]
    assert len(set(keys)) == tok.n_vocab  # distinct ids, distinct keys (byte tokens: "bytes:\\xNN")
    assert sum(k.startswith("bytes:") for k in keys) > 50
    assert tok.decode([161]) == tok.decode([162]) == "\ufffd"
    assert top_dict(tok, [(161, -1.0), (162, -2.0)]) == {keys[161]: -1.0, keys[162]: -2.0}
    assert keys[161] == "bytes:" + "".join(f"\\x{c:02x}" for c in tok.decode_bytes([161]))
    assert token_key(tok, 10**6) == "token_id:1000000"


# --- streaming --------------------------------------------------------------------------------

def test_stream_equals_non_stream_with_usage(server, client):
    url = server[0]
    body = dict(model=NAME, prompt="In the beginning", max_tokens=20, seed=5, n=2, logprobs=2, echo=True)
    full = client.completions.create(**body)
    chunks = sse(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full.usage.model_dump(exclude_none=True)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert joined(chunks[:-1], 2) == [c.text for c in full.choices]
    for i, choice in enumerate(full.choices):
        toks = [t for c in chunks[:-1] for ch in c["choices"] if ch["index"] == i for t in ch["logprobs"]["tokens"]]
        lps = [t for c in chunks[:-1] for ch in c["choices"] if ch["index"] == i
               for t in ch["logprobs"]["token_logprobs"]]
        assert toks == choice.logprobs.tokens and lps == choice.logprobs.token_logprobs
        reasons = [ch["finish_reason"] for c in chunks[:-1] for ch in c["choices"] if ch["index"] == i]
        assert reasons[-1] == choice.finish_reason and not any(reasons[:-1])
    # the openai client's own stream parser agrees
    streamed = client.completions.create(**{**body, "echo": False, "logprobs": None}, stream=True)
    texts = ["", ""]
    for ev in streamed:
        for ch in ev.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in client.completions.create(**{**body, "echo": False, "logprobs": None}).choices]


def _straddling_stops(text, tokens):
    """Stop strings made of the end of one token and the start of the next, first seen there."""
    out, at = [], 0
    for i, (a, b) in enumerate(zip(tokens, tokens[1:], strict=False)):
        at += len(a)
        if len(a) >= 2 and len(b) >= 2 and i >= 3:
            stop = a[-2:] + b[:2]
            if text.index(stop) == at - 2:
                out.append(stop)
    return out


def test_stop_strings_across_tokens_and_chunks(server, client):
    kw = dict(model=NAME, prompt="Tell me", max_tokens=40, temperature=0, logit_bias={"50256": -100})
    free = client.completions.create(**kw, logprobs=0).choices[0]
    stops = _straddling_stops(free.text, free.logprobs.tokens)
    assert len(stops) >= 2
    for stop in (stops[0], [stops[-1], "\x00never"]):
        first = stop if isinstance(stop, str) else stop[0]
        want = free.text[: free.text.index(first)]
        r = client.completions.create(**kw, stop=stop)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        chunks = sse(server[0], dict(kw, stop=stop, stream=True))
        pieces = [ch["text"] for c in chunks for ch in c["choices"]]
        assert "".join(pieces) == want and not any(first in p for p in pieces)
        assert len([p for p in pieces if p]) > 2  # the text did arrive in several chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# --- endpoints --------------------------------------------------------------------------------

def test_models_health_tokenize_detokenize_metrics(server, client, tok):
    url = server[0]
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = httpx.post(url + "/tokenize", json={"prompt": "héllo 😀"}).json()
    assert r["tokens"] == tok.encode("héllo 😀") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 64
    d = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "héllo 😀"
    split = [p for p in d["pieces"] if isinstance(p, list)]  # the emoji's bytes, split over tokens
    assert split and b"".join(bytes(p) for p in split) == " 😀".encode()
    assert d["pieces"] == r["pieces"]
    # the vocabulary's bound is in the document the 400 enforces: the last id decodes, the next is refused
    doc = httpx.get(url + "/openapi.json").json()["components"]["schemas"]
    assert doc["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0,
                                                                         "maximum": tok.n_vocab - 1}
    ids = doc["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == tok.n_vocab - 1
    assert httpx.post(url + "/detokenize", json={"tokens": [tok.n_vocab - 1]}).json()["prompt"] == tok.eot_text
    _err(httpx.post(url + "/detokenize", json={"tokens": [tok.n_vocab]}), 400, "tokens")
    m = httpx.get(url + "/metrics").text
    for name in ("gpt2kit_requests_total", "gpt2kit_generation_tokens_total", "gpt2kit_queue_length",
                 "gpt2kit_batch_size", "gpt2kit_time_to_first_token_seconds_bucket",
                 "gpt2kit_time_per_output_token_seconds_bucket", "gpt2kit_prompt_tokens_total"):
        assert name in m


def _err(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


@pytest.mark.parametrize("body,param,code", [
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature", None),
    ({"model": NAME, "prompt": "x", "logprobs": 6}, "logprobs", None),
    ({"model": NAME, "prompt": "x", "n": 0}, "n", None),
    ({"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"model": NAME, "prompt": "x", "n": 2, "best_of": 1}, "best_of", None),
    ({"model": NAME, "prompt": "x", "best_of": 2, "stream": True}, "best_of", None),
    ({"model": NAME, "prompt": [1, 99999999]}, "prompt", None),
    ({"model": NAME, "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", None),
    ({"model": NAME, "prompt": "x", "bogus": 1}, "bogus", None),
    ({"model": NAME, "prompt": "x", "max_tokens": 64}, "max_tokens", "context_length_exceeded"),
    ({"model": NAME, "prompt": "word " * 70}, "max_tokens", "context_length_exceeded"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, code):
    _err(httpx.post(server[0] + "/v1/completions", json=body), 400, param, code)


def test_error_statuses(server, client):
    url = server[0]
    _err(httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
         400)
    e = _err(httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model",
             "model_not_found")
    assert "gpt-4" in e["message"]
    _err(httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x" * (2 << 20)}), 413)
    _err(httpx.get(url + "/nowhere"), 404)
    _err(httpx.get(url + "/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="x", max_tokens=100)
    assert info.value.code == "context_length_exceeded"


def _slow(model_dir, delay):
    m = load_model(model_dir)
    # A forward hook that sleeps makes every model call slow (hooks also send decoding through the
    # modules), so the test can act while rows are in flight.
    m.wte.register_forward_hook(lambda *a: time.sleep(delay))
    return m, load_tokenizer(model_dir)


def test_overload_429_disconnect_and_a_free_event_loop(model_dir):
    opts = ServeOptions(served_model_name=NAME, max_batch=1, max_queue=1)
    with live_server(lambda: _slow(model_dir, 0.1), opts) as (url, app):
        engine = app.state.server.engine_loop.engine
        body = {"model": NAME, "prompt": "x", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r2:  # queued
                assert r2.status_code == 200
                t0 = time.monotonic()
                assert httpx.get(url + "/health").status_code == 200  # answered while the model decodes
                assert time.monotonic() - t0 < 2.5 and engine.n_running == 1  # decoding takes >= 5 s
                e = _err(httpx.post(url + "/v1/completions", json={**body, "stream": False}), 429)
                assert e["type"] == "rate_limit_error"
                assert httpx.post(url + "/v1/completions", json={**body, "stream": False}).headers["retry-after"]
            # r2 closed: its row is dropped (it was waiting or running)
        # r closed too: both rows leave the batch within a step or so (0.1 s each)
        t0 = time.monotonic()
        deadline = t0 + 3
        while (engine.n_running or engine.n_waiting) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.n_running == 0 and engine.n_waiting == 0
        assert app.state.server.outstanding == 0
        assert httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200


def test_loading_503_then_ready(model_dir):
    gate = threading.Event()

    def loader():
        gate.wait(30)
        return load_model(model_dir), load_tokenizer(model_dir)

    with live_server(loader, ServeOptions(served_model_name=NAME), wait_ready=False) as (url, app):
        e = _err(httpx.get(url + "/health"), 503, code="model_loading")
        assert e["type"] == "service_unavailable"
        _err(httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x"}), 503)
        gate.set()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2}).status_code \
            == 200


def test_api_key_and_chat_template(model_dir, tmp_path):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    opts = ServeOptions(served_model_name=NAME, api_key="s3cret", chat_template=template)
    with live_server(lambda: (load_model(model_dir), load_tokenizer(model_dir)), opts) as (url, app):
        assert httpx.get(url + "/health").status_code == 200  # no key needed
        for path in ("/v1/models", "/metrics"):
            _err(httpx.get(url + path), 401, code="invalid_api_key")
            _err(httpx.get(url + path, headers={"Authorization": "Bearer wrong"}), 401)
        c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert c.models.list().data[0].id == NAME
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()
        msgs = [{"role": "user", "content": "Hi there"}]
        chat = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
        same = c.completions.create(model=NAME, prompt="user: Hi there\nassistant:", max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == same.choices[0].text
        assert chat.choices[0].message.role == "assistant"


def test_cli_serve_errors(capsys, monkeypatch):
    import sys

    from gpt2kit.cli import main

    assert main(["serve", "--model", "/no/such/model", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpt2kit serve: error:") and "/no/such/model" in err[-1]
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--model", "x"]) == 1
    assert "pip install 'gpt2kit[serve]'" in capsys.readouterr().err


# --- transformers' warpers and constraints (extensions, vLLM's names where vLLM has the field) ----

def test_warpers_and_constraints_match_the_library(client, model, tok):
    from gpt2kit.sampling import bad_words_ids

    prompt = "The cat sat on the mat."
    for extra, settings in [
        ({"no_repeat_ngram_size": 2, "bad_words": ["the", " mat"], "suppress_tokens": [13]},
         {"no_repeat_ngram_size": 2, "suppress_tokens": (13,),
          "bad_words": bad_words_ids(tok, ["the", " mat"])}),
        ({"min_tokens": 12, "logit_bias": {"50256": 100.0}}, {"min_new_tokens": 12, "logit_bias": {50256: 100.0}}),
        ({"min_p": 0.05, "typical_p": 0.9, "epsilon_cutoff": 1e-4, "eta_cutoff": 1e-3, "temperature": 1.0,
          "seed": 4}, {"min_p": 0.05, "typical_p": 0.9, "epsilon_cutoff": 1e-4, "eta_cutoff": 1e-3, "temperature": 1.0,
                       "seed": 4}),
    ]:
        kw = {"temperature": 0, **{k: extra.pop(k) for k in ("temperature", "seed", "logit_bias") if k in extra}}
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, extra_body=extra, **kw)
        s = SamplingSettings(max_new_tokens=16, **{"temperature": 0, **settings})
        want = generate(model, prompt, s, tokenizer=tok)[0]
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason, extra
        without = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, **kw).choices[0]
        assert (without.text, without.finish_reason) != (want.text, want.finish_reason), extra  # they changed it


def test_ignore_eos_generates_past_the_end_of_text_token(client, model, tok):
    """vLLM's ignore_eos: a row whose every step picks <|endoftext|> (logit_bias) stops at once without
    it and runs to max_tokens with it, as the library does with no stop token ids."""
    kw = dict(model=NAME, prompt="Hi", max_tokens=6, temperature=0, logit_bias={"50256": 100})
    stopped = client.completions.create(**kw).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("", "stop")
    r = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    want = generate(model, "Hi", SamplingSettings(max_new_tokens=6, temperature=0, logit_bias={50256: 100.0},
                                                  stop_token_ids=()), tokenizer=tok)[0]
    assert r.finish_reason == "length" == want.finish_reason and r.text == want.text == tok.eot_text * 6
    usage = client.completions.create(**kw, extra_body={"ignore_eos": True}).usage
    assert usage.completion_tokens == 6


@pytest.mark.parametrize("extra,param,needle", [
    ({"typical_p": 0}, "typical_p", "greater than 0"),
    ({"typical_p": 1.5}, "typical_p", "less than or equal to 1"),
    ({"min_p": -0.5}, "min_p", "greater than or equal to 0"),
    ({"epsilon_cutoff": 1}, "epsilon_cutoff", "less than 1"),
    ({"eta_cutoff": 1.0}, "eta_cutoff", "less than 1"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size", "greater than or equal to 0"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"bad_words": [""]}, "bad_words.0", "at least 1 character"),
    ({"bad_words": "the"}, "bad_words", "valid list"),
    ({"suppress_tokens": [-3]}, "suppress_tokens.0", "greater than or equal to 0"),
    ({"bad_words": ["  "]}, "bad_words", "bad_words entry '  ' is only whitespace"),
    ({"bad_words": ["\x85"]}, "bad_words", "bad_words entry '\\x85' is only whitespace"),
    ({"min_tokens": 9}, "min_tokens", "min_tokens must be an integer in [0, max_tokens=8], got 9"),
    ({"suppress_tokens": [50257]}, "suppress_tokens",
     "suppress_tokens token id 50257 is outside the vocabulary [0, 50257)"),
])
def test_warper_and_constraint_values_out_of_range_are_400(server, extra, param, needle):
    r = httpx.post(server[0] + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 8, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert needle in body["error"]["message"], body
