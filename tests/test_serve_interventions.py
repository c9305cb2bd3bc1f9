"""A request's `interventions` on the server (gpt2kit.serve.interventions): 8 concurrent requests, half
with their own interventions and half plain, each equal to its run alone and to the library's
generate with the same interventions; the plain ones equal to a server without interventions (text
exactly, log-probs within 1e-5: concurrent requests meet in batches of varying composition); bad
input a 400 naming the field."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from helpers import live_server, varied_model

pytest.importorskip("fastapi")
import httpx

from gpt2kit import SamplingSettings, generate
from gpt2kit.serve import ServeOptions
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import ablate, steer

NAME = "m"
PROMPTS = ["The cat", "Once upon a time", "Hello", "A B C"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("iv")
    vec = torch.randn(32, generator=torch.Generator().manual_seed(5)) * 2
    np.save(d / "love.npy", vec.numpy())
    np.save(d / "hate.npy", (-vec).numpy())
    model = varied_model()
    return model, d, vec


def _opts(d, allow=True, **kw):
    return ServeOptions(served_model_name=NAME, max_batch=8, pack_weights=False, allow_interventions=allow,
                        steer_vectors=(f"love={d / 'love.npy'}", f"hate={d / 'hate.npy'}"), **kw)


def _body(prompt, ivs=None, **kw):
    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    if ivs is not None:
        body["interventions"] = ivs
    return {**body, **kw}


def _post(url, body):
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    return r.status_code, r.json()


def _seen(resp):
    c = resp["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


def test_concurrent_requests_with_and_without_interventions(setup):
    model, d, vec = setup
    specs = [["h.1.resid:love*3"], None, ["h.1.attn.head.2", "h.0.resid:hate*2"], None,
             ["h.1.resid:hate"], None, ["h.1.mlp"], None]
    bodies = [_body(PROMPTS[i % 4], s) for i, s in enumerate(specs)]
    loader = lambda: (model, Tokenizer.default())  # noqa: E731
    with live_server(loader, _opts(d)) as (url, _):
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            together = list(ex.map(lambda b: _post(url, b), bodies))
        alone = [_post(url, b) for b in bodies]
    with live_server(loader, ServeOptions(served_model_name=NAME, max_batch=8, pack_weights=False)) as (url, _):
        plain = [_post(url, b) if s is None else None for b, s in zip(bodies, specs, strict=True)]
    tok = Tokenizer.default()
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=12, stop_token_ids=())
    lib = {"h.1.resid:love*3": [steer("h.1.resid", vec, 3.0)],
           "h.1.attn.head.2": [ablate("h.1.attn.head.2"), steer("h.0.resid", -vec, 2.0)],
           "h.1.resid:hate": [steer("h.1.resid", -vec, 1.0)], "h.1.mlp": [ablate("h.1.mlp")]}
    changed = 0
    for i, s in enumerate(specs):
        assert together[i][0] == 200 and alone[i][0] == 200, together[i]
        assert _seen(together[i][1])[0] == _seen(alone[i][1])[0]
        np.testing.assert_allclose(_seen(together[i][1])[1], _seen(alone[i][1])[1], atol=1e-5)
        if s is None:
            # the same text; log-probs to float rounding, as any two batch compositions (a row's numbers beside
            # the same neighbours are bit for bit: test_trace_steering's engine test)
            assert _seen(together[i][1])[0] == _seen(plain[i][1])[0]
            np.testing.assert_allclose(_seen(together[i][1])[1], _seen(plain[i][1])[1], atol=1e-5)
        else:
            want = generate(model, PROMPTS[i % 4], greedy, tokenizer=tok, interventions=lib[s[0]])[0].text
            assert _seen(together[i][1])[0] == want
            changed += want != generate(model, PROMPTS[i % 4], greedy, tokenizer=tok)[0].text
    assert changed >= 3  # the interventions change the text: the comparisons can fail


def test_bad_interventions_are_400s_naming_the_field(setup, tmp_path):
    model, d, _ = setup
    loader = lambda: (model, Tokenizer.default())  # noqa: E731
    with live_server(loader, _opts(d, max_interventions=2)) as (url, _):
        cases = [(["h.1.resid:/etc/passwd*2"], "names a file"), (["h.1.resid:love.npy"], "names a file"),
                 (["h.1.resid:joy"], "unknown vector 'joy'"), (["h.1.mlp.pre:love"], "takes (128,)"),
                 (["h.7.resid"], "outside"), (["h.1.nothing"], "unknown name"),
                 (["h.1.mlp", "h.0.mlp", "h.1.attn"], "at most 2"), (["clamp:x:1=2"], "unknown SAE"),
                 (["h.1.attn.scores"], "derived")]
        for ivs, needle in cases:
            code, body = _post(url, _body("Hi", ivs))
            assert code == 400 and body["error"]["param"] == "interventions" and needle in body["error"]["message"], \
                (ivs, body)
        code, body = _post(url, _body("Hi", ["h.1.mlp"], n=2, use_beam_search=True))
        assert code == 400 and body["error"]["param"] == "interventions"
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                             "interventions": ["h.1.resid:nope"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "interventions"
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                             "temperature": 0, "interventions": ["h.1.resid:love*3"]})
        assert r.status_code == 200, r.text
    with live_server(loader, _opts(d, allow=False)) as (url, _):
        code, body = _post(url, _body("Hi", ["h.1.mlp"]))
        assert code == 400 and body["error"]["param"] == "interventions" and "--allow-interventions" in \
            body["error"]["message"]
        assert _post(url, _body("Hi"))[0] == 200
