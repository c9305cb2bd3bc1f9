"""Beam search and contrastive search through gpt2kit serve (serve/search.py): a beam request runs
as rows of the one engine beside a greedy request — the greedy tokens are its solo run's, the beams
the Python API's (text and order exactly, scores within 1e-4); contrastive search is the Python
API's; every bad combination is a 400 naming the field."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import live_server, varied_model  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.config import GPT2Config  # noqa: E402
from gpt2kit.generation import generate  # noqa: E402
from gpt2kit.sampling import SamplingSettings  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402

CFG = GPT2Config(n_vocab=50257, n_ctx=128, n_embd=32, n_head=4, n_layer=2)
NAME = "tiny"
GREEDY_PROMPT, BEAM_PROMPTS = "The cat sat on the mat and", ["Once upon a time", "def f(x):"]


class Gate:
    """A forward hook on wte that, once armed, holds the engine's worker at its next forward until
    opened (so the test decides which rows share a step, with no timing), and records each forward's
    rows and shape (rows, tokens)."""

    def __init__(self) -> None:
        self.armed, self.entered, self.open = threading.Event(), threading.Event(), threading.Event()
        self.rows: list[int] = []
        self.shapes: list[tuple[int, int]] = []

    def arm(self) -> None:
        self.entered.clear()
        self.open.clear()
        self.armed.set()

    def release(self) -> None:
        self.open.set()
        self.armed.clear()

    def __call__(self, _module, inputs, _out) -> None:
        self.rows.append(inputs[0].shape[0])
        self.shapes.append(tuple(inputs[0].shape))
        if self.armed.is_set() and not self.open.is_set():
            self.entered.set()
            self.open.wait(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(varied_model(CFG, seed=1), d)
    return str(d)


@pytest.fixture(scope="module")
def library(model_dir):
    return load_model(model_dir), load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def gated(model_dir):
    gate = Gate()

    def loader():
        m = load_model(model_dir)
        m.wte.register_forward_hook(gate)
        return m, load_tokenizer(model_dir)

    with live_server(loader, ServeOptions(served_model_name=NAME, max_batch=8, max_queue=16)) as (url, app):
        yield url, app, gate


def _post(url, **body):
    return httpx.post(url + "/v1/completions", json={"model": NAME, **body}, timeout=300)


def _ok(url, **body):
    r = _post(url, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _in_thread(fn, *args, **kw):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args, **kw)), daemon=True)
    t.start()
    return t, out


def _wait_for(cond, what):
    deadline = time.monotonic() + 300
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_beam_request_beside_a_greedy_one(gated, library):
    url, app, gate = gated
    model, tok = library
    greedy_s = SamplingSettings(max_new_tokens=24, temperature=0)
    solo = generate(model, GREEDY_PROMPT, greedy_s, tokenizer=tok)[0]
    assert len(solo.tokens) >= 8  # the greedy row is still running when the beams join (below)
    beam_s = SamplingSettings(max_new_tokens=10, num_beams=3, num_return_sequences=2, length_penalty=0.7,
                              early_stopping=True)
    want = generate(model, BEAM_PROMPTS, beam_s, tokenizer=tok)

    loop = app.state.server.engine_loop
    gate.arm()
    greedy_t, greedy = _in_thread(_ok, url, prompt=GREEDY_PROMPT, max_tokens=24, temperature=0)
    assert gate.entered.wait(300)  # the greedy row's prefill is held at the gate
    start = len(gate.rows)
    beam_t, beam = _in_thread(_ok, url, prompt=BEAM_PROMPTS, max_tokens=10, n=2, best_of=3, use_beam_search=True,
                              length_penalty=0.7, early_stopping=True)
    _wait_for(lambda: loop.n_waiting == 6, "the beam rows are queued")  # 2 prompts x 3 beams
    gate.release()
    greedy_t.join(300)
    beam_t.join(300)

    assert max(gate.rows[start:]) == 7  # one decode step held the greedy row and both groups' beams
    g = greedy["r"]["choices"][0]
    assert (g["text"], g["finish_reason"]) == (solo.text, solo.finish_reason)
    got = beam["r"]["choices"]
    assert [c["index"] for c in got] == [0, 1, 2, 3]
    for c, w in zip(got, want, strict=True):
        assert (c["text"], c["finish_reason"]) == (w.text, w.finish_reason)
        assert abs(c["score"] - w.score) < 1e-4
    assert got[0]["score"] >= got[1]["score"] and got[2]["score"] >= got[3]["score"]  # beam order
    assert beam["r"]["usage"]["completion_tokens"] == sum(len(w.tokens) for w in want)
    assert "score" not in g and "system_fingerprint" in greedy["r"]  # other responses keep their shape


def test_beam_width_from_n_and_echo(gated, library):
    url, model, tok = gated[0], *library
    want = generate(model, [BEAM_PROMPTS[0]], SamplingSettings(max_new_tokens=8, num_beams=2,
                                                               num_return_sequences=2), tokenizer=tok)
    got = _ok(url, prompt=BEAM_PROMPTS[0], max_tokens=8, n=2, use_beam_search=True, echo=True)["choices"]
    assert [c["text"] for c in got] == [BEAM_PROMPTS[0] + w.text for w in want]
    one = generate(model, [BEAM_PROMPTS[1]], SamplingSettings(max_new_tokens=8, temperature=0), tokenizer=tok)[0]
    c = _ok(url, prompt=BEAM_PROMPTS[1], max_tokens=8, use_beam_search=True)["choices"]  # one beam: greedy's text
    assert [x["text"] for x in c] == [one.text] and isinstance(c[0]["score"], float)


def test_contrastive_search_equals_the_python_api(gated, library):
    url, model, tok = gated[0], *library
    s = SamplingSettings(max_new_tokens=20, penalty_alpha=0.9, top_k=4)
    for prompts in (BEAM_PROMPTS[0], BEAM_PROMPTS):
        want = generate(model, prompts, s, tokenizer=tok)
        got = _ok(url, prompt=prompts, max_tokens=20, penalty_alpha=0.9, top_k=4, temperature=0.7)["choices"]
        assert [(c["text"], c["finish_reason"]) for c in got] == [(w.text, w.finish_reason) for w in want]
        assert [c["index"] for c in got] == list(range(len(want))) and all("score" not in c for c in got)
    greedy = generate(model, BEAM_PROMPTS, SamplingSettings(max_new_tokens=20, temperature=0), tokenizer=tok)
    assert all(w.text != g.text for w, g in zip(want, greedy, strict=True))  # contrastive search changed them


def test_contrastive_search_takes_turns_with_the_engines_rows(gated, library):
    """Its steps run on the engine's worker between the engine's steps, one each (its 4 candidates
    one forward of 4 tokens in its slot): the greedy row beside it is not held up for the search's
    length, and its tokens are its solo run's."""
    url, app, gate = gated
    model, tok = library
    solo = generate(model, GREEDY_PROMPT, SamplingSettings(max_new_tokens=24, temperature=0), tokenizer=tok)[0]
    want = generate(model, BEAM_PROMPTS[1], SamplingSettings(max_new_tokens=12, penalty_alpha=0.9, top_k=4),
                    tokenizer=tok)[0]
    server = app.state.server
    gate.arm()
    greedy_t, greedy = _in_thread(_ok, url, prompt=GREEDY_PROMPT, max_tokens=24, temperature=0)
    assert gate.entered.wait(300)
    start = len(gate.shapes)
    search_t, found = _in_thread(_ok, url, prompt=BEAM_PROMPTS[1], max_tokens=12, penalty_alpha=0.9, top_k=4)
    _wait_for(lambda: server.outstanding == 1 + 1, "the contrastive job is admitted")  # one slot for its prompt
    gate.release()
    greedy_t.join(300)
    search_t.join(300)
    shapes = gate.shapes[start:]
    steps = [(1, 4), (1, 1), (1, 4)]  # a greedy decode step between two of its steps
    assert any(shapes[i:i + 3] == steps for i in range(len(shapes))), shapes
    assert greedy["r"]["choices"][0]["text"] == solo.text
    assert found["r"]["choices"][0]["text"] == want.text


