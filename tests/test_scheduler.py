"""The engine's scheduler, as the server and generate() run it: rows that join a running batch
mid-way, or run squeezed by max_batch, get exactly the tokens they get alone; cancelled rows leave
at the next step; the log-probs it reports are the model's (full forward, float32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, random_model, varied_model

from gpt2kit.engine import Engine
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings

PROMPTS = [[464, 2068, 7586, 21831], [15496], [40, 588, 257, 922, 1110, 13, 383], [11, 12, 13]]
SETTINGS = [SamplingSettings(temperature=0, max_new_tokens=12, stop_token_ids=()),
            SamplingSettings(max_new_tokens=9, seed=3, top_k=50, stop_token_ids=()),
            SamplingSettings(max_new_tokens=15, seed=4, temperature=0.7, presence_penalty=1.0, stop_token_ids=()),
            SamplingSettings(temperature=0, max_new_tokens=7, frequency_penalty=0.5, logit_bias={13: 3.0},
                             stop_token_ids=())]


def _alone(model, prompt, s):
    return generate(model, [prompt], s)[0].tokens


def _run(engine, joins: dict[int, list]):
    """Step the engine; at step k submit joins[k]; returns each row's tokens and the batch sizes."""
    sizes, k = [], 0
    while engine.has_work or any(j >= k for j in joins):
        engine.submit(joins.get(k, []))
        engine.step()
        sizes.append(engine.n_running)
        k += 1
    return sizes


def test_rows_joining_mid_run_get_what_they_get_alone():
    model = varied_model(SMALL, seed=0)
    engine = Engine(model)
    rows = [engine.new_row(p, s, seed=s.seed) for p, s in zip(PROMPTS, SETTINGS, strict=True)]
    _run(engine, {0: rows[:1], 3: rows[1:3], 5: rows[3:]})  # joins at steps 0, 3 and 5
    for row, p, s in zip(rows, PROMPTS, SETTINGS, strict=True):
        assert row.tokens == _alone(model, p, s)
        assert row.finish_reason == "length"


def test_max_batch_bounds_the_running_rows():
    model = varied_model(SMALL, seed=0)
    engine = Engine(model, max_batch=2)
    rows = [engine.new_row(p, s, seed=s.seed) for p, s in zip(PROMPTS, SETTINGS, strict=True)]
    sizes = _run(engine, {0: rows})
    assert max(sizes) == 2 and engine.n_running == 0
    assert [r.tokens for r in rows] == [_alone(model, p, s) for p, s in zip(PROMPTS, SETTINGS, strict=True)]


def test_a_cancelled_row_leaves_at_the_next_step():
    model = varied_model(SMALL, seed=0)
    engine = Engine(model)
    s = SamplingSettings(temperature=0, max_new_tokens=20, stop_token_ids=())
    a, b = engine.new_row(PROMPTS[0], s), engine.new_row(PROMPTS[1], s)
    engine.submit([a, b])
    engine.step()
    engine.step()
    engine.cancel(a)
    events = engine.step()
    assert [e.row for e in events] == [b] and engine.n_running == 1 and len(a.tokens) == 2
    while engine.has_work:
        engine.step()
    assert b.tokens == _alone(model, PROMPTS[1], s)


def test_a_steps_tokens_are_returned_before_the_next_forward():
    """Engine.step returns a step's events as soon as its tokens are sampled: a row's k-th token
    comes after k forwards (its prefill, then one per earlier token), not k + 1, so a client gets
    each token one forward sooner; the tokens are those it gets alone. A hook on wte
    counts the forwards (a hooked model decodes through its own forward)."""
    model = varied_model(SMALL, seed=0)
    forwards = []
    model.wte.register_forward_hook(lambda *a: forwards.append(1))
    s = SamplingSettings(temperature=0, max_new_tokens=5, stop_token_ids=())
    engine = Engine(model)
    row = engine.new_row(PROMPTS[0], s)
    engine.submit([row])
    seen = []
    while engine.has_work:
        seen.extend((len(forwards), len(e.row.tokens)) for e in engine.step())
    assert seen == [(k, k) for k in range(1, 6)]  # the last token costs no forward after it either
    forwards.clear()
    assert row.tokens == _alone(model, PROMPTS[0], s)


