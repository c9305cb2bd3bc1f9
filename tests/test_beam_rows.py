"""Beam search as rows of the shared engine (gpt2kit.engine.beam_rows): a prompt's beams join a
running batch whole, run in the same decode steps as other rows, and give what the Python API's
beam search gives (tokens exactly, scores within 1e-4), while the other rows get exactly their
tokens alone; a group leaves whole when one of its rows is cancelled."""

from __future__ import annotations

import pytest
from helpers import SMALL, varied_model

from gpt2kit.engine import Engine, RowKey
from gpt2kit.engine.rows import RowGroup
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings

PROMPTS = [[464, 2068, 7586, 21831], [15496, 11], [40, 588, 257]]
GREEDY = SamplingSettings(temperature=0, max_new_tokens=14, stop_token_ids=())
SAMPLED = SamplingSettings(max_new_tokens=12, seed=3, top_k=50, stop_token_ids=())


@pytest.fixture(scope="module")
def model():
    return varied_model(SMALL, seed=0)


def _beams(model, prompt, s):
    return [(c.tokens, c.score, c.finish_reason) for c in generate(model, [prompt], s)]


def _same(got, want):
    assert [(b.tokens, b.finish_reason) for b in got] == [(t, r) for t, _, r in want]
    assert all(abs(b.score - score) < 1e-4 for b, (_, score, _) in zip(got, want, strict=True))


@pytest.mark.parametrize("stop", [(), (13,)])
def test_beam_groups_beside_other_rows_equal_the_python_api(model, stop):
    s = SamplingSettings(max_new_tokens=10, num_beams=3, num_return_sequences=2, length_penalty=0.5,
                         stop_token_ids=stop)
    engine = Engine(model, max_batch=6)
    greedy, sampled = engine.new_row(PROMPTS[1], GREEDY), engine.new_row(PROMPTS[1], SAMPLED, seed=3)
    g1 = engine.new_beam_rows(PROMPTS[0], s, key=RowKey(0))
    g2 = engine.new_beam_rows(PROMPTS[2], s, key=RowKey(1))
    engine.submit([greedy, sampled])
    engine.step()
    engine.submit(g1 + g2)  # g1 joins at the next step; g2 (3 more rows than room) waits for room, whole
    events, sizes = [], []
    while engine.has_work:
        events += engine.step()
        sizes.append(engine.n_running)
    assert 5 in sizes and max(sizes) <= 6  # the beams ran beside the other rows, never past max_batch
    done = {e.row.key.index: e.beams for e in events if e.beams is not None}
    assert [e.row for e in events if e.beams is not None] == [g1[0], g2[0]]  # one event per group, its lead
    _same(done[0], _beams(model, PROMPTS[0], s))
    _same(done[1], _beams(model, PROMPTS[2], s))
    assert greedy.tokens == generate(model, [PROMPTS[1]], GREEDY)[0].tokens
    assert sampled.tokens == generate(model, [PROMPTS[1]], SAMPLED)[0].tokens


def test_a_beam_group_is_the_row_group_the_rows_declare(model):
    rows = Engine(model).new_beam_rows(PROMPTS[0], SamplingSettings(max_new_tokens=4, num_beams=2))
    group = rows[0].beam
    assert isinstance(group, RowGroup) and group.rows == rows and group.lead is rows[0] and not group.cancelled


def test_cancelling_one_row_of_a_group_drops_the_group(model):
    s = SamplingSettings(max_new_tokens=10, num_beams=3)
    engine = Engine(model)
    other = engine.new_row(PROMPTS[1], GREEDY)
    group = engine.new_beam_rows(PROMPTS[0], s)
    engine.submit([other, *group])
    engine.step()
    engine.step()
    engine.cancel(group[1])
    engine.step()
    assert engine.n_running == 1
    events = []
    while engine.has_work:
        events += engine.step()
    assert all(e.row is other for e in events) and other.tokens == generate(model, [PROMPTS[1]], GREEDY)[0].tokens


def test_a_group_that_could_never_run_is_refused(model):
    with pytest.raises(ValueError, match=r"num_beams=4 rows run at once: at most max_batch=3"):
        Engine(model, max_batch=3).new_beam_rows(PROMPTS[0], SamplingSettings(max_new_tokens=5, num_beams=4))
    with pytest.raises(ValueError, match=r"prompt \(4 tokens\) \+ max_new_tokens=61 must be at most n_ctx=64"):
        Engine(model).new_beam_rows(PROMPTS[0], SamplingSettings(max_new_tokens=61, num_beams=2))