def _error(r, param: str, needle: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_the_widest_beam_search_leaves_room_for_other_rows(gated, library):
    """A prompt's beams run at once, so their width is at most half of --max-batch (8 here): a
    small request sent while the widest beam search runs decodes beside it, not after it."""
    url, app, gate = gated
    model, tok = library
    loop = app.state.server.engine_loop
    _error(_post(url, prompt="Hi", max_tokens=None, use_beam_search=True, n=8), "n", "runs at most 4 per prompt")
    solo = generate(model, GREEDY_PROMPT, SamplingSettings(max_new_tokens=4, temperature=0), tokenizer=tok)[0]
    gate.arm()
    beam_t, beam = _in_thread(_ok, url, prompt=BEAM_PROMPTS[0], max_tokens=60, use_beam_search=True, n=4)
    assert gate.entered.wait(300)  # the beams' prefill is held
    start = len(gate.rows)
    small_t, small = _in_thread(_ok, url, prompt=GREEDY_PROMPT, max_tokens=4, temperature=0)
    _wait_for(lambda: loop.n_waiting == 1, "the small request is queued")
    gate.release()
    small_t.join(300)
    beam_t.join(300)
    assert 5 in gate.rows[start:]  # a decode step held the 4 beams and the small request's row
    assert small["r"]["choices"][0]["text"] == solo.text and len(beam["r"]["choices"]) == 4


def _storage(cache) -> int:
    return cache.kv.untyped_storage().data_ptr()


def test_contrastive_search_holds_one_slot_per_prompt_and_leaves_room(gated, library):
    """Its keys and values live in the server's reserved cache (one slot per prompt, top_k at most
    half of --max-batch), and a request as large as one request may be (half the rows: 12 of 8 + 16)
    leaves room: a small request sent meanwhile is admitted, not 429."""
    url, app, gate = gated
    model, tok = library
    server = app.state.server
    _error(_post(url, prompt="x", max_tokens=None, penalty_alpha=0.6, top_k=24), "top_k", "compares at most 4")
    _error(_post(url, prompt=["x"] * 13, max_tokens=8, penalty_alpha=0.6, top_k=4), "prompt", "at most 12")
    want = generate(model, "x", SamplingSettings(max_new_tokens=127, penalty_alpha=0.6, top_k=4), tokenizer=tok)[0]
    solo = generate(model, GREEDY_PROMPT, SamplingSettings(max_new_tokens=4, temperature=0), tokenizer=tok)[0]
    pool = server.engine_loop.engine.pool
    caches: set[int] = set()  # the storage of every cache attention reads
    hook = server.model.h[0].attn.register_forward_pre_hook(lambda _m, args: caches.add(_storage(args[2])))
    try:
        gate.arm()
        big_t, big = _in_thread(_ok, url, prompt=["x"] * 12, max_tokens=None, penalty_alpha=0.6, top_k=4)
        assert gate.entered.wait(300)  # its first prompt's prefill, in its slot, is held
        assert (server.outstanding, server.engine_loop.n_running) == (12, 8)  # 8 slots held, 4 prompts wait
        small_t, small = _in_thread(_ok, url, prompt=GREEDY_PROMPT, max_tokens=4, temperature=0)
        _wait_for(lambda: server.outstanding == 13, "the small request is admitted")
        gate.release()
        small_t.join(300)
        big_t.join(300)
    finally:
        gate.release()
        hook.remove()
    assert small["r"]["choices"][0]["text"] == solo.text
    assert [c["text"] for c in big["r"]["choices"]] == [want.text] * 12
    assert caches == {_storage(pool)}  # no keys or values outside the reserved slots


@pytest.mark.parametrize("extra", [dict(use_beam_search=True, n=3), dict(penalty_alpha=0.9, top_k=4)])
def test_a_client_gone_ends_its_search(gated, extra):
    url, app, gate = gated
    server, loop = app.state.server, app.state.server.engine_loop
    gate.arm()
    held_t, _ = _in_thread(_ok, url, prompt=GREEDY_PROMPT, max_tokens=4, temperature=0)
    assert gate.entered.wait(300)
    with pytest.raises(httpx.ReadTimeout):  # the worker is held at the gate: the search cannot finish
        httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 30, **extra},
                   timeout=httpx.Timeout(300, read=1.0))
    _wait_for(lambda: server.outstanding == 1, "the search's rows are released")  # the held greedy row's alone
    gate.release()
    held_t.join(300)
    _wait_for(lambda: server.outstanding == 0 and loop.n_running == 0 and loop.n_waiting == 0, "the engine is idle")
    assert _ok(url, prompt="Hi", max_tokens=4, **extra)["choices"]  # and the server goes on


