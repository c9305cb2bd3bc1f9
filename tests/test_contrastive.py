"""Contrastive search against a reference written here from Su et al.'s formula (transformers 5
moved its contrastive search out of the library): uncached transformers forwards, every candidate
scored (1 - alpha) p(v) - alpha max_j cos(h_v, h_j) with h the last hidden states. A search holds
one cache row per prompt (its candidates one forward of top_k tokens), in a server's engine a slot
lent to it (Engine.new_lease)."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_from_ours, varied_model

from gpt2kit.config import GPT2Config
from gpt2kit.engine import Engine
from gpt2kit.engine.contrastive import contrastive_in_slots, contrastive_scores
from gpt2kit.generation import generate, generate_stream
from gpt2kit.sampling import SamplingSettings

CFG = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2)
PROMPTS = [[464, 3290, 318, 257], [7, 8, 9, 10, 11, 12, 13], [50256]]


@pytest.fixture(scope="module")
def models():
    m = varied_model(CFG)
    return m, hf_from_ours(m)


@torch.no_grad()
def _reference(hf, prompt: list[int], n: int, alpha: float, k: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        probs = out.logits[0, -1].softmax(-1)
        context = out.hidden_states[-1][0]  # (S, C): after ln_f
        top_p, top_ids = probs.topk(k)
        best, best_score = None, -float("inf")
        for p, v in zip(top_p.tolist(), top_ids.tolist(), strict=True):
            h = hf(torch.tensor([seq + [v]]), output_hidden_states=True).hidden_states[-1][0, -1]  # (C,)
            penalty = torch.nn.functional.cosine_similarity(context, h[None], dim=-1).max().item()
            score = (1 - alpha) * p - alpha * penalty
            if score > best_score:
                best, best_score = v, score
        seq.append(best)
    return seq[len(prompt):]


@pytest.mark.parametrize("alpha, k", [(0.6, 4), (0.3, 6)])
def test_contrastive_search_equals_the_papers_formula_on_3_prompts_x_40_tokens(models, alpha, k):
    model, hf = models
    got = generate(model, PROMPTS, SamplingSettings(max_new_tokens=40, penalty_alpha=alpha, top_k=k,
                                                    stop_token_ids=()))
    for c, p in zip(got, PROMPTS, strict=True):
        assert c.tokens == _reference(hf, p, 40, alpha, k)
        assert c.finish_reason == "length"


def test_alpha_zero_is_greedy_and_contrastive_differs_from_greedy(models):
    model = models[0]
    greedy = generate(model, PROMPTS, SamplingSettings(max_new_tokens=20, temperature=0, stop_token_ids=()))
    near0 = generate(model, PROMPTS, SamplingSettings(max_new_tokens=20, penalty_alpha=1e-9, top_k=4,
                                                      stop_token_ids=()))
    assert [c.tokens for c in near0] == [c.tokens for c in greedy]
    strong = generate(model, PROMPTS, SamplingSettings(max_new_tokens=20, penalty_alpha=0.9, top_k=8,
                                                       stop_token_ids=()))
    assert [c.tokens for c in strong] != [c.tokens for c in greedy]


def test_scores_exclude_padding_from_the_penalty():
    probs = torch.tensor([[0.6, 0.4]])
    context = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (1, 2, 2)
    cand = torch.tensor([[[0.0, 1.0], [1.0, 1.0]]])  # (1, 2, 2)
    full = contrastive_scores(probs, context, torch.tensor([[1, 1]]), cand, 0.5)
    padded = contrastive_scores(probs, context, torch.tensor([[1, 0]]), cand, 0.5)  # column 1 is padding
    assert torch.allclose(full, torch.tensor([[0.3 - 0.5, 0.2 - 0.5 * 2 ** -0.5]]))
    assert torch.allclose(padded, torch.tensor([[0.3, 0.2 - 0.5 * 2 ** -0.5]]))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(penalty_alpha=1.5, top_k=4), "penalty_alpha must be a number in [0, 1]"),
    (dict(penalty_alpha=-0.1, top_k=4), "penalty_alpha must be a number in [0, 1]"),
    (dict(penalty_alpha=0.5, top_k=4, num_beams=2), "choose one"),
    (dict(penalty_alpha=0.5, top_k=4, repetition_penalty=1.2), "contrastive search (penalty_alpha=0.5) takes no"),
])
def test_bad_contrastive_settings_are_one_clear_error(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingSettings(**kwargs)
    assert needle in str(e.value)


def test_contrastive_stream_is_a_clear_error(models):
    with pytest.raises(ValueError, match="not streamed"):
        generate_stream(models[0], PROMPTS, SamplingSettings(penalty_alpha=0.5, top_k=4))


def test_a_search_holds_one_cache_row_per_prompt_whatever_top_k(models):
    """The k candidates are k tokens of one forward over their row's cache, not k copies of it."""
    model = models[0]
    rows: list[tuple[int, int]] = []  # (cache rows, new tokens) of every attention call
    hook = model.h[0].attn.register_forward_pre_hook(lambda _m, args: rows.append((args[2].kv.shape[1],
                                                                                   args[0].shape[1])))
    try:
        generate(model, PROMPTS, SamplingSettings(max_new_tokens=5, penalty_alpha=0.6, top_k=6, stop_token_ids=()))
    finally:
        hook.remove()
    assert max(r for r, _ in rows) == len(PROMPTS) and (len(PROMPTS), 6) in rows


