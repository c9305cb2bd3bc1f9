"""Scoring against transformers: per-token log-probabilities with <|endoftext|> context and windows."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import hf_from_ours, random_model

from gpt2kit.config import GPT2Config
from gpt2kit.score import score_text, score_tokens, score_tokens_top
from gpt2kit.tokenizer import Tokenizer

CFG = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=16, n_head=2, n_layer=2)


@pytest.fixture(scope="module")
def models():
    model = random_model(CFG, seed=4)
    return model, hf_from_ours(model)


def _reference_logprob(hf, context: list[int], target: int) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)[target].item()


def test_short_text_every_token_scored_with_eot_context(models):
    model, hf = models
    tok = Tokenizer.default()
    result = score_text(model, tok, "Hello world, this is a test.")
    assert result.tokens == tok.encode("Hello world, this is a test.")
    assert len(result.logprobs) == len(result.tokens)
    seq = [50256, *result.tokens]
    for i, lp in enumerate(result.logprobs):
        assert abs(lp - _reference_logprob(hf, seq[: i + 1], seq[i + 1])) < 1e-4
    assert math.isclose(result.nll, -sum(result.logprobs) / len(result.logprobs))
    assert math.isclose(result.ppl, math.exp(result.nll))
    assert math.isclose(result.bits_per_byte, -sum(result.logprobs) / math.log(2) / 28)


@pytest.mark.parametrize("stride", [32, 1, 63, 17])
def test_sliding_window_contexts(models, stride):
    model, hf = models
    tokens = torch.randint(0, 50257, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    got = score_tokens(model, tokens, stride=stride)
    assert len(got) == 150
    seq = [50256, *tokens]
    # Position j is scored by the first window [b, b + n_ctx) (b a multiple of stride) that reaches it.
    for j in (1, 40, 63, 64, 65, 100, 127, 128, 150):
        b = 0
        while b + CFG.n_ctx <= j:
            b += stride
        assert abs(got[j - 1] - _reference_logprob(hf, seq[b:j], seq[j])) < 1e-4, j


def test_bad_stride_and_empty_text(models):
    model, _ = models
    with pytest.raises(ValueError, match="stride must be in"):
        score_tokens(model, [1, 2], stride=64)
    with pytest.raises(ValueError, match="no tokens"):
        score_tokens(model, [])


@pytest.mark.parametrize("stride", [None, 40])
def test_top_alternatives_come_from_the_same_forward(models, stride):
    """score_tokens_top: the log-probs of score_tokens, and at each position the top-k of the same
    distribution, with one forward per window (a forward hook counts them)."""
    model, _ = models
    n = 40 if stride is None else 100  # 41 positions: one window of n_ctx 64; 101 with stride 40: two
    tokens = torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        lps, tops = score_tokens_top(model, tokens, 4, stride=stride)
    finally:
        hook.remove()
    assert len(calls) == (1 if stride is None else 2)
    assert lps == score_tokens(model, tokens, stride=stride) and len(tops) == len(tokens)
    if stride is None:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([[50256, *tokens]])).logits[0, :-1].float(), -1)
        best = logp.topk(4)
        assert [[t for t, _ in top] for top in tops] == best.indices.tolist()
        assert [[v for _, v in top] for top in tops] == best.values.tolist()
    assert all(len(top) == 4 and top[0][1] >= lp for top, lp in zip(tops, lps, strict=True))
    assert score_tokens_top(model, tokens, 0)[1] == [()] * len(tokens)
    with pytest.raises(ValueError, match="top must be an int >= 0"):
        score_tokens_top(model, tokens, -1)
