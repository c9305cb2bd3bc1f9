"""Generation: warpers vs transformers, greedy vs transformers' generate, cache vs full forward,
batch independence, seeds, stops, streaming, the context overflow rule, and the CLI."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch
from helpers import SMALL, cached_real_gpt2, error_lines, hf_from_ours, needs_real_gpt2, random_model, varied_model

import gpt2kit.generation as gen
from gpt2kit.checkpoint import save_model
from gpt2kit.config import GPT2Config
from gpt2kit.decode import decode_step, prefill
from gpt2kit.generation import generate, generate_stream, stream_text
from gpt2kit.kv_cache import KVCache
from gpt2kit.sampling import SamplingSettings, sampler
from gpt2kit.sampling.sampler import top_k_filter, top_p_filter, warp
from gpt2kit.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0, max_new_tokens=16, stop_token_ids=())
PROMPTS = [[464, 2068, 7586, 21831], [15496], [40, 588, 257, 922, 1110, 13, 383]]  # lengths 4, 1, 7


@pytest.fixture(scope="module")
def model():
    return varied_model(SMALL, seed=0)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


def tokens_of(completions):
    return [c.tokens for c in completions]


# --- settings -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -0.5}, r"temperature must be a number >= 0 .*-0\.5"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\].*0\.0"),
    ({"top_p": 1.5}, r"top_p .*1\.5"),
    ({"top_k": -1}, r"top_k must be an integer >= 0.*-1"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1.*0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-45}, r"repetition_penalty must be a number >= 0\.01 .*1e-45"),
    ({"frequency_penalty": 1e30}, r"frequency_penalty must be a number in \[-1e9, 1e9\]"),
    ({"presence_penalty": -1e30}, "presence_penalty"),
    ({"logit_bias": {5: 1e30}}, r"logit_bias\[5\] must be a number in \[-1e9, 1e9\]"),
    ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias names token id 5 more than once"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias token id must be an integer"),
    ({"logit_bias": {True: 1.0}}, "logit_bias token id must be an integer"),
    ({"logit_bias": [(5,)]}, "logit_bias must map token ids to biases"),
    ({"top_p_mode": "nucleus"}, "openai, hf"),
    ({"num_samples": 0}, "num_samples"),
    ({"stop_strings": ("",)}, "stop_strings"),
    ({"seed": -1}, "seed"),
    ({"pack_weights": "yes"}, "pack_weights must be None"),
])
def test_settings_reject_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingSettings(**kwargs)


def test_tiny_temperatures_are_greedy_and_never_overflow(model):
    """Dividing by 1e-45 made the logits inf and the draw raise; below GREEDY_BELOW it is the argmax."""
    from gpt2kit.sampling import GREEDY_BELOW

    greedy = generate(model, [[464, 2068]], SamplingSettings(max_new_tokens=8, temperature=0, stop_token_ids=()))
    for t in (1e-45, 5e-324, GREEDY_BELOW / 2):
        s = SamplingSettings(max_new_tokens=8, temperature=t, seed=3, stop_token_ids=())
        assert s.greedy and tokens_of(generate(model, [[464, 2068]], s)) == tokens_of(greedy)
    s = SamplingSettings(max_new_tokens=8, temperature=GREEDY_BELOW, seed=3, stop_token_ids=(),
                         repetition_penalty=0.01, logit_bias={13: 1e9}, frequency_penalty=-1e9)
    assert not s.greedy and len(generate(model, [[464, 2068]], s)[0].tokens) == 8  # the extremes stay finite


def test_prompt_checks(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[]], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[50257]], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, [[1]], SamplingSettings(stop_strings=("x",)))
    with pytest.raises(ValueError, match="batch_size"):
        generate(model, [[1]], GREEDY, batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        generate_stream(model, [[1], []], GREEDY)  # raised at the call, not at the first step
    ids = torch.tensor([PROMPTS[0]])
    from_tensor = generate(model, ids, GREEDY)[0]
    assert from_tensor.prompt_tokens == PROMPTS[0]
    assert from_tensor.tokens == generate(model, [PROMPTS[0]], GREEDY)[0].tokens


# --- warpers against transformers and by hand -----------------------------------------------

def _random_logits(B=4, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


@pytest.mark.parametrize("k", [1, 5, 50, 299, 300, 1000])
def test_top_k_matches_transformers(k):
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = _random_logits()
    ids = torch.zeros(4, 1, dtype=torch.long)
    assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(ids, logits.clone()))


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.99])
def test_top_p_hf_mode_matches_transformers(p):
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = _random_logits(seed=1)
    ids = torch.zeros(4, 1, dtype=torch.long)
    assert torch.equal(top_p_filter(logits, p, "hf"), TopPLogitsWarper(p)(ids, logits.clone()))


def test_top_p_both_semantics_by_hand():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # sorted: 0.5, 0.3, 0.15, 0.05; cum 0.5, 0.8, 0.95, 1
    logits = probs.log()

    def kept(p, mode):
        return torch.isfinite(top_p_filter(logits, p, mode))[0].nonzero().flatten().tolist()

    # OpenAI: tokens whose cumulative probability stays <= p, at least one.
    assert kept(0.85, "openai") == [1, 3]
    assert kept(0.6, "openai") == [1]
    assert kept(0.4, "openai") == [1]  # none stays <= 0.4: the top token is kept anyway
    assert kept(0.97, "openai") == [1, 2, 3]
    # transformers: also the token that crosses p.
    assert kept(0.85, "hf") == [1, 2, 3]
    assert kept(0.6, "hf") == [1, 3]
    assert kept(0.4, "hf") == [1]
    assert kept(0.97, "hf") == [0, 1, 2, 3]


def test_top_p_openai_matches_sample_py_formula():
    # sample.py: min_value = sorted_logits[max(sum(cum <= p) - 1, 0)]; drop logits < min_value.
    logits = _random_logits(seed=2)
    for p in (0.1, 0.5, 0.9):
        sorted_logits = logits.sort(-1, descending=True).values
        cum = sorted_logits.softmax(-1).cumsum(-1)
        idx = ((cum <= p).sum(-1) - 1).clamp(min=0)
        min_values = sorted_logits[torch.arange(4), idx][:, None]
        want = torch.where(logits < min_values, torch.full_like(logits, -math.inf), logits)
        assert torch.equal(top_p_filter(logits, p, "openai"), want)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _random_logits(B=2, V=50, seed=3)
    ids = torch.tensor([[1, 5, 5, 7], [0, 2, 49, 3]])
    seen = torch.zeros(2, 50, dtype=torch.bool).scatter_(1, ids, True)
    ours = sampler.apply_repetition_penalty(logits, seen, 1.3)
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone()))


def test_warp_order_is_temperature_topk_topp_as_transformers():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = _random_logits(B=3, V=200, seed=4)
    ids = torch.tensor([[3, 4], [5, 6], [7, 7]])
    seen = torch.zeros(3, 200, dtype=torch.bool).scatter_(1, ids, True)
    s = SamplingSettings(temperature=0.7, top_k=40, top_p=0.8, top_p_mode="hf", repetition_penalty=1.2)
    hf = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7),
                              TopKLogitsWarper(40), TopPLogitsWarper(0.8)])
    torch.testing.assert_close(warp(logits, s, seen), hf(ids, logits.clone()), rtol=0, atol=1e-6)


def test_sampling_respects_the_filters(model):
    # top_k=1 and a tiny top_p leave one token: sampling must then equal greedy.
    want = tokens_of(generate(model, PROMPTS, GREEDY))
    for s in (SamplingSettings(top_k=1, seed=3), SamplingSettings(top_p=1e-6, seed=4),
              SamplingSettings(top_p=1e-6, top_p_mode="hf", seed=5)):
        s = SamplingSettings(**{**s.__dict__, "max_new_tokens": 16, "stop_token_ids": ()})
        assert tokens_of(generate(model, PROMPTS, s)) == want


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sampler.sample(probs.log(), [g]) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, probs[0], rtol=0, atol=0.03)  # ~4 sigma


# --- the model steps: cached decode = full forward ------------------------------------------

def test_cached_decode_logits_equal_full_forward():
    # A left-padded batch of two prompts; the padded row must give its unpadded logits. GPT-2's
    # init (logits of order 1) so that 1e-5 is a tight absolute tolerance.
    model = random_model(SMALL, seed=2)
    rows = [[464, 2068, 7586, 21831, 11], [15496, 995]]
    B, T = 2, 5
    idx = torch.tensor([rows[0], [0, 0, 0] + rows[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    new = torch.tensor([[318, 257, 1332, 13], [11, 616, 3290, 2]])  # (B, 4) tokens fed one by one
    cache = KVCache.for_model(model, B, T + new.shape[1])
    got = [prefill(model, idx, mask, cache)]
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    for i in range(new.shape[1]):
        got.append(decode_step(model, new[:, i:i + 1], cache, full_mask[:, :T + i + 1]))
    with torch.no_grad():
        for r, row in enumerate(rows):
            seq = torch.tensor([row + new[r].tolist()])
            ref = model(seq).logits[0, len(row) - 1:]  # (steps, V) without cache or padding
            torch.testing.assert_close(torch.stack([g[r] for g in got]), ref, rtol=0, atol=1e-5)


# --- greedy against transformers ------------------------------------------------------------

def _hf_greedy(hf, prompt, n, eos=None, **kw):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      pad_token_id=0, eos_token_id=eos, **kw)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_token_for_token(model):
    hf = hf_from_ours(model)
    batched = tokens_of(generate(model, PROMPTS, GREEDY))  # one batch, three lengths, left-padded
    alone = [generate(model, [p], GREEDY)[0].tokens for p in PROMPTS]
    want = [_hf_greedy(hf, p, GREEDY.max_new_tokens) for p in PROMPTS]
    assert batched == alone == want
    assert all(len(set(t)) > 3 for t in want), "the test model should not just repeat one token"
    # transformers' own left-padded batch agrees too.
    T = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                      eos_token_id=None)
    assert out[:, T:].tolist() == want


def test_greedy_with_repetition_penalty_equals_transformers(model):
    hf = hf_from_ours(model)
    s = SamplingSettings(temperature=0, max_new_tokens=16, stop_token_ids=(), repetition_penalty=1.5)
    got = tokens_of(generate(model, PROMPTS, s))
    want = [_hf_greedy(hf, p, 16, repetition_penalty=1.5) for p in PROMPTS]
    assert got == want
    assert got != tokens_of(generate(model, PROMPTS, GREEDY))


def test_stop_token_ends_the_row_like_transformers(model):
    free = tokens_of(generate(model, PROMPTS, GREEDY))
    stop = free[0][5]  # a token row 0 produces at step 6 (and maybe earlier)
    s = SamplingSettings(temperature=0, max_new_tokens=16, stop_token_ids=(stop,))
    got = generate(model, PROMPTS, s)
    hf = hf_from_ours(model)
    for c, f, p in zip(got, free, PROMPTS, strict=True):
        if stop in f:
            cut = f.index(stop) + 1
            assert c.tokens == f[:cut] and c.finish_reason == "stop"  # stop token kept in tokens
        else:
            assert c.tokens == f and c.finish_reason == "length"
        want = _hf_greedy(hf, p, 16, eos=stop)
        assert c.tokens == [t for i, t in enumerate(want) if stop not in want[:i]]  # HF pads after eos
    assert got[0].finish_reason == "stop"


# --- batches, seeds, samples -----------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    GREEDY,
    SamplingSettings(max_new_tokens=16, seed=7, stop_token_ids=(), top_k=100, top_p=0.95),
    SamplingSettings(max_new_tokens=16, seed=7, stop_token_ids=(), num_samples=2, repetition_penalty=1.2),
])
def test_rows_get_what_they_get_alone(model, settings):
    """Greedy exactly; sampling too, since each row has its own RNG (seed, sample index) — it
    could only differ if batch-shape rounding tipped a draw, which does not happen here."""
    n = settings.num_samples
    batched = tokens_of(generate(model, PROMPTS, settings))
    for bs in (1, 2):
        assert tokens_of(generate(model, PROMPTS, settings, batch_size=bs)) == batched
    for i, p in enumerate(PROMPTS):
        assert tokens_of(generate(model, [p], settings)) == batched[i * n:(i + 1) * n]
    # The same prompt gives the same sample wherever it sits in the batch.
    assert tokens_of(generate(model, PROMPTS[::-1], settings))[:n] == batched[-n:]


def test_finished_rows_leave_the_batch_and_others_are_unchanged(model):
    free = tokens_of(generate(model, PROMPTS, GREEDY))
    stop = free[1][2]  # row 1 stops after 3 tokens
    s = SamplingSettings(temperature=0, max_new_tokens=16, stop_token_ids=(stop,))
    steps = list(generate_stream(model, PROMPTS, s))
    assert len(steps[3].tokens) < 3  # row 1 is no longer in the batch
    got = tokens_of(generate(model, PROMPTS, s))
    for c, alone in zip(got, [generate(model, [p], s)[0].tokens for p in PROMPTS], strict=True):
        assert c == alone


def test_same_seed_same_output_different_seed_different(model):
    s = SamplingSettings(max_new_tokens=20, seed=123, stop_token_ids=())
    a = tokens_of(generate(model, PROMPTS, s))
    assert tokens_of(generate(model, PROMPTS, s)) == a
    b = tokens_of(generate(model, PROMPTS, SamplingSettings(max_new_tokens=20, seed=124, stop_token_ids=())))
    assert all(x != y for x, y in zip(a, b, strict=True))
    torch.manual_seed(5)  # seed=None draws from torch's global RNG
    c = tokens_of(generate(model, PROMPTS, SamplingSettings(max_new_tokens=20, stop_token_ids=())))
    torch.manual_seed(5)
    assert tokens_of(generate(model, PROMPTS, SamplingSettings(max_new_tokens=20, stop_token_ids=()))) == c


def test_num_samples(model, tok):
    s = SamplingSettings(max_new_tokens=12, seed=1, num_samples=3, stop_token_ids=())
    out = generate(model, ["Hello", "The cat"], s, tokenizer=tok)
    assert [(c.index, c.prompt_index, c.sample_index) for c in out] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    assert [c.prompt_tokens for c in out] == [tok.encode("Hello")] * 3 + [tok.encode("The cat")] * 3
    assert len({tuple(c.tokens) for c in out[:3]}) == 3  # three different samples of one prompt
    assert all(len(c.tokens) == 12 and c.finish_reason == "length" for c in out)
    assert all(c.text == tok.decode(c.tokens) for c in out)


# --- stop strings and streaming text --------------------------------------------------------

def test_stop_strings(model, tok):
    s = SamplingSettings(max_new_tokens=40, seed=2, stop_token_ids=())
    free = generate(model, ["Once upon a time"], s, tokenizer=tok)[0]
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a stop string from the middle of the text
    got = generate(model, ["Once upon a time"], SamplingSettings(**{**s.__dict__, "stop_strings": (stop,)}),
                   tokenizer=tok)[0]
    assert got.finish_reason == "stop"
    assert got.text == text[: text.index(stop)]
    assert free.tokens[: len(got.tokens)] == got.tokens  # tokens up to the one completing the stop
    assert stop in tok.decode(got.tokens) and stop not in tok.decode(got.tokens[:-1])
    absent = generate(model, ["Once upon a time"], SamplingSettings(**{**s.__dict__, "stop_strings": ("\x00",)}),
                      tokenizer=tok)[0]
    assert absent.finish_reason == "length" and absent.text == text


def _scripted(monkeypatch, script: list[int]):
    """Make the sampler emit `script` (one row), to test the text layer on chosen tokens."""
    calls = iter(script)
    monkeypatch.setattr(sampler, "next_tokens", lambda logits, *a: torch.tensor([next(calls)] * logits.shape[0]))


@pytest.mark.parametrize("text", ["héllo 😀 世界 naïve café 🎉🎉", "plain ascii, nothing split"])
def test_stream_pieces_are_whole_characters_and_concatenate(model, tok, monkeypatch, text):
    ids = tok.encode(text)
    # The emoji text does split characters across tokens (a lone token decodes to U+FFFD).
    assert any("\ufffd" in tok.decode([i]) for i in ids) == ("😀" in text)
    _scripted(monkeypatch, ids)
    pieces = list(stream_text(model, tok, "x", SamplingSettings(max_new_tokens=len(ids), stop_token_ids=())))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 3


@pytest.mark.parametrize("text,stops,want,reason", [
    ("abc\n\ndef", ("\n\n",), "abc", "stop"),
    ("a\nb\nc", ("\n\n",), "a\nb\nc", "length"),  # held-back "\n" released when it is not a stop
    ("one two. three", ("two.", "t"), "one ", "stop"),  # the earliest stop wins
    ("xyz END", ("END",), "xyz ", "stop"),
])
def test_stop_strings_hold_back_and_cut(model, tok, monkeypatch, text, stops, want, reason):
    ids = tok.encode(text)
    _scripted(monkeypatch, ids)
    s = SamplingSettings(max_new_tokens=len(ids), stop_token_ids=(), stop_strings=stops)
    steps = list(generate_stream(model, [[1]], s, tokenizer=tok))
    assert "".join(st.text[0] for st in steps) == want
    assert steps[-1].finished == {0: reason}
    for st in steps:  # no emitted piece ever contains (part of) what was cut
        assert not any(stop in st.text[0] for stop in stops)


def test_stop_token_text_excludes_it_and_flushes(model, tok, monkeypatch):
    ids = tok.encode("ok 😀")[:-1] + [50256]  # ends inside the emoji, then <|endoftext|>
    _scripted(monkeypatch, ids)
    s = SamplingSettings(max_new_tokens=10)
    out = generate(model, [[1]], s, tokenizer=tok)[0]
    assert out.finish_reason == "stop" and out.tokens == ids
    assert out.text == tok.decode(ids[:-1]) and out.text.endswith("\ufffd")  # incomplete char flushed


# --- past the context ------------------------------------------------------------------------

def _follows_the_overflow_rule(model, prompt, tokens, window):
    """The documented rule, without a cache: see at most n_ctx tokens; when the sequence would
    exceed n_ctx, keep its last `window` tokens. Each generated token must be that context's argmax,
    up to a near-tie (1e-4: batched and single-row products differ in their last bits)."""
    seq, start, n_ctx = list(prompt), 0, model.config.n_ctx
    for i, token in enumerate(tokens):
        if len(seq) - start > n_ctx:
            start = len(seq) - window
        with torch.no_grad():
            logits = model(torch.tensor([seq[start:]])).logits[0, -1]
        assert logits.max() - logits[token] <= 1e-4, f"token {i}: {token} is not the argmax {int(logits.argmax())}"
        seq.append(token)
    return True


@pytest.mark.parametrize("window", [None, 10, 31])
def test_generation_continues_past_the_context(window):
    cfg = GPT2Config(n_vocab=50257, n_ctx=32, n_embd=32, n_head=4, n_layer=2)
    model = varied_model(cfg, seed=3)
    prompts = [list(range(100, 125)), [7, 8], list(range(200, 240))]  # 25, 2 and 40 (> n_ctx) tokens
    s = SamplingSettings(temperature=0, max_new_tokens=70, stop_token_ids=(), window=window)
    got = tokens_of(generate(model, prompts, s))
    for p, t in zip(prompts, got, strict=True):
        assert len(t) == 70 and _follows_the_overflow_rule(model, p, t, window or 16)
        assert _follows_the_overflow_rule(model, p, generate(model, [p], s)[0].tokens, window or 16)


def test_strict_mode_raises_instead(model):
    n_ctx = model.config.n_ctx
    s = SamplingSettings(temperature=0, max_new_tokens=10, strict=True)
    generate(model, [[1] * (n_ctx - 9)], s)  # exactly fits: the last token needs no position
    with pytest.raises(ValueError, match=r"prompt 0 has 56 tokens.*n_ctx=64.*strict"):
        generate(model, [[1] * (n_ctx - 8)], s)
    with pytest.raises(ValueError, match="window"):
        generate(model, [[1]], SamplingSettings(window=n_ctx))


@pytest.mark.parametrize("settings, needle", [
    (SamplingSettings(window=64), "window must be below the context n_ctx=64, got 64"),
    (SamplingSettings(stop_token_ids=(50257,)), "stop token id 50257 is outside the vocabulary [0, 50257)"),
    (SamplingSettings(temperature=0, stop_strings=("x",)), "stop_strings need a tokenizer"),
    (SamplingSettings(max_new_tokens=61, num_beams=2), "(4 tokens) + max_new_tokens=61 must be at most n_ctx=64"),
    (SamplingSettings(max_new_tokens=58, prompt_lookup=3), "max_new_tokens=58 + 3 draft tokens must be at most n_ctx"),
])
def test_the_library_and_the_engine_refuse_a_request_in_one_words(model, settings, needle):
    # one check (gpt2kit.engine.checks) for generate, the CLI through it, the server and the engine's rows
    from gpt2kit.engine import Engine

    with pytest.raises(ValueError) as lib:
        generate(model, [[1, 2, 3, 4]], settings)
    make = Engine(model).new_beam_rows if settings.num_beams > 1 else Engine(model).new_row
    with pytest.raises(ValueError) as row:
        make([1, 2, 3, 4], settings, **({} if settings.num_beams > 1 else {"seed": 0}))
    assert needle in str(lib.value) and str(row.value) == str(lib.value)


def test_bfloat16_model_generates(model):
    m16 = varied_model(SMALL, seed=0).to(torch.bfloat16)
    out = generate(m16, PROMPTS, SamplingSettings(max_new_tokens=8, seed=0, stop_token_ids=()))
    assert all(len(c.tokens) == 8 for c in out)
    # The first greedy token agrees with float32 (later ones may not: bfloat16 logits of this
    # model's size are rounded to 0.25, so near-ties break differently).
    g16 = tokens_of(generate(m16, PROMPTS, GREEDY))
    g32 = tokens_of(generate(model, PROMPTS, GREEDY))
    assert [t[0] for t in g16] == [t[0] for t in g32]


@needs_real_gpt2
def test_golden_greedy_generation_with_real_weights(monkeypatch):
    from gpt2kit.checkpoint import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model(cached_real_gpt2())
    got = generate(model, [[464, 3290]], SamplingSettings(temperature=0, max_new_tokens=18, stop_token_ids=()))
    # "The dog was found in a field near the intersection of West and West Streets.\n\nThe dog"
    assert got[0].tokens == [373, 1043, 287, 257, 2214, 1474, 262, 16246, 286, 2688, 290, 2688, 27262, 13,
                             198, 198, 464, 3290]


# --- CLI --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("gen_model")
    save_model(model, d)
    return d


def run_cli(capsys, monkeypatch, argv, stdin=None):
    from gpt2kit.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_matches_library(capsys, monkeypatch, model_dir, model, tok):
    code, out, err = run_cli(capsys, monkeypatch, ["Hello world", "-m", str(model_dir), "--json", "--greedy",
                                                   "--max-new-tokens", "10", "--ignore-eot"])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 1
    want = generate(model, "Hello world", SamplingSettings(temperature=0, max_new_tokens=10, stop_token_ids=()),
                    tokenizer=tok)[0]
    assert lines[0] == {"prompt_index": 0, "sample_index": 0, "prompt": "Hello world",
                        "prompt_tokens": tok.encode("Hello world"), "tokens": want.tokens, "text": want.text,
                        "finish_reason": "length"}


def test_cli_no_pack_weights(capsys, monkeypatch, model_dir):
    from gpt2kit.decode import is_packed

    models = []
    real = gen.generate_stream
    monkeypatch.setattr(gen, "generate_stream", lambda m, *a, **k: models.append(m) or real(m, *a, **k))
    code, out, err = run_cli(capsys, monkeypatch, ["Hi", "-m", str(model_dir), "--greedy", "--max-new-tokens", "3",
                                                   "--num-samples", "2", "--no-pack-weights"])
    assert code == 0, err
    assert models and not is_packed(models[0])  # float32 batch of 2 would be packed by default


def test_cli_prompts_file_plain_and_jsonl_in_order(capsys, monkeypatch, model_dir, tmp_path, tok):
    prompts = ["The", "A much longer prompt than the others", "x"]
    plain = tmp_path / "p.txt"
    plain.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)),
                     encoding="utf-8")
    results = []
    for f, bs in ((plain, "2"), (jsonl, "1")):
        code, out, err = run_cli(capsys, monkeypatch, ["-m", str(model_dir), "--prompts-file", str(f), "--json",
                                                       "--seed", "3", "--max-new-tokens", "6", "--num-samples",
                                                       "2", "--batch-size", bs, "--top-k", "20"])
        assert code == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        assert [x["prompt_tokens"] for x in lines] == [tok.encode(p) for p in prompts for _ in range(2)]
        results.append(lines)
    assert results[0] == results[1]


def test_cli_prompts_file_headers_and_json_lines_name_their_prompt(capsys, monkeypatch, model_dir, tmp_path):
    prompts = ["The", "A much longer prompt than the others, long enough to be cut in the header line"]
    f = tmp_path / "p.txt"
    f.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    common = ["-m", str(model_dir), "--prompts-file", str(f), "--greedy", "--max-new-tokens", "3"]
    code, out, err = run_cli(capsys, monkeypatch, [*common, "--num-samples", "2", "--json"])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(x["prompt_index"], x["sample_index"], x["prompt"]) for x in lines] == [
        (0, 0, prompts[0]), (0, 1, prompts[0]), (1, 0, prompts[1]), (1, 1, prompts[1])]
    code, out, err = run_cli(capsys, monkeypatch, common)
    assert code == 0, err
    headers = [line for line in out.splitlines() if line.startswith("=" * 40)]
    cut = json.dumps(prompts[1][:59] + "\u2026", ensure_ascii=False)
    assert headers == [f"{'=' * 40} PROMPT 1 SAMPLE 1: \"The\" {'=' * 40}",
                       f"{'=' * 40} PROMPT 2 SAMPLE 1: {cut} {'=' * 40}"]
    one = tmp_path / "one.txt"
    one.write_text("Only\n", encoding="utf-8")  # one prompt from a file still says which
    code, out, err = run_cli(capsys, monkeypatch, ["-m", str(model_dir), "--prompts-file", str(one), "--greedy",
                                                   "-n", "2"])
    assert code == 0 and out.startswith(f"{'=' * 40} PROMPT 1 SAMPLE 1: \"Only\" {'=' * 40}\n"), out


def test_cli_generate_help_shows_every_default(capsys):
    from gpt2kit.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    text = text[text.index("options:"):]  # past the usage line
    for flag, default in [("-n MAX_NEW_TOKENS", "(default: 128)"), ("--top-k TOP_K", "(default: 0)"),
                          ("--top-p TOP_P", "(default: 1.0)"), ("--top-p-mode {openai,hf}", "(default: openai)"),
                          ("--repetition-penalty REPETITION_PENALTY", "(default: 1.0)"),
                          ("--num-samples NUM_SAMPLES", "(default: 1)"), ("--batch-size BATCH_SIZE", "(default 8)"),
                          ("--temperature TEMPERATURE, -t TEMPERATURE", "(default 1)"),
                          ("--seed SEED", "default: none"), ("--window WINDOW", "(default n_ctx/2)")]:
        start = text.index(flag)
        assert default in text[start:start + 200], (flag, text[start:start + 200])


def test_cli_interactive_ctrl_c_stops_the_sample_and_at_the_prompt_quits(model_dir):
    import queue
    import signal
    import subprocess
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "gpt2kit", "generate", "-m", str(model_dir), "--interactive",
                             "--max-new-tokens", "100000000", "--ignore-eot", "--seed", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: dict[str, queue.Queue] = {"out": queue.Queue(), "err": queue.Queue()}

    def pump(stream, q):
        for chunk in iter(lambda: stream.read1(4096), b""):
            q.put(chunk)

    pumps = {name: threading.Thread(target=pump, args=(stream, chunks[name]), daemon=True)
             for name, stream in (("out", proc.stdout), ("err", proc.stderr))}
    for t in pumps.values():
        t.start()
    seen = {"out": b"", "err": b""}

    def wait_for(name, done, timeout=180.0):
        import time

        deadline = time.monotonic() + timeout
        while not done(seen[name]):
            try:
                seen[name] += chunks[name].get(timeout=1.0)
            except queue.Empty:
                if pumps[name].is_alive() and time.monotonic() < deadline:  # not at the stream's end yet
                    continue
                proc.kill()
                raise AssertionError(f"ended ({proc.poll()}) or timed out; stdout {seen['out'][-200:]!r}, "
                                     f"stderr {seen['err'][-500:]!r}") from None

    def drain_stopped_sample():
        # The stopped sample's last text and its closing newline are written (and flushed) to stdout
        # before the stderr notice, so they are in the pipe already; read them all before the next
        # prompt, or the next round could mistake them for its own sample and interrupt the prompt.
        wait_for("out", lambda b: b.endswith(b"\n"))
        while True:
            try:
                seen["out"] += chunks["out"].get(timeout=1.0)
            except queue.Empty:
                return

    try:
        for n, prompt in enumerate((b"Hello\n", b"Again\n"), start=1):
            before = len(seen["out"])
            proc.stdin.write(prompt)
            proc.stdin.flush()
            wait_for("out", lambda b, before=before: len(b) > before)  # the sample is streaming (it never ends)
            proc.send_signal(signal.SIGINT)
            wait_for("err", lambda b, n=n: b.count(b"quits)\n") == n)  # back at the prompt, still running
            assert proc.poll() is None, seen
            drain_stopped_sample()
        proc.send_signal(signal.SIGINT)  # Ctrl-C at the prompt quits
        wait_for("err", lambda b: b.endswith(b"gpt2kit: interrupted\n"))
        assert proc.wait(timeout=120) == 130, seen
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_unconditional_starts_from_endoftext(capsys, monkeypatch, model_dir):
    code, out, err = run_cli(capsys, monkeypatch, ["-m", str(model_dir), "--json", "--seed", "1",
                                                   "--max-new-tokens", "5", "--num-samples", "2"])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and all(x["prompt_tokens"] == [50256] for x in lines)


def test_cli_plain_output_and_stop(capsys, monkeypatch, model_dir, model, tok):
    want = generate(model, "Hi", SamplingSettings(max_new_tokens=12, seed=4), tokenizer=tok)[0].text
    code, out, err = run_cli(capsys, monkeypatch, ["Hi", "-m", str(model_dir), "--seed", "4",
                                                   "--max-new-tokens", "12"])
    assert code == 0, err
    assert out == want + "\n"
    stop = want[3:5]
    code, out, _ = run_cli(capsys, monkeypatch, ["Hi", "-m", str(model_dir), "--seed", "4", "--max-new-tokens",
                                                 "12", "--stop", stop, "--stop", "\x01", "--json"])
    line = json.loads(out)
    assert line["text"] == want[: want.index(stop)] and line["finish_reason"] == "stop"


def test_cli_interactive_reads_prompts_until_eof(capsys, monkeypatch, model_dir, tok):
    code, out, err = run_cli(capsys, monkeypatch, ["-m", str(model_dir), "--interactive", "--json", "--greedy",
                                                   "--max-new-tokens", "4"], stdin="Hello\n\nGood morning\n")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["prompt_tokens"] for x in lines] == [tok.encode("Hello"), tok.encode("Good morning")]


@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--num-samples", "0"], "num_samples"),
    (["--prompts-file", "EMPTY"], "no prompts"),
    (["--prompts-file", "BADJSONL"], "line 2"),
    (["--prompts-file", "MISSING"], "no such file"),
    (["--strict", "--max-new-tokens", "60", "a b c d e f g h i j"], "strict"),
    (["--top-p-mode", "nucleus"], "invalid choice"),
    (["--repetition-penalty", "1e-45"], "repetition_penalty must be a number >= 0.01"),
])
def test_cli_bad_values_one_line_nonzero(capsys, monkeypatch, model_dir, tmp_path, argv, needle):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n', encoding="utf-8")
    paths = {"EMPTY": str(empty), "BADJSONL": str(bad), "MISSING": str(tmp_path / "nope.txt")}
    argv = [paths.get(a, a) for a in argv]
    try:
        code, _, err = run_cli(capsys, monkeypatch, ["-m", str(model_dir), *argv])
    except SystemExit as e:  # argparse usage errors exit 2 after printing one line
        code, (_, err) = e.code, capsys.readouterr()
    assert code != 0
    assert len(error_lines(err)) == 1 and needle in err and "Traceback" not in err


def test_seeds_are_bounded_and_prompts_draw_their_own_numbers(model):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        SamplingSettings(seed=2**64)
    s = SamplingSettings(max_new_tokens=12, top_k=0, seed=0, stop_token_ids=())
    a, b = (c.tokens for c in generate(model, [[464], [1212]], s))
    assert generate(model, [[1212]], s)[0].tokens == b  # where a prompt sits in the list does not matter
    from gpt2kit.sampling.sampler import row_generator

    draws = [torch.rand(4, generator=row_generator(0, 0, prompt=p)) for p in ([464], [1212], [464])]
    assert not torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])


def test_too_many_rows_are_refused_before_any_work(model):
    with pytest.raises(ValueError, match="1000000000 rows; at most 65536"):
        generate_stream(model, [[1]], SamplingSettings(num_samples=10**9))


def test_cli_generate_requires_a_model(capsys):
    from gpt2kit.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hello"])
    assert "--model" in capsys.readouterr().err


def test_cli_a_distribution_that_is_not_finite_is_one_line(capsys, monkeypatch, tmp_path):
    """torch's 'probability tensor contains either inf, nan or element < 0' never reaches the user."""
    from helpers import SMALL, varied_model

    from gpt2kit.checkpoint import save_model

    broken = varied_model(SMALL, seed=0)
    with torch.no_grad():
        broken.wpe.weight[3] = float("nan")
    save_model(broken, tmp_path / "nan")
    for extra in ([], ["--greedy"]):
        code, _, err = run_cli(capsys, monkeypatch, ["-m", str(tmp_path / "nan"), "--seed", "1", "-n", "8",
                                                     *extra, "Hello world"])
        assert code != 0 and len(error_lines(err)) == 1, err
        assert "probability tensor" not in err and "Traceback" not in err
        assert "finite" in err or "nan" in err.lower()  # at the draw, or (should loading check it) at load