def _run_beside(engine, search):
    """Step the engine and the search (a contrastive_in_slots generator) in turns, as EngineLoop
    does, until both are done; the search's result and the most slots the engine held."""
    result, most = None, 0
    while result is None or engine.has_work:
        if result is None:
            try:
                next(search)
            except StopIteration as done:
                result = done.value
        engine.step()
        most = max(most, engine.n_running)
    return result, most


def test_contrastive_search_in_leased_slots_beside_other_rows(models):
    """Each prompt's search runs in a slot of the engine's cache (Engine.new_lease), counted against
    max_batch like any row: the same tokens as the Python API, the greedy row beside it its own."""
    model = models[0]
    s = SamplingSettings(max_new_tokens=12, penalty_alpha=0.6, top_k=4, stop_token_ids=())
    greedy_s = SamplingSettings(max_new_tokens=20, temperature=0, stop_token_ids=())
    engine = Engine(model, max_batch=2)
    greedy = engine.new_row(PROMPTS[0], greedy_s)
    leases = [engine.new_lease(p, s) for p in PROMPTS[1:]]
    engine.submit([greedy, *leases])  # 3 rows, 2 slots: the second prompt waits for one
    found, most = _run_beside(engine, contrastive_in_slots(model, leases, s))
    assert found == [c.tokens for c in generate(model, PROMPTS[1:], s)]
    assert greedy.tokens == generate(model, [PROMPTS[0]], greedy_s)[0].tokens
    assert most == 2 and engine.n_running == 0 and engine.pool.n_free == 2  # every slot given back


def test_a_slot_taken_back_fails_the_search_and_a_lease_needs_max_batch(models):
    model = models[0]
    s = SamplingSettings(max_new_tokens=12, penalty_alpha=0.6, top_k=4)
    engine = Engine(model, max_batch=2)
    lease = engine.new_lease(PROMPTS[0], s)
    engine.submit([lease])
    search = contrastive_in_slots(model, [lease], s)
    next(search)  # no slot yet
    engine.step()  # it joins
    next(search)
    assert engine.n_running == 1 and lease.lease.cache is not None
    assert engine.reset() == [lease]  # a failed step: every row is dropped
    with pytest.raises(RuntimeError, match="took back the slot"):
        next(search)
    with pytest.raises(ValueError, match="a slot lease needs an engine with max_batch"):
        Engine(model).new_lease(PROMPTS[0], s)
