"""gpt2kit serve with --prompt-lookup / --draft-model: every greedy request speculates, and every
response is the one the plain engine gives (greedy token for token; sampled rows stay plain)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import live_server, random_model, varied_model  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.config import GPT2Config  # noqa: E402
from gpt2kit.generation import generate  # noqa: E402
from gpt2kit.sampling import SamplingSettings  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402

CFG = GPT2Config(n_vocab=50257, n_ctx=128, n_embd=32, n_head=4, n_layer=2)
PROMPTS = ["the cat sat on the mat and the cat", "def f(x):\n    return x\n\ndef f(", "Hello"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for name, model in (("target", random_model(CFG, seed=3)), ("draft", varied_model(CFG, seed=4))):
        d = tmp_path_factory.mktemp(name)
        save_model(model, d)
        out[name] = str(d)
    return out


def _complete(url, prompt, **kw):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("opts", [dict(prompt_lookup=4), dict(draft_model="DRAFT", draft_tokens=3)])
def test_speculating_server_answers_what_the_plain_engine_gives(dirs, opts):
    opts = {k: dirs["draft"] if v == "DRAFT" else v for k, v in opts.items()}
    model, tok = load_model(dirs["target"]), load_tokenizer(dirs["target"])
    with live_server(lambda: (load_model(dirs["target"]), load_tokenizer(dirs["target"])),
                     ServeOptions(served_model_name="tiny", **opts)) as (url, app):
        for prompt in PROMPTS:
            want = generate(model, [prompt], SamplingSettings(max_new_tokens=30, temperature=0), tokenizer=tok)[0]
            got = _complete(url, prompt, max_tokens=30, temperature=0)
            assert (got["text"], got["finish_reason"]) == (want.text, want.finish_reason)
        s = SamplingSettings(max_new_tokens=20, temperature=0.9, seed=5)
        want = generate(model, [PROMPTS[0]], s, tokenizer=tok)[0]  # sampled: the plain engine, same seed
        assert _complete(url, PROMPTS[0], max_tokens=20, temperature=0.9, seed=5)["text"] == want.text
        long = "word " * 100  # 101 tokens + 25 fit in n_ctx, + the drafts do not: the plain engine
        want = generate(model, [long], SamplingSettings(max_new_tokens=25, temperature=0), tokenizer=tok)[0]
        assert _complete(url, long, max_tokens=25, temperature=0)["text"] == want.text
        beams = generate(model, [PROMPTS[0]], SamplingSettings(max_new_tokens=10, num_beams=2, num_return_sequences=2),
                         tokenizer=tok)  # beams (greedy or not) run on the plain engine: the Python API's
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "n": 2,
                                                      "use_beam_search": True, "temperature": 0}, timeout=120)
        assert [c["text"] for c in r.json()["choices"]] == [b.text for b in beams]
        engine = app.state.server.engine_loop.engine
        spec = engine.spec  # the one engine's speculating rows
        assert engine.n_running == 0 and not engine.has_work and spec.drafted > 0 and 0 <= spec.accepted <= spec.drafted


def test_server_refuses_both_or_bad_counts():
    with pytest.raises(ValueError, match="not both"):
        ServeOptions(draft_model="x", prompt_lookup=2)
    with pytest.raises(ValueError, match=r"draft_tokens must be an integer in \[1, 64\]"):
        ServeOptions(draft_tokens=0)


def test_a_failing_draft_fails_its_requests_alone_and_promptly(dirs, monkeypatch, tmp_path):
    """The start-up check bypassed, a draft whose cache cannot be had (its context shorter than the
    target's): the greedy requests it takes get an error at once, not a hang; sampled requests beside
    them get their own completions; /metrics counts no row once every request is answered."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    from gpt2kit.engine import speculate

    short = tmp_path / "short"
    save_model(varied_model(CFG.replace(n_ctx=32), seed=4), short)
    monkeypatch.setattr(speculate, "check_draft_model", lambda *a: None)
    model, tok = load_model(dirs["target"]), load_tokenizer(dirs["target"])
    sampled = [dict(max_tokens=30, temperature=0.9, seed=s) for s in (5, 6)]
    want = [generate(model, [PROMPTS[0]], SamplingSettings(max_new_tokens=30, temperature=0.9, seed=kw["seed"]),
                     tokenizer=tok)[0].text for kw in sampled]

    def post(prompt, **kw):  # a request that hangs fails the test at its timeout
        return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, **kw}, timeout=120)

    with live_server(lambda: (load_model(dirs["target"]), load_tokenizer(dirs["target"])),
                     ServeOptions(served_model_name="tiny", draft_model=str(short))) as (url, app):
        for _ in range(2):  # the engine goes on serving after the failure
            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(post, PROMPTS[0], **kw) for kw in sampled]
                futures.append(pool.submit(post, "Hi", max_tokens=10, temperature=0))
                *plain, greedy = [f.result() for f in futures]
            assert [(r.status_code, r.json()["choices"][0]["text"]) for r in plain] == [(200, t) for t in want]
            assert greedy.status_code == 500 and greedy.json()["error"]["message"] == "generation failed"
        metrics = httpx.get(url + "/metrics").text
        counts = {name: float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))
                  for name in ("gpt2kit_batch_size", "gpt2kit_queue_length")}
        assert counts == {"gpt2kit_batch_size": 0.0, "gpt2kit_queue_length": 0.0}
        engine = app.state.server.engine_loop.engine
        assert not engine.has_work and not engine.spec.rows
