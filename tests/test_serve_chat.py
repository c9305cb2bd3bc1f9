"""/v1/chat/completions (serve/chat.py, serve/template.py) against the official openai client and raw
SSE, on loopback, with a tiny random model saved and loaded through the real checkpoint loader: the template in use (the
default transcript, the model's own, --chat-template's), and chat completions whole and streamed,
each compared with /v1/completions on the rendered prompt."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import SMALL, live_server, varied_model  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402
from gpt2kit.serve.schemas import ChatRequest  # noqa: E402
from gpt2kit.serve.template import DEFAULT_TEMPLATE, TURN_STOPS, model_template, render  # noqa: E402

NAME = "tiny"
MESSAGES = [{"role": "system", "content": "A chat between two friends."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
RENDERED = "A chat between two friends.\n\nUser: Hi there\nAssistant: Hello!\nUser: How are you?\nAssistant:"
OWN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(varied_model(SMALL, seed=0), d)
    return d


def _serve(model_dir, **opts):
    return live_server(lambda: (load_model(model_dir), load_tokenizer(model_dir)),
                       ServeOptions(served_model_name=NAME, **opts))


@pytest.fixture(scope="module")
def server(model_dir):
    with _serve(model_dir) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_default_template_is_a_plain_transcript():
    body = ChatRequest(model=NAME, messages=MESSAGES)
    assert render(DEFAULT_TEMPLATE, body, "<|endoftext|>") == RENDERED
    body = ChatRequest(model=NAME, messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}])
    assert render(DEFAULT_TEMPLATE, body, "<|endoftext|>") == "User: Hi\nAssistant: \nAssistant:"
    assert TURN_STOPS == ("\nUser:",)
    docs = (Path(__file__).parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    assert f"   {DEFAULT_TEMPLATE}\n" in docs  # the page shows the template that serves


def test_without_a_template_chat_completes_the_default_transcript(server, client):
    assert server[1].state.server.chat_stops == TURN_STOPS
    kw = dict(model=NAME, max_tokens=12, temperature=0)
    chat = client.chat.completions.create(messages=MESSAGES, **kw)
    same = client.completions.create(prompt=RENDERED, stop=list(TURN_STOPS), **kw)
    assert chat.choices[0].message.content == same.choices[0].text and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == same.choices[0].finish_reason
    assert chat.usage == same.usage and chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"


def test_the_default_templates_turn_stops_end_the_answer(server, client):
    """The template's stops reach the completion: with a stop the greedy answer is known to reach,
    the answer ends before it with finish_reason "stop", as /v1/completions does with that stop."""
    kw = dict(model=NAME, max_tokens=12, temperature=0)
    free = client.completions.create(prompt=RENDERED, **kw).choices[0].text
    word = free.split(" ")[3]
    assert word and free.index(word) > 0
    state = server[1].state.server
    try:
        state.chat_stops = (word,)
        chat = client.chat.completions.create(messages=MESSAGES, **kw).choices[0]
    finally:
        state.chat_stops = TURN_STOPS
    assert chat.message.content == free[: free.index(word)] and chat.finish_reason == "stop"


def _sse(url, body):
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_streamed_chat_is_openais_chunk_format(server, client):
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=12, n=2, seed=3)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))  # the openai client's own parser
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    for choice in whole.choices:
        mine = [ch for c in chunks for ch in c.choices if ch.index == choice.index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""  # the role comes first
        assert all(ch.delta.role is None for ch in mine[1:])
        assert "".join(ch.delta.content or "" for ch in mine) == choice.message.content
        assert len([ch for ch in mine if ch.delta.content]) > 2  # the content did arrive in pieces
        assert mine[-1].finish_reason == choice.finish_reason and mine[-1].delta.content is None
        assert not any(ch.finish_reason for ch in mine[:-1])
    events = _sse(server[0], {**kw, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole.usage.model_dump(exclude_none=True)
    assert all(e["usage"] is None for e in events[:-1])
    assert all(ch["delta"] == {} for e in events for ch in e["choices"] if ch["finish_reason"])


@pytest.mark.parametrize("extra,param", [({"best_of": 3}, "best_of"), ({"use_beam_search": True}, "stream")])
def test_a_chat_stream_that_cannot_be_streamed_is_a_400(server, extra, param):
    r = httpx.post(server[0] + "/v1/chat/completions",
                   json={"model": NAME, "messages": MESSAGES, "max_tokens": 4, "stream": True, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_models_own_template_then_chat_template_win_over_the_default(model_dir, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(model_dir, own)
    config = json.loads((own / "tokenizer_config.json").read_text())
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OWN}))
    assert model_template(load_tokenizer(own)) == (OWN, str(own / "tokenizer_config.json"))
    kw = dict(model=NAME, max_tokens=8, temperature=0)
    msgs = [{"role": "user", "content": "Hi"}]
    for given, prompt in ((None, "<user>Hi<assistant>"), ("[{{ messages[0].content }}]", "[Hi]")):
        with _serve(own, chat_template=given) as (url, app):
            assert app.state.server.chat_stops == ()  # a template of the model's or the user's: no stops added
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            got = c.chat.completions.create(messages=msgs, **kw).choices[0].message.content
            assert got == c.completions.create(prompt=prompt, **kw).choices[0].text


def test_a_model_directorys_chat_template_jinja_is_its_template(model_dir, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(model_dir, own)
    assert model_template(load_tokenizer(own)) is None  # what save_model writes has none
    (own / "chat_template.jinja").write_text(OWN)
    assert model_template(load_tokenizer(own)) == (OWN, str(own / "chat_template.jinja"))
    (own / "tokenizer_config.json").write_text("{not json")
    (own / "chat_template.jinja").unlink()
    assert model_template(load_tokenizer(own)) is None  # passed over, logged; the default serves


def test_a_client_leaving_a_streamed_chat_cancels_its_row(model_dir):
    def slow():
        m = load_model(model_dir)
        m.wte.register_forward_hook(lambda *a: time.sleep(0.05))  # every forward slow: the test acts mid-answer
        return m, load_tokenizer(model_dir)

    with live_server(slow, ServeOptions(served_model_name=NAME, max_batch=2, max_queue=2)) as (url, app):
        loop = app.state.server.engine_loop
        body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "stream": True,
                "temperature": 0, "logit_bias": {"50256": -100}}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            events = (json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: {"))
            assert next(events)["choices"][0]["delta"]["role"] == "assistant"
            assert next(events)["choices"][0]["delta"]["content"]  # the answer is being generated
            at_close = loop.steps
        deadline = time.monotonic() + 60
        while (loop.engine.n_running or loop.engine.n_waiting) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loop.engine.n_running == 0 and app.state.server.outstanding == 0
        assert loop.steps - at_close < 25  # far fewer steps than the 50 tokens it asked for: it was cancelled
