"""Structured outputs over HTTP: OpenAI's response_format (json_schema, json_object) and vLLM's
structured_outputs (json, regex, choice, grammar) on /v1/chat/completions and /v1/completions, through the
official openai client against a live server with a random-weight model; every output validates; a
constrained greedy completion equals the library's; refusals are 400s naming the field; schemathesis
over the new fields finds no 5xx."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from helpers import live_server, random_model  # noqa: E402

from gpt2kit.config import GPT2Config  # noqa: E402
from gpt2kit.generation import generate  # noqa: E402
from gpt2kit.sampling import Constraint, SamplingSettings  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402
from gpt2kit.tokenizer import Tokenizer  # noqa: E402

NAME = "tiny"
CFG = GPT2Config(n_vocab=50257, n_ctx=256, n_embd=32, n_head=4, n_layer=2)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "id": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}},
    "required": ["name", "pets", "age", "id"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=4)


@pytest.fixture(scope="module")
def server(model):
    with live_server(lambda: (model, Tokenizer.default()),
                     ServeOptions(served_model_name=NAME, max_batch=8, max_queue=64)) as (url, app):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_json_schema_always_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Who?"}], n=3,
                                          max_tokens=100, temperature=1.0, seed=1, response_format=fmt)
    for c in chat.choices:
        assert c.finish_reason == "stop"
        assert jsonschema_rs.is_valid(PERSON, json.loads(c.message.content)), c.message.content
    anything = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Go"}], max_tokens=100,
                                              temperature=0.5, seed=2, response_format={"type": "json_object"})
    c = anything.choices[0]
    assert c.message.content.startswith("{") and (c.finish_reason == "length" or
                                                  isinstance(json.loads(c.message.content), dict))


@pytest.mark.parametrize(("structured", "check"), [
    ({"json": PERSON}, lambda t: jsonschema_rs.is_valid(PERSON, json.loads(t))),
    ({"json": json.dumps(PERSON)}, lambda t: jsonschema_rs.is_valid(PERSON, json.loads(t))),
    ({"regex": "[a-z]{2}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{2}-[0-9]{2}", t)),
    ({"choice": ["red", "green", "light blue"]}, lambda t: t in ("red", "green", "light blue")),
    ({"grammar": 'root ::= "<" [a-c]+ ">"'}, lambda t: re.fullmatch("<[a-c]+>", t)),
])
def test_completions_structured_outputs_validate(client, structured, check):
    out = client.completions.create(model=NAME, prompt=["Value:", "x"], n=2, max_tokens=100, temperature=1.0,
                                    seed=3, logprobs=2, extra_body={"structured_outputs": structured})
    assert len(out.choices) == 4
    for c in out.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)


def test_streamed_chat_with_a_schema_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=100,
                                            temperature=1.0, seed=5, stream=True, response_format=fmt)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert jsonschema_rs.is_valid(PERSON, json.loads(text)), text


def test_greedy_completion_equals_the_library(client, model):
    tok = Tokenizer.default()
    out = client.completions.create(model=NAME, prompt="Record:", max_tokens=100, temperature=0,
                                    extra_body={"structured_outputs": {"json": PERSON}})
    s = SamplingSettings(max_new_tokens=100, temperature=0, structured=Constraint.json_schema(PERSON))
    assert out.choices[0].text == generate(model, ["Record:"], s, tokenizer=tok)[0].text


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "unknown name"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "not JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one"),
    ({"structured_outputs": {"choice": ["a"]}, "use_beam_search": True, "n": 2}, "structured_outputs",
     "does not support structured outputs"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_refusals_are_400s_naming_the_field(server, path, body, param, message):
    base = {"model": NAME, "max_tokens": 5}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(server + path, json=base | body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_schemathesis_over_the_new_fields_finds_no_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path in ("/v1/completions", "/v1/chat/completions")]
    assert len(ops) == 2
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            if not isinstance(case.body, dict):
                return
            case.body["model"] = NAME
            case.body["max_tokens"] = 4
            for k in ("n", "best_of"):  # keep each request small: the new fields are what is fuzzed
                case.body.pop(k, None)
            kind = hash(repr(case.body)) % 3
            if kind == 0:
                case.body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": {
                    "type": "object", "properties": {"a": case.body.get("user") or {"type": "integer"}}}}}
            elif kind == 1:
                case.body["structured_outputs"] = {"regex": str(case.body.get("user", "a+"))}
            case.call_and_validate(timeout=120, checks=[not_a_server_error])

        run()
