"""Beam search against transformers' generate(num_beams=...) on the same random weights: the returned
sequences and their order token for token, scores within 1e-4 (times the length normalisation where a
negative length penalty multiplies the log-probs' sum), batches of prompts of different
lengths (left padding)."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_from_ours, varied_model

from gpt2kit.config import GPT2Config
from gpt2kit.generation import generate, generate_stream
from gpt2kit.sampling import SamplingSettings

CFG = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2)
PROMPTS = [[464, 3290, 318], [7, 8, 9, 10, 11, 12], [50256], [1000, 2000]]
N = 12


@pytest.fixture(scope="module")
def models():
    m = varied_model(CFG)
    return m, hf_from_ours(m)


@pytest.fixture(scope="module")
def frequent_token(models):
    """The token the beams emit most, as the stop token: beams then finish at different lengths."""
    beams = generate(models[0], PROMPTS, SamplingSettings(max_new_tokens=N, num_beams=4, num_return_sequences=4,
                                                          stop_token_ids=()))
    counts = torch.bincount(torch.tensor([t for c in beams for t in c.tokens[1:6]]))
    return int(counts.argmax())


def _hf_beams(hf, prompts, stop, **kw):
    T = max(map(len, prompts))
    ids = torch.tensor([[stop] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, eos_token_id=stop,
                      pad_token_id=stop, return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences[:, T:].tolist(), out.sequences_scores.tolist()


# some_stop: a returned beam ends at the stop token (short beams win when the length penalty is low)
@pytest.mark.parametrize("num_beams, length_penalty, early_stopping, num_return_sequences, some_stop", [
    (4, 1.0, False, 2, False), (3, 0.5, True, 3, True), (4, 2.0, "never", 4, False), (2, -1.0, False, 1, True),
    (5, 0.0, "never", 2, True),
])
def test_beams_equal_transformers_token_for_token(models, frequent_token, num_beams, length_penalty,
                                                  early_stopping, num_return_sequences, some_stop):
    model, hf = models
    kw = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
              num_return_sequences=num_return_sequences)
    want, want_scores = _hf_beams(hf, PROMPTS, frequent_token, **kw)
    got = generate(model, PROMPTS, SamplingSettings(max_new_tokens=N, stop_token_ids=(frequent_token,), **kw))
    assert len(got) == len(want) == len(PROMPTS) * num_return_sequences
    for c, seq, score in zip(got, want, want_scores, strict=True):
        assert c.tokens == seq[:len(c.tokens)] and set(seq[len(c.tokens):]) <= {frequent_token}  # HF pads
        # the score is the log-probs' sum / length ** length_penalty: a negative penalty multiplies the
        # sum's float rounding by up to (prompt + N) ** -penalty (on an AVX-512 Xeon: 1.6e-4 at -1.0, 12 tokens)
        assert abs(c.score - score) < 1e-4 * max(1.0, (max(map(len, PROMPTS)) + N) ** -length_penalty)
        assert c.finish_reason == ("stop" if c.tokens[-1] == frequent_token else "length")
    assert any(c.finish_reason == "stop" for c in got) == some_stop
    assert [(c.prompt_index, c.sample_index) for c in got] == [
        (i, j) for i in range(len(PROMPTS)) for j in range(num_return_sequences)]


def test_beams_in_smaller_batches_are_the_same(models, frequent_token):
    s = SamplingSettings(max_new_tokens=N, num_beams=3, num_return_sequences=2, stop_token_ids=(frequent_token,))
    whole = generate(models[0], PROMPTS, s)
    parts = generate(models[0], PROMPTS, s, batch_size=3)  # one prompt's beams at a time
    assert [c.tokens for c in parts] == [c.tokens for c in whole]
    assert all(abs(a.score - b.score) < 1e-5 for a, b in zip(parts, whole, strict=True))


def test_without_a_stop_token_every_beam_runs_to_the_length(models):
    s = dict(max_new_tokens=N, stop_token_ids=())
    beams = generate(models[0], PROMPTS, SamplingSettings(num_beams=2, length_penalty=0.0, **s))
    assert all(len(c.tokens) == N for c in beams)  # no stop token: every beam runs to the length


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_beams=0), "num_beams must be an integer in [1, 64]"),
    (dict(num_beams=65), "num_beams must be an integer in [1, 64]"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences must be an integer in [1, num_beams=2], got 3"),
    (dict(num_beams=2, early_stopping="sometimes"), 'early_stopping must be True, False or "never"'),
    (dict(num_beams=2, repetition_penalty=1.2), "beam search (num_beams=2) takes no repetition_penalty"),
    (dict(num_beams=2, num_samples=2), "num_samples must be 1"),
])
def test_bad_beam_settings_are_one_clear_error(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingSettings(**kwargs)
    assert needle in str(e.value)


def test_streaming_beams_is_a_clear_error(models):
    with pytest.raises(ValueError, match="streaming is not defined for beam search"):
        generate_stream(models[0], PROMPTS, SamplingSettings(num_beams=2))
    with pytest.raises(ValueError, match="must be at most n_ctx=64"):
        generate(models[0], [[1] * 60], SamplingSettings(num_beams=2, max_new_tokens=10))


@torch.no_grad()
def _logprob_sum(model, prompt: list[int], tokens: list[int]) -> float:
    """The tokens' log-probs after the prompt, summed in float64 (one uncached forward)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()  # (len(tokens), V)
    return logits.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)].sum().item()


# transformers marks empty slots -1e9 and divides in float32: here a real score of -1.5e11 (-5 at 50
# tokens) lost to an empty slot, and 8 ** 50 overflowed to a score of -0.0
@pytest.mark.parametrize("length_penalty, n", [(-5.0, 50), (-10.0, 20), (-100.0, 8), (50.0, 8), (100.0, 8)])
def test_extreme_length_penalties_score_real_beams_in_order(models, frequent_token, length_penalty, n):
    model = models[0]
    s = SamplingSettings(max_new_tokens=n, num_beams=3, num_return_sequences=3, length_penalty=length_penalty,
                         stop_token_ids=(frequent_token,))
    got = generate(model, PROMPTS[:2], s)
    for i, p in enumerate(PROMPTS[:2]):
        beams = [c for c in got if c.prompt_index == i]
        assert [b.score for b in beams] == sorted((b.score for b in beams), reverse=True)  # best first
        assert len({tuple(b.tokens) for b in beams}) == 3  # three beams, none an empty slot
        for b in beams:
            want = _logprob_sum(model, p, b.tokens) / float(len(b.tokens)) ** length_penalty  # float64
            assert b.score < 0 and abs(b.score - want) <= 1e-4 * abs(want), (b.tokens, b.score, want)
            assert b.finish_reason == ("stop" if b.tokens[-1] == frequent_token else "length")
            assert b.finish_reason == "stop" or len(b.tokens) == n


def test_a_length_penalty_beyond_float64_is_refused():
    SamplingSettings(num_beams=2, max_new_tokens=1024, length_penalty=100)  # GPT-2's context: within range
    with pytest.raises(ValueError, match=r"length_penalty must be a number in \[-91.81, 91.81\] with "
                                         r"max_new_tokens=2048"):
        SamplingSettings(num_beams=2, max_new_tokens=2048, length_penalty=100)