def test_reported_logprobs_are_the_models():
    model = random_model(SMALL, seed=2)  # GPT-2's init: log-probs of order 1-10
    engine = Engine(model)
    s = SamplingSettings(max_new_tokens=6, seed=1, temperature=1.3, stop_token_ids=())
    row = engine.new_row(PROMPTS[2], s, seed=1, logprobs=3)
    engine.submit([row])
    events = []
    while engine.has_work:
        events += engine.step()
    seq = torch.tensor([PROMPTS[2] + row.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0, len(PROMPTS[2]) - 1:-1].float(), -1)  # (6, V)
    got = torch.tensor([e.logprob for e in events])
    want = logp.gather(1, torch.tensor(row.tokens)[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for e, lp in zip(events, logp, strict=True):
        top = lp.topk(3)
        assert [t for t, _ in e.top_logprobs] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top_logprobs]), top.values, rtol=0, atol=1e-5)


def _nan_at_position(pos: int):
    """A model whose position `pos` embedding is NaN: a row reaching that position gets NaN logits,
    rows that stay below it are untouched (a public seam for a row whose sampling fails)."""
    model = varied_model(SMALL, seed=0)
    with torch.no_grad():
        model.wpe.weight[pos] = float("nan")
    return model


def test_a_row_whose_sampling_fails_fails_alone():
    model = _nan_at_position(20)
    long = list(range(300, 316))  # 16 tokens: fed at position 20 at its 5th step, its 6th choice fails
    bad_s = SamplingSettings(max_new_tokens=20, seed=5, stop_token_ids=())
    good = [(PROMPTS[1], SETTINGS[0]), (PROMPTS[3], SETTINGS[1]), (PROMPTS[0], SETTINGS[2])]  # stay below 20
    engine = Engine(model)
    bad = engine.new_row(long, bad_s, seed=5)
    rows = [engine.new_row(p, s, seed=s.seed) for p, s in good]
    engine.submit([rows[0], bad, *rows[1:]])
    events = []
    while engine.has_work:
        events += engine.step()
    failed = [e for e in events if e.error is not None]
    assert [e.row for e in failed] == [bad] and failed[0].finish_reason == "error" and failed[0].token == -1
    assert isinstance(bad.error, ValueError) and "not finite" in str(bad.error)
    assert len(bad.tokens) == 5 and bad.finish_reason == "error"
    for row, (p, s) in zip(rows, good, strict=True):
        assert row.finish_reason == "length" and row.tokens == _alone(model, p, s)


def test_engine_loop_reports_a_failed_row_alone():
    import threading

    from gpt2kit.engine import EngineLoop

    model = _nan_at_position(20)
    done, errors, lock = threading.Event(), [], threading.Lock()
    finished = []

    def on_events(events):
        with lock:
            finished.extend(e.row for e in events if e.finish_reason)
            if len(finished) == 2:
                done.set()

    def on_error(rows, exc):
        with lock:
            errors.append((rows, exc))

    engine = Engine(model)
    loop = EngineLoop(engine, on_events, on_error).start()
    try:
        bad = engine.new_row(list(range(300, 316)), SamplingSettings(max_new_tokens=20, seed=5), seed=5)
        good = [engine.new_row(p, s, seed=s.seed) for p, s in zip(PROMPTS[1:3], SETTINGS[:2], strict=True)]
        loop.submit([bad, *good])
        assert done.wait(60)
    finally:
        loop.stop()
    assert [(rows, type(e)) for rows, e in errors] == [([bad], ValueError)]
    assert sorted(finished, key=id) == sorted(good, key=id)
    assert [r.tokens for r in good] == [_alone(model, p, s) for p, s in zip(PROMPTS[1:3], SETTINGS[:2], strict=True)]


def test_a_hooked_model_keeps_rows_that_fit_when_the_padded_width_reaches_n_ctx():
    """A long row joins a short one and leaves early; the short one goes on until the cache's padded
    width would pass n_ctx. A hooked model decodes through its own forward, which refused that
    width (ValueError for every row) before the cache was trimmed there."""
    model = varied_model(SMALL, seed=0)
    model.wte.register_forward_hook(lambda *a: None)
    short_s = SamplingSettings(temperature=0, max_new_tokens=40, stop_token_ids=())
    long_s = SamplingSettings(temperature=0, max_new_tokens=3, stop_token_ids=())
    engine = Engine(model)
    short, long = engine.new_row([15496], short_s), engine.new_row(list(range(300, 350)), long_s)
    _run(engine, {0: [short], 2: [long]})
    assert long.tokens == _alone(model, list(range(300, 350)), long_s)
    assert short.finish_reason == "length" and short.tokens == _alone(model, [15496], short_s)