BAD = [
    ({"use_beam_search": True, "n": 2, "stream": True}, "stream", "stream is not defined for beam search"),
    ({"use_beam_search": True, "best_of": 5}, "best_of", "at most 4 per prompt (half of --max-batch 8"),
    ({"use_beam_search": True, "n": 5}, "n", "with 5 beams: this server runs at most 4"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of", "best_of (2) must be >= n (3)"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs", "logprobs are not reported for beam search"),
    ({"use_beam_search": True, "stop": "x"}, "stop", "takes no stop_strings"),
    ({"use_beam_search": True, "n": 2, "presence_penalty": 1.0}, "presence_penalty", "takes no presence_penalty"),
    ({"use_beam_search": True, "n": 2, "min_tokens": 2}, "min_tokens", "takes no min_new_tokens"),
    ({"use_beam_search": True, "best_of": 2, "logit_bias": {"5": 1}}, "logit_bias", "takes no logit_bias"),
    ({"penalty_alpha": 0.5, "top_k": 4, "stop": ["x"]}, "stop", "takes no stop_strings"),
    ({"penalty_alpha": 0.5, "top_k": 4, "repetition_penalty": 1.2}, "repetition_penalty", "takes no repetition"),
    ({"use_beam_search": True, "length_penalty": 0.5, "suppress_tokens": [5]}, "suppress_tokens",
     "takes no suppress_tokens"),
    ({"use_beam_search": True, "penalty_alpha": 0.5, "top_k": 4}, "penalty_alpha", "two decoding methods"),
    ({"length_penalty": 2.0}, "length_penalty", "length_penalty applies to beam search only"),
    ({"early_stopping": True}, "early_stopping", "early_stopping applies to beam search only"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping", "never"),
    ({"use_beam_search": True, "length_penalty": 101}, "length_penalty", "less than or equal to 100"),
    ({"penalty_alpha": 1.5, "top_k": 4}, "penalty_alpha", "less than or equal to 1"),
    ({"penalty_alpha": -0.1, "top_k": 4}, "penalty_alpha", "greater than or equal to 0"),
    ({"penalty_alpha": 0.5}, "top_k", "chooses among top_k > 1 candidates, got top_k=None"),
    ({"penalty_alpha": 0.5, "top_k": 4, "n": 2}, "n", "contrastive search (penalty_alpha) is deterministic"),
    ({"penalty_alpha": 0.5, "top_k": 4, "stream": True}, "stream", "stream is not defined for contrastive"),
    ({"penalty_alpha": 0.5, "top_k": 100}, "top_k", "over top_k=100 candidates: this server compares at most 4"),
    ({"penalty_alpha": 0.5, "top_k": 5}, "top_k", "at most 4 (half of --max-batch 8"),
]


@pytest.mark.parametrize("extra, param, needle", BAD)
def test_bad_search_requests_are_400_naming_the_field(gated, extra, param, needle):
    r = _post(gated[0], prompt="Hi", max_tokens=8, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and needle in err["message"], err


TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
RENDERED = "user: Once upon a time\nassistant:"  # TEMPLATE over MESSAGES


@pytest.fixture(scope="module")
def chat_url(model_dir):
    opts = ServeOptions(served_model_name=NAME, max_batch=8, max_queue=16, chat_template=TEMPLATE)
    with live_server(lambda: (load_model(model_dir), load_tokenizer(model_dir)), opts) as (url, _app):
        yield url


def _chat(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, **body}, timeout=300)


@pytest.mark.parametrize("extra", [
    dict(use_beam_search=True, n=2, best_of=3, length_penalty=0.7, early_stopping=True),
    dict(use_beam_search=True, n=2, early_stopping="never"),
    dict(penalty_alpha=0.9, top_k=4),
    dict(temperature=0.8, seed=3, top_k=20, min_p=0.05, typical_p=0.9, no_repeat_ngram_size=2, min_tokens=4,
         repetition_penalty=1.3, bad_words=["the"], suppress_tokens=[13], top_p_mode="hf", top_p=0.9),
])
def test_chat_takes_the_search_and_warper_fields_of_completions(chat_url, library, extra):
    """The chat endpoint completes its rendered messages as /v1/completions completes that prompt,
    the same extensions included: the same choices, in the same order, with the beams' scores."""
    model, tok = library
    r = _chat(chat_url, max_tokens=10, **extra)
    assert r.status_code == 200, r.text
    got = r.json()["choices"]
    want = _ok(chat_url, prompt=RENDERED, max_tokens=10, **extra)["choices"]
    assert [(c["message"]["content"], c["finish_reason"], c["index"]) for c in got] == \
        [(c["text"], c["finish_reason"], c["index"]) for c in want]
    assert [c.get("score") for c in got] == [c.get("score") for c in want]
    if extra.get("use_beam_search"):  # and they are the Python API's beams
        api = generate(model, RENDERED, SamplingSettings(
            max_new_tokens=10, num_beams=extra.get("best_of", extra["n"]), num_return_sequences=extra["n"],
            length_penalty=extra.get("length_penalty", 1.0), early_stopping=extra["early_stopping"]), tokenizer=tok)
        assert [c["message"]["content"] for c in got] == [w.text for w in api]
        assert all(abs(c["score"] - w.score) < 1e-4 for c, w in zip(got, api, strict=True))
    else:
        assert all("score" not in c for c in got)  # other responses keep their shape


@pytest.mark.parametrize("extra, param, needle", [b for b in BAD if not {"stream", "logprobs"} & set(b[0])])
def test_bad_search_requests_on_chat_are_completions_400s(chat_url, extra, param, needle):
    r = _chat(chat_url, max_tokens=8, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and needle in err["message"], err
    assert err == _post(chat_url, prompt=RENDERED, max_tokens=8, **extra).json()["error"]


def test_chat_refuses_what_completions_alone_has(chat_url):
    for extra in ({"use_beam_search": True, "stream": True}, {"logprobs": 2}, {"echo": True}):
        r = _chat(chat_url, max_tokens=8, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("stream", "logprobs", "echo"), r.text
