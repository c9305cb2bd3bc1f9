"""Contrastive search against a reference written here from Su et al.'s formula (transformers 5
moved its contrastive search out of the library): uncached transformers forwards, every candidate
scored (1 - alpha) p(v) - alpha max_j cos(h_v, h_j) with h the last hidden states."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_from_ours, varied_model

from gpt2kit.config import GPT2Config
from gpt2kit.engine.contrastive import contrastive_scores
from gpt2kit.generate import generate, generate_stream
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
