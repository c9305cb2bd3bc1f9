"""Structured outputs (gpt2kit.sampling.constraint, gpt2kit.sampling.structured) through the library and
the CLI, on random-weight models (near-uniform logits: the constraint does all the work): every
output parses and validates; constrained rows batch with unconstrained ones and each other; greedy
equals transformers' generate on the same weights with llguidance's own masks; refusals are
ValueErrors naming the setting."""

from __future__ import annotations

import json
import re

import pytest
import torch

llguidance = pytest.importorskip("llguidance")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from helpers import random_model  # noqa: E402

from gpt2kit.config import GPT2Config  # noqa: E402
from gpt2kit.engine import Engine  # noqa: E402
from gpt2kit.generation import generate  # noqa: E402
from gpt2kit.sampling import Constraint, SamplingSettings  # noqa: E402
from gpt2kit.tokenizer import Tokenizer  # noqa: E402

CFG = GPT2Config(n_vocab=50257, n_ctx=256, n_embd=32, n_head=4, n_layer=2)

# Bounded (strings by maxLength or pattern, integers by range, arrays by maxItems) so that a random
# model's output ends well within max_new_tokens: a random model picks digits of an unbounded number's
# fraction about as often as what ends it.
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "enum_and_const": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3, None]},
                                                        "version": {"const": 2}},
                       "required": ["kind", "version"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "x": {"enum": [0.5, -1.25, 3e2]},
        "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
               "maxItems": 4}}, "required": ["x", "n", "xs"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,3}$"}},
        "required": ["date", "code"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 4}, "v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
        "required": ["k", "v"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
    "any_of": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 0, "maximum": 99}]},
}


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=3)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


def _check_valid(schema: dict, completions) -> None:
    validator = jsonschema_rs.validator_for(schema)
    for c in completions:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        value = json.loads(c.text)
        assert validator.is_valid(value), (c.text, schema)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_output_parses_and_validates(model, tok, name):
    schema = SCHEMAS[name]
    s = SamplingSettings(max_new_tokens=120, temperature=1.0, seed=7, num_samples=4,
                         structured=Constraint.json_schema(schema))
    out = generate(model, ["The answer:"], s, tokenizer=tok)
    _check_valid(schema, out)
    assert len({c.text for c in out}) > 1  # sampled: the rows differ


def test_greedy_and_json_object(model, tok):
    schema = SCHEMAS["nested"]
    greedy = SamplingSettings(max_new_tokens=120, temperature=0, structured=Constraint.json_schema(schema))
    _check_valid(schema, generate(model, ["x"], greedy, tokenizer=tok))
    anything = SamplingSettings(max_new_tokens=120, temperature=0.7, seed=1, num_samples=3,
                                structured=Constraint("json_object"))
    for c in generate(model, ["x"], anything, tokenizer=tok):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # cut by max_new_tokens: still a prefix of an object
            assert c.finish_reason == "length" and c.text.startswith("{")


