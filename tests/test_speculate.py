"""Speculative decoding: prompt lookup and draft models give the target's greedy tokens exactly, and
the rejection rule draws exactly the target's distribution (chi-square on seeded draws)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import random_model, varied_model
from scipy.stats import chisquare

from gpt2kit.config import GPT2Config
from gpt2kit.engine.drafts import accept_drafts, greedy_accept, lookup_drafts
from gpt2kit.generation import generate, generate_stream
from gpt2kit.sampling import SamplingSettings

CTX = GPT2Config(n_vocab=50257, n_ctx=256, n_embd=32, n_head=4, n_layer=2)  # room for 200 tokens
PROMPTS = [[464, 3290, 318, 257, 464, 3290], [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8], [50256], [1, 2, 3, 1, 2]]


@pytest.fixture(scope="module")
def target():
    return varied_model(CTX)


def _greedy(n=200, **kw):
    return SamplingSettings(max_new_tokens=n, temperature=0, stop_token_ids=(), **kw)


def test_lookup_drafts_take_the_most_recent_longest_match():
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 8, 2, 3], 2) == [8, 2]  # the 2-gram (2, 3) seen last at 5
    assert lookup_drafts([5, 1, 2, 7, 1, 2], 3) == [7, 1, 2]
    assert lookup_drafts([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    assert lookup_drafts([4], 4) == []
    assert lookup_drafts([7, 7, 7], 5) == [7] * 5  # the match (7, 7) at 0 runs into the end: the run goes on
    assert lookup_drafts([1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]  # the 3-gram (1, 2, 1) at 0, period 2
    assert lookup_drafts([3, 1, 2, 9, 1, 2], 4) == [9, 1, 2, 9]  # the copy of (9, 1, 2) repeats itself


def test_greedy_accept_keeps_the_agreeing_prefix():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == (2, 7)
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == (3, 8)
    assert greedy_accept([4], []) == (0, 4)


@pytest.mark.parametrize("model_kind", ["varied", "random"])
def test_prompt_lookup_greedy_is_plain_greedy_for_200_tokens(target, model_kind):
    model = target if model_kind == "varied" else random_model(CTX)  # a random model repeats: lookup hits
    plain = generate(model, PROMPTS, _greedy())
    looked = generate(model, PROMPTS, _greedy(prompt_lookup=5), batch_size=3)  # two groups
    assert [c.tokens for c in looked] == [c.tokens for c in plain]
    assert all(len(c.tokens) == 200 for c in looked)
    assert sum(c.drafted for c in looked) > 0
    assert all(0 <= c.accepted <= c.drafted for c in looked)
    if model_kind == "random":
        assert min(c.acceptance_rate for c in looked) > 0.5


@pytest.mark.parametrize("extra", [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2, min_new_tokens=5)])
def test_prompt_lookup_greedy_with_penalties_constraints_and_stop_tokens_is_plain(target, extra):
    kw = dict(max_new_tokens=120, temperature=0, stop_token_ids=(11, 13), **extra)  # they count the drafts
    plain = generate(target, PROMPTS, SamplingSettings(**kw))
    looked = generate(target, PROMPTS, SamplingSettings(prompt_lookup=4, **kw))
    assert [(c.tokens, c.finish_reason) for c in looked] == [(c.tokens, c.finish_reason) for c in plain]


@pytest.mark.parametrize("draft_kind", ["other", "random", "self"])
def test_draft_model_greedy_is_the_targets_greedy_for_200_tokens(target, draft_kind):
    draft = {"other": varied_model(CTX, seed=1), "random": random_model(CTX), "self": target}[draft_kind]
    plain = generate(target, PROMPTS, _greedy())
    spec = generate(target, PROMPTS, _greedy(draft_tokens=3), draft_model=draft)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    if draft_kind == "self":
        assert all(c.acceptance_rate == 1.0 for c in spec)


@pytest.mark.parametrize("draft_kind", ["other", "self"])  # every draft dropped / every draft kept
def test_draft_model_rows_that_finish_apart_and_join_late_are_plain_greedy(target, draft_kind):
    """Rows finishing at different steps leave (the caches compacted in place), a waiting row joins
    the running ones (their columns packed together), and a long run outgrows the first cache: each
    row's tokens are still plain greedy's."""
    prompts = PROMPTS + [[5, 6, 7], [900, 901]]
    free = generate(target, prompts, _greedy(40))
    stops = {free[0].tokens[5], free[3].tokens[20]}  # two rows stop early, at different steps
    kw = dict(temperature=0, stop_token_ids=tuple(t for t in stops if all(t not in c.tokens[:3] for c in free)))
    for n in (12, 60, 230):  # 230: more columns than the first cache's room (drafts' columns too)
        plain = generate(target, prompts, SamplingSettings(max_new_tokens=n, **kw))
        spec = generate(target, prompts, SamplingSettings(max_new_tokens=n, draft_tokens=4, **kw),
                        draft_model=varied_model(CTX, seed=1) if draft_kind == "other" else target, batch_size=3)
        assert [(c.tokens, c.finish_reason) for c in spec] == [(c.tokens, c.finish_reason) for c in plain]
        assert n < 60 or len({len(c.tokens) for c in plain}) > 2  # the rows did finish apart


def test_streamed_speculative_steps_give_each_row_its_tokens_in_order(target):
    plain = generate(target, PROMPTS, _greedy(40))
    got = {k: [] for k in range(len(PROMPTS))}
    for step in generate_stream(target, PROMPTS, _greedy(40), draft_model=target):
        for k, t in step.tokens.items():
            got[k].append(t)
    assert [got[k] for k in range(len(PROMPTS))] == [c.tokens for c in plain]


def test_sampled_speculation_is_seeded_and_reproducible(target):
    s = SamplingSettings(max_new_tokens=30, temperature=0.9, top_k=50, seed=3, stop_token_ids=())
    draft = varied_model(CTX, seed=1)
    a = generate(target, PROMPTS, s, draft_model=draft)
    b = generate(target, PROMPTS, s, draft_model=draft)
    assert [c.tokens for c in a] == [c.tokens for c in b] and all(len(c.tokens) == 30 for c in a)
    lk = SamplingSettings(max_new_tokens=30, temperature=0.9, seed=3, stop_token_ids=(), prompt_lookup=3)
    assert [c.tokens for c in generate(target, PROMPTS, lk)] == [c.tokens for c in generate(target, PROMPTS, lk)]


# --- the rejection rule, statistically --------------------------------------------------------

V = 6
N_DRAWS = 20_000


def _dist(seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g, dtype=torch.float64) * sharp).softmax(-1)


def _chi2_p(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    return float(chisquare(counts.numpy(), (probs * len(samples)).numpy()).pvalue)


@pytest.mark.parametrize("point_mass", [False, True])
def test_first_token_of_the_rejection_rule_is_the_targets_distribution(point_mass):
    p1, q1 = _dist(0), _dist(1)
    p = torch.stack([p1, _dist(2)])  # (2, V): the first position, then the bonus position
    g = torch.Generator().manual_seed(1234)
    first = []
    for _ in range(N_DRAWS):
        if point_mass:  # prompt lookup: the draft is a fixed token, not a draw
            d, q = 2, None
        else:
            d, q = int(torch.multinomial(q1, 1, generator=g)), q1[None]
        kept, nxt = accept_drafts(p, q, [d], g)
        first.append(d if kept else nxt)
    assert _chi2_p(first, p1) > 0.01
    # a wrong rule (always keep the draft) is rejected by the same test
    if not point_mass:
        wrong = [int(torch.multinomial(q1, 1, generator=g)) for _ in range(N_DRAWS)]
        assert _chi2_p(wrong, p1) < 1e-6


def test_two_token_sequences_of_the_rejection_rule_are_the_targets():
    """Two drafts per step, conditional distributions for the second token: the joint (t1, t2)
    matches p1(t1) p2(t2 | t1) over all V * V pairs."""
    p1, q1 = _dist(10), _dist(11)
    p2 = torch.stack([_dist(20 + t) for t in range(V)])  # (V, V): p2[t1] = target's next given t1
    q2 = torch.stack([_dist(40 + t) for t in range(V)])
    g = torch.Generator().manual_seed(99)
    pairs = []
    for _ in range(N_DRAWS):
        d1 = int(torch.multinomial(q1, 1, generator=g))
        d2 = int(torch.multinomial(q2[d1], 1, generator=g))
        p = torch.stack([p1, p2[d1], _dist(7)])  # the third row: the (unused) bonus position
        kept, nxt = accept_drafts(p, torch.stack([q1, q2[d1]]), [d1, d2], g)
        if kept == 2:
            t1, t2 = d1, d2
        elif kept == 1:
            t1, t2 = d1, nxt
        else:  # the next step drafts one token after the target's t1
            t1 = nxt
            d = int(torch.multinomial(q2[t1], 1, generator=g))
            k2, n2 = accept_drafts(torch.stack([p2[t1], _dist(8)]), q2[t1][None], [d], g)
            t2 = d if k2 else n2
        pairs.append(t1 * V + t2)
    joint = (p1[:, None] * p2).reshape(-1)
    assert _chi2_p(pairs, joint) > 0.01


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    (dict(draft_tokens=0), "draft_tokens must be an integer in [1, 64]"),
    (dict(draft_tokens=65), "draft_tokens must be an integer in [1, 64]"),
    (dict(prompt_lookup=-1), "prompt_lookup must be an integer in [0, 64]"),
])
def test_settings_reject_bad_draft_counts(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingSettings(**kwargs)


def test_draft_model_bad_input_is_one_clear_error(target):
    other_vocab = random_model(GPT2Config(n_vocab=1000, n_ctx=256, n_embd=32, n_head=4, n_layer=2))
    with pytest.raises(ValueError, match="vocabulary has 1000 tokens, the target's 50257"):
        generate(target, PROMPTS, _greedy(5), draft_model=other_vocab)
    with pytest.raises(ValueError, match="not both"):
        generate(target, PROMPTS, _greedy(5, prompt_lookup=2), draft_model=target)
    with pytest.raises(ValueError, match="must be at most n_ctx=256"):
        generate(target, [[1] * 60], _greedy(200, prompt_lookup=4))
    with pytest.raises(ValueError, match="the draft model is on"):
        generate(target, PROMPTS, _greedy(5), draft_model=varied_model(CTX).to(torch.bfloat16))


def test_a_forked_sampler_observes_alone():
    from gpt2kit.sampling.sampler import RowSampler

    s = SamplingSettings(temperature=0, repetition_penalty=2.0, no_repeat_ngram_size=2)
    row = RowSampler(s, [1, 2, 3], 10, None)
    logits = torch.arange(10, dtype=torch.float32)[None]
    before = row.warped(logits)
    fork = row.fork()
    for t in (9, 1):
        fork.observe(t)
    assert torch.equal(row.warped(logits), before) and not torch.equal(fork.warped(logits), before)


# --- a draft that cannot cover the target's context; failures kept to their own rows ---------------

SHORT = GPT2Config(n_vocab=50257, n_ctx=32, n_embd=32, n_head=4, n_layer=2)


def test_a_draft_with_a_shorter_context_is_refused_naming_both_contexts(target):
    from gpt2kit.engine import Engine
    from gpt2kit.engine.speculate import Proposer, check_draft_model

    short = varied_model(SHORT, seed=1)
    needle = "has a context of n_ctx=32, shorter than the target's n_ctx=256"
    with pytest.raises(ValueError, match=f"the draft model {needle}"):
        generate(target, PROMPTS, _greedy(5), draft_model=short)  # before any row runs, not at its first step
    with pytest.raises(ValueError, match=needle):
        Engine(target, proposer=Proposer(short))
    with pytest.raises(ValueError, match=f"the draft model gpt2-short {needle}"):
        check_draft_model(target, short, "gpt2-short")
    check_draft_model(short, target)  # a draft with a longer context than its target drafts


def test_the_engine_decides_once_which_rows_speculate(target, monkeypatch):
    """One engine with a proposer is the declared interface; its greedy rows speculate, its beams,
    leases, sampled rows (a greedy-only proposer) and rows whose drafts would not fit do not."""
    from gpt2kit.engine import EngineInterface

    engine = _engine(target, varied_model(CTX, seed=1), monkeypatch, max_batch=4)
    assert isinstance(engine, EngineInterface)
    s = SamplingSettings(max_new_tokens=4, num_beams=2)
    beams = engine.new_beam_rows([1, 2], s)
    assert len(beams) == 2 and not any(r.speculate for r in beams)  # beams and leases decode as always
    assert not engine.new_lease([1, 2], _greedy(4)).speculate
    assert engine.new_row([1, 2], _greedy(4)).speculate
    assert not engine.new_row([1, 2], SamplingSettings(max_new_tokens=4, temperature=0.9), seed=1).speculate
    assert not engine.new_row([1] * 60, _greedy(CTX.n_ctx - 63)).speculate  # + 4 drafts: past n_ctx


def _engine(target, draft, monkeypatch, max_batch=None):
    """An engine on target whose greedy rows speculate with draft (4 tokens a step, as a server's),
    its start-up check bypassed (what the engine does when drafting itself fails)."""
    from gpt2kit.engine import Engine, speculate

    monkeypatch.setattr(speculate, "check_draft_model", lambda *a: None)
    return Engine(target, max_batch=max_batch, proposer=speculate.Proposer(draft, 4, sampled=False))


def _drain(engine, rows, joins=(), steps=200):
    """Step engine (rows submitted at step 0, joins at step 1) until it is idle, at most `steps` steps
    (a lost row would keep it busy or never end); each row's events. After every step each row is
    running, waiting or ended, counted once."""
    events = {row: [] for row in [*rows, *joins]}
    engine.submit(rows)
    for k in range(steps):
        if k == 1:
            engine.submit(joins)
        if not engine.has_work and k > 1:
            break
        for e in engine.step():
            events[e.row].append(e)
        ended = sum(1 for evs in events.values() if evs and evs[-1].finish_reason is not None)
        assert engine.n_running + engine.n_waiting + ended == len(rows) + (len(joins) if k >= 1 else 0)
    assert not engine.has_work and engine.n_running == engine.n_waiting == 0
    return events


def _plain_rows(engine, target):
    """Two sampled rows (the plain engine's) and the tokens each gets alone."""
    settings = [SamplingSettings(max_new_tokens=8, seed=s, temperature=0.9, stop_token_ids=()) for s in (5, 6)]
    rows = [engine.new_row(p, s, seed=s.seed) for p, s in zip(PROMPTS[:2], settings, strict=True)]
    want = [generate(target, [p], s)[0].tokens for p, s in zip(PROMPTS[:2], settings, strict=True)]
    return rows, want


def _assert_finished_alone(events, rows, want):
    for row, tokens in zip(rows, want, strict=True):  # every token of theirs has its event: none dropped
        assert row.finish_reason == "length" and row.tokens == tokens
        assert [e.token for e in events[row]] == tokens and all(e.error is None for e in events[row])


def _assert_failed_once(events, rows, needle):
    for row in rows:
        assert len(events[row]) == 1 and events[row][0].error is row.error and events[row][0].token == -1
        assert row.finish_reason == "error" and needle in str(row.error)


def test_a_speculative_admission_that_fails_fails_its_rows_alone(target, monkeypatch):
    """A draft whose cache cannot be had (its context too short, the check bypassed): the greedy
    rows it takes fail with an event each; the plain rows beside them finish with their own tokens."""
    engine = _engine(target, varied_model(SHORT, seed=1), monkeypatch)
    plain, want = _plain_rows(engine, target)
    spec = [engine.new_row(p, _greedy(12)) for p in PROMPTS[2:]]
    events = _drain(engine, plain, spec)
    _assert_failed_once(events, spec, "exceeds the model's context n_ctx=32")
    _assert_finished_alone(events, plain, want)


def test_rows_joining_running_speculative_rows_fail_alone_when_their_prefill_raises(target, monkeypatch):
    from gpt2kit.engine import Engine, speculate

    real, calls = speculate.prefill_draft, []

    def second_fails(spec, pool, joining):
        calls.append(joining)
        if len(calls) == 2:
            raise RuntimeError("no memory for the joining rows' cache")
        return real(spec, pool, joining)

    monkeypatch.setattr(speculate, "prefill_draft", second_fails)
    engine = Engine(target, proposer=speculate.Proposer(varied_model(CTX, seed=1)))
    first = [engine.new_row(p, _greedy(20)) for p in PROMPTS[:2]]
    late = [engine.new_row(p, _greedy(20)) for p in PROMPTS[2:]]
    events = _drain(engine, first, late)
    _assert_failed_once(events, late, "no memory for the joining rows' cache")
    _assert_finished_alone(events, first, [generate(target, [p], _greedy(20))[0].tokens for p in PROMPTS[:2]])


def test_a_speculative_step_that_raises_fails_its_own_rows_and_keeps_the_others_events(target, monkeypatch):
    """The speculating rows' verify raises at its second step: those rows (running) fail, an event
    each; the plain rows, stepped in the same call, lose no event."""
    from gpt2kit.engine import speculate

    engine = _engine(target, varied_model(CTX, seed=1), monkeypatch)
    real, calls = speculate.verify, []

    def second_raises(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the step failed")
        return real(*args)

    monkeypatch.setattr(speculate, "verify", second_raises)
    plain, want = _plain_rows(engine, target)
    spec = [engine.new_row(p, _greedy(12)) for p in PROMPTS[2:]]
    events = _drain(engine, plain + spec)
    for row in spec:
        assert events[row][-1].error is row.error and "the step failed" in str(row.error)
        assert sum(e.error is not None for e in events[row]) == 1
    _assert_finished_alone(events, plain, want)


def test_a_row_that_ends_on_its_first_token_frees_its_draft_slot(target, monkeypatch):
    """A speculating row whose prompt prefill gave its only token leaves no slot held, in the engine's
    pool or the draft's mirror of it; the next rows take those slots again."""
    engine = _engine(target, varied_model(CTX, seed=1), monkeypatch, max_batch=2)
    rows = [engine.new_row(p, _greedy(1)) for p in PROMPTS[:2]]
    _drain(engine, rows)
    assert all(len(r.tokens) == 1 for r in rows)
    draft_pool = engine.spec.draft_pool
    assert draft_pool is not None and not any(draft_pool.taken(s) for s in range(draft_pool.n_slots))
    assert not any(engine.pool.taken(s) for s in range(engine.pool.n_slots))
    again = [engine.new_row(p, _greedy(6)) for p in PROMPTS[2:]]
    _drain(engine, again)
    assert [r.tokens for r in again] == [generate(target, [p], _greedy(6))[0].tokens for p in PROMPTS[2:]]