def test_a_greedy_row_with_non_finite_logits_fails_alone_too():
    """The plain greedy path (one batched argmax) would pick a NaN's index silently."""
    model = _nan_at_position(20)
    s = SamplingSettings(temperature=0, max_new_tokens=20, stop_token_ids=())
    engine = Engine(model)
    bad, good = engine.new_row(list(range(300, 316)), s), engine.new_row(PROMPTS[1], s)
    engine.submit([bad, good])
    while engine.has_work:
        engine.step()
    assert bad.finish_reason == "error" and len(bad.tokens) == 5 and "not finite" in str(bad.error)
    assert good.finish_reason == "length" and good.tokens == _alone(model, PROMPTS[1], s)


def test_engine_loop_steps_a_generator_between_steps_and_closes_it_when_cancelled():
    """EngineLoop.call_steps (the server's contrastive search): one next() per loop iteration, the
    return value as the Future's result; a cancelled Future's generator is closed, not run on."""
    import threading

    from gpt2kit.engine import EngineLoop

    model = varied_model(SMALL, seed=0)
    engine = Engine(model)
    loop = EngineLoop(engine, lambda events: None, lambda rows, exc: None).start()
    closed, started = threading.Event(), threading.Event()

    def count(n):
        for _ in range(n):
            yield
        return n

    def fails():
        yield
        return 1 // 0

    def forever():
        try:
            while True:
                started.set()
                yield
        finally:
            closed.set()

    try:
        row = engine.new_row(PROMPTS[1], SETTINGS[0])
        loop.submit([row])
        assert loop.call_steps(count(7)).result(60) == 7
        fut = loop.call_steps(forever())
        assert started.wait(60)
        fut.cancel()
        assert closed.wait(60)
        with pytest.raises(ZeroDivisionError):
            loop.call_steps(fails()).result(60)
    finally:
        loop.stop()
    assert row.tokens == _alone(model, PROMPTS[1], SETTINGS[0])


def test_an_idle_engine_loop_gathers_arrivals_within_its_admission_window_into_one_first_step():
    import threading
    import time

    from gpt2kit.engine import EngineLoop

    model = random_model(SMALL)
    first_step_rows, finished, lock = [], [], threading.Lock()
    done = threading.Event()

    def on_events(events):
        with lock:
            if not first_step_rows:
                first_step_rows.append({id(e.row) for e in events if e.token >= 0})
            finished.extend(e.row for e in events if e.finish_reason)
            if len(finished) == 2:
                done.set()

    engine = Engine(model, max_batch=4)
    loop = EngineLoop(engine, on_events, lambda rows, e: None, admission_window=2.0).start()
    try:
        s = SamplingSettings(temperature=0, max_new_tokens=2, stop_token_ids=())
        a, b = engine.new_row([1, 2, 3], s), engine.new_row([4, 5], s)
        loop.submit([a])
        time.sleep(0.05)  # well inside the window: b joins a's first step
        loop.submit([b])
        assert done.wait(60)
    finally:
        loop.stop()
    assert first_step_rows == [{id(a), id(b)}]
    assert a.tokens == _alone(model, [1, 2, 3], s) and b.tokens == _alone(model, [4, 5], s)


def test_rows_whose_slots_cannot_be_had_go_back_on_the_queue_for_reset(monkeypatch):
    """Admission raises (the slot pool cannot be made): the rows it took off the queue are put back,
    in order, so that the caller's reset() returns them to be failed, none lost between queue and batch."""
    from gpt2kit.engine.batch_cache import SlotPool

    def no_memory(*args, **kwargs):
        raise RuntimeError("no memory for the slots")

    engine = Engine(random_model(SMALL))
    rows = [engine.new_row(p, s, seed=s.seed) for p, s in zip(PROMPTS, SETTINGS, strict=True)]
    engine.submit(rows)
    monkeypatch.setattr(SlotPool, "for_model", no_memory)
    with pytest.raises(RuntimeError, match="no memory for the slots"):
        engine.step()
    assert engine.n_waiting == len(rows) and engine.n_running == 0
    assert engine.reset() == rows and not engine.has_work