@pytest.mark.parametrize(("constraint", "check"), [
    (Constraint("regex", r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
    (Constraint("choice", ("yes", "no", "not sure")), lambda t: t in ("yes", "no", "not sure")),
    (Constraint("grammar", 'start: "(" item ("," item)* ")"\nitem: /[a-c]/\n'),
     lambda t: re.fullmatch(r"\([a-c](,[a-c])*\)", t)),
    (Constraint("grammar", 'root ::= "x" [0-9] [0-9]? "!"'), lambda t: re.fullmatch(r"x[0-9][0-9]?!", t)),
])
def test_regex_choice_and_grammars(model, tok, constraint, check):
    s = SamplingSettings(max_new_tokens=60, temperature=1.0, seed=3, num_samples=4, structured=constraint)
    for c in generate(model, ["Q: ", "A: "], s, tokenizer=tok):
        assert c.finish_reason == "stop" and check(c.text), c.text
        assert c.tokens[-1] != tok.eot_token or c.text  # a complete output ends without spending a stop token


def test_seeded_rows_repeat_and_stop_strings_cut(model, tok):
    c = Constraint("regex", r"[a-z]{3}-[a-z]{3}")
    s = SamplingSettings(max_new_tokens=40, temperature=1.0, seed=11, num_samples=3, structured=c)
    first = [x.text for x in generate(model, ["a"], s, tokenizer=tok)]
    assert first == [x.text for x in generate(model, ["a"], s, tokenizer=tok)]
    cut = SamplingSettings(max_new_tokens=40, temperature=1.0, seed=11, num_samples=3, structured=c,
                           stop_strings=("-",))
    assert [x.text for x in generate(model, ["a"], cut, tokenizer=tok)] == [t.split("-")[0] for t in first]


def _run_alone(model, tok, prompt, settings, seed):
    engine = Engine(model, tok)
    row = engine.new_row(tok.encode(prompt), settings, seed=seed, logprobs=3)
    engine.submit([row])
    events = []
    while engine.has_work:
        events += engine.step()
    return row.tokens, [(e.logprob, e.top_logprobs) for e in events]


def test_constrained_rows_batch_with_plain_ones_and_each_other(model, tok):
    rows_spec = [("Hello", SamplingSettings(max_new_tokens=30, temperature=1.0, seed=5,
                                            structured=Constraint.json_schema(SCHEMAS["flat"]))),
                 ("Hello", SamplingSettings(max_new_tokens=30, temperature=1.0, seed=5)),
                 ("Bye", SamplingSettings(max_new_tokens=30, temperature=0,
                                          structured=Constraint("choice", ("alpha", "beta")))),
                 ("Bye", SamplingSettings(max_new_tokens=30, temperature=0, structured=Constraint("regex", "[0-9]+"),
                                          stop_token_ids=()))]
    alone = [_run_alone(model, tok, p, s, 5) for p, s in rows_spec]
    engine = Engine(model, tok, max_batch=4)
    rows = [engine.new_row(tok.encode(p), s, seed=5, logprobs=3) for p, s in rows_spec]
    engine.submit(rows)
    events = {id(r): [] for r in rows}
    while engine.has_work:
        for e in engine.step():
            events[id(e.row)].append((e.logprob, e.top_logprobs))
    for row, (tokens, lps) in zip(rows, alone, strict=True):
        assert row.tokens == tokens
        for (lp, top), (lp_a, top_a) in zip(events[id(row)], lps, strict=True):
            assert lp == pytest.approx(lp_a, abs=1e-5)
            assert [t for t, _ in top] == [t for t, _ in top_a]


def test_logprobs_are_the_constrained_distribution(model, tok):
    words = ("alpha", "beta", "gamma")
    s = SamplingSettings(max_new_tokens=10, temperature=1.0, seed=2, structured=Constraint("choice", words))
    engine = Engine(model, tok)
    prompt = tok.encode("x")
    row = engine.new_row(prompt, s, seed=2, logprobs=5)
    engine.submit([row])
    first = engine.step()[0]
    # the first token may be any token whose text begins one of the words
    allowed = torch.tensor([any(w.startswith(tok.decode([t])) for w in words) and tok.decode([t]) != ""
                            for t in range(tok.n_vocab)])
    with torch.no_grad():
        raw = model(torch.tensor([prompt])).logits[0, -1].float()  # (V,)
    ref = torch.log_softmax(raw.masked_fill(~allowed, float("-inf")), -1)
    top = ref.topk(5)
    assert [t for t, _ in first.top_logprobs] == top.indices.tolist()
    assert [lp for _, lp in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert first.logprob == pytest.approx(ref[first.token].item(), abs=1e-5)


def test_greedy_equals_transformers_generate_with_llguidance_masks(model, tok):
    """Reference: transformers' GPT2LMHeadModel.generate on the same weights, its logits masked by a
    LogitsProcessor that drives llguidance's own LLMatcher and llguidance.torch's bitmask filler
    (llguidance ships no transformers processor, so the reference hands its masks over this way)."""
    pytest.importorskip("transformers")
    from helpers import hf_from_ours
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import LogitsProcessor, LogitsProcessorList

    from gpt2kit.sampling.structured import matcher_factory

    schema = SCHEMAS["nested"]
    constraint = Constraint.json_schema(schema)
    lltok = matcher_factory(tok).lltokenizer
    prompt = tok.encode("The record:")

    class Grammar(LogitsProcessor):
        def __init__(self):
            self.m = llguidance.LLMatcher(lltok, constraint.grammar())
            self.mask = allocate_token_bitmask(1, tok.n_vocab)
            self.fed = 0

        def __call__(self, input_ids, scores):
            for t in input_ids[0, len(prompt) + self.fed:].tolist():
                assert self.m.consume_token(t)
                self.fed += 1
            fill_next_token_bitmask(self.m, self.mask)
            bits = (self.mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32)
            allowed = bits.flatten()[:scores.shape[-1]].bool()
            return scores.masked_fill(~allowed, float("-inf"))

    hf = hf_from_ours(model)
    ref = hf.generate(torch.tensor([prompt]), logits_processor=LogitsProcessorList([Grammar()]), do_sample=False,
                      max_new_tokens=100, eos_token_id=tok.eot_token, pad_token_id=tok.eot_token)
    ref_tokens = ref[0, len(prompt):].tolist()
    s = SamplingSettings(max_new_tokens=100, temperature=0, structured=constraint)
    ours = generate(model, [prompt], s, tokenizer=tok)[0]
    # transformers spends a step on <|endoftext|> where gpt2kit ends at the output's last token
    assert ref_tokens[-1] == tok.eot_token
    assert ours.tokens == ref_tokens[:-1]
    _check_valid(schema, [ours])


def test_speculative_rows_verify_drafts_against_the_constraint(model, tok):
    c = Constraint.json_schema(SCHEMAS["array_of_objects"])
    plain = SamplingSettings(max_new_tokens=80, temperature=0, structured=c)
    spec = SamplingSettings(max_new_tokens=80, temperature=0, structured=c, prompt_lookup=4)
    prompt = '[{"k":"ab","v":1},{"k":"ab","v":1}] again: '
    a = generate(model, [prompt], plain, tokenizer=tok)[0]
    b = generate(model, [prompt], spec, tokenizer=tok)[0]
    assert a.tokens == b.tokens
    _check_valid(SCHEMAS["array_of_objects"], [b])
    sampled = SamplingSettings(max_new_tokens=80, temperature=1.0, seed=4, num_samples=3, structured=c,
                               prompt_lookup=4)
    _check_valid(SCHEMAS["array_of_objects"], generate(model, [prompt], sampled, tokenizer=tok))


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("json_schema", '{"type": "strin"}', "Invalid type"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ("json_schema", "{not json", "not JSON"),
    ("regex", "a(", "unclosed group"),
    ("grammar", "start: missing_rule", "unknown name"),
    ("grammar", 'root ::= "unterminated', "invalid grammar"),
    ("choice", (), "non-empty list"),
    ("kind", "x", "must be one of"),
])
def test_invalid_constraints_are_refused(kind, spec, message):
    with pytest.raises(ValueError, match=message) as e:
        Constraint(kind, spec)
    assert e.value.name == "structured"


@pytest.mark.parametrize("method", [dict(num_beams=2), dict(penalty_alpha=0.6, top_k=4)])
def test_beam_and_contrastive_search_refuse_a_constraint(method):
    with pytest.raises(ValueError, match="does not support structured outputs") as e:
        SamplingSettings(temperature=0, structured=Constraint("regex", "a+"), **method)
    assert e.value.name == "structured"


def test_a_constrained_row_needs_a_tokenizer(model):
    with pytest.raises(ValueError, match="need a tokenizer"):
        Engine(model).new_row([1, 2], SamplingSettings(temperature=0, structured=Constraint("regex", "a+")))


def test_cli_generate_flags(tmp_path, capsys):
    from gpt2kit.checkpoint import save_model
    from gpt2kit.cli import main

    save_model(random_model(CFG, seed=3), tmp_path / "m")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["flat"]), encoding="utf-8")
    base = ["generate", "--model", str(tmp_path / "m"), "--json", "-n", "60", "--seed", "1", "--num-samples", "2"]
    for flags, ok in ((["--json-schema", str(schema)], lambda t: jsonschema_rs.is_valid(SCHEMAS["flat"],
                                                                                        json.loads(t))),
                      (["--regex", "[a-f]{4}"], lambda t: re.fullmatch("[a-f]{4}", t)),
                      (["--choice", "left,right"], lambda t: t in ("left", "right"))):
        assert main([*base, *flags, "hi"]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert len(lines) == 2 and all(ok(x["text"]) and x["finish_reason"] == "stop" for x in lines), lines
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "(" /[0-9]/ ")"\n', encoding="utf-8")
    assert main([*base, "--grammar", str(grammar), "hi"]) == 0
    assert all(re.fullmatch(r"\([0-9]\)", json.loads(x)["text"]) for x in capsys.readouterr().out.splitlines())
    assert main([*base, "--regex", "a(", "hi"]) == 1
    err = capsys.readouterr().err
    assert "unclosed group" in err and "Traceback" not in err


def test_without_llguidance_the_error_names_the_extra(monkeypatch, tmp_path, capsys):
    import sys

    from gpt2kit.checkpoint import save_model
    from gpt2kit.cli import main

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'gpt2kit\[structured\]'"):
        Constraint("regex", "a+")
    save_model(random_model(CFG, seed=3), tmp_path / "m")
    assert main(["generate", "--model", str(tmp_path / "m"), "--regex", "a+", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "gpt2kit[structured]" in err[-1] and "Traceback" not in "".join(err)


def test_the_docs_python_example_runs(model, tok, monkeypatch):
    from pathlib import Path

    import gpt2kit

    doc = (Path(__file__).parents[1] / "docs" / "structured.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(from gpt2kit import generate.*?)```", doc, re.S).group(1)
    monkeypatch.setattr(gpt2kit, "load_model", lambda name: model)  # the page loads gpt2 from the hub
    monkeypatch.setattr(gpt2kit, "load_tokenizer", lambda name: tok)
    printed = []
    exec(compile(code, "structured.md", "exec"), {"print": lambda *a: printed.append(a)})
    assert [a[0] for a in printed[:2]] == ["stop", "stop"]
    assert all(jsonschema_rs.is_valid(json.loads(_person_schema(doc)), json.loads(a[1])) for a in printed[:2])
    assert printed[2][0] in ("yes", "no")


def _person_schema(doc: str) -> str:
    ns: dict = {}
    exec(re.search(r"(person = \{.*?\"additionalProperties\": False\})", doc, re.S).group(1), ns)
    return json.dumps(ns["person"])
