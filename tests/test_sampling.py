"""Sampling's transformers warpers and constraints (min-p, typical, epsilon, eta; no repeated n-gram,
bad words, min_new_tokens, suppress_tokens): their settings' checks, exactness against transformers'
own processor classes on the same logits (each alone, and all together in transformers' own order,
from its _get_logits_processor), seeded sampling with them, greedy generation against transformers'
generate, and the CLI."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from helpers import SMALL, TINY, error_lines, hf_from_ours, random_hf_model, varied_model

from gpt2kit.checkpoint import save_model
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings, bad_words_ids
from gpt2kit.sampling.sampler import RowSampler, warp
from gpt2kit.tokenizer import Tokenizer

PROMPTS = [[464, 2068, 7586, 21831], [15496], [40, 588, 257, 922, 1110, 13, 383]]  # lengths 4, 1, 7
TOL = 1e-6  # renormalised probabilities


@pytest.fixture(scope="module")
def model():
    return varied_model(SMALL, seed=0)


def _logits(B=4, V=1000, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor):
    """The same tokens kept (finite logits) and the same renormalised probabilities within TOL."""
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1), rtol=0, atol=TOL)


# --- settings -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    ({"typical_p": 0.0}, r"typical_p must be a number in \(0, 1\] \(1 = off\), got 0\.0"),
    ({"typical_p": 1.5}, r"typical_p must be a number in \(0, 1\].*1\.5"),
    ({"min_p": -0.1}, r"min_p must be a number in \[0, 1\].*-0\.1"),
    ({"min_p": 2}, r"min_p must be a number in \[0, 1\].*2"),
    ({"epsilon_cutoff": 1.0}, r"epsilon_cutoff must be a number in \[0, 1\).*1\.0"),
    ({"eta_cutoff": -1e-3}, r"eta_cutoff must be a number in \[0, 1\).*-0\.001"),
    ({"eta_cutoff": float("nan")}, "eta_cutoff must be a number"),
    ({"no_repeat_ngram_size": -1}, r"no_repeat_ngram_size must be an integer >= 0 \(0 = off\), got -1"),
    ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size must be an integer"),
    ({"min_new_tokens": -1}, r"min_new_tokens must be an integer in \[0, max_new_tokens=128\].*-1"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, r"min_new_tokens must be an integer in \[0, max_new_tokens=8\].*9"),
    ({"bad_words": [[5], []]}, r"bad_words entry 1 must be a non-empty sequence of token ids, got \[\]"),
    ({"bad_words": ["hello"]}, "bad_words entry 0 must be a sequence of token ids, got the text 'hello'"),
    ({"bad_words": [[3, -2]]}, r"bad_words entry 0 entry must be an integer >= 0, got -2"),
    ({"bad_words": "hello"}, "bad_words must be a sequence of token-id sequences"),
    ({"suppress_tokens": [1, -5]}, r"suppress_tokens entry must be an integer >= 0, got -5"),
    ({"suppress_tokens": "13"}, "suppress_tokens must be a sequence of token ids"),
])
def test_settings_reject_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingSettings(**kwargs)


def test_ids_outside_the_vocabulary_are_refused(model):
    for kw, name in (({"suppress_tokens": (60000,)}, "suppress_tokens"), ({"bad_words": ((1, 60000),)}, "bad_words")):
        with pytest.raises(ValueError, match=rf"{name} token id 60000 is outside the vocabulary \[0, 50257\)"):
            generate(model, PROMPTS, SamplingSettings(max_new_tokens=2, temperature=0, **kw))


def test_bad_words_text_is_tokenized_as_vllm_does():
    tok = Tokenizer.default()
    got = bad_words_ids(tok, ["hello", "  world"])
    # each word bare and with a leading space (mid-text GPT-2 tokens differ)
    assert got == (tuple(tok.encode("hello")), tuple(tok.encode(" hello")),
                   tuple(tok.encode("world")), tuple(tok.encode(" world")))
    # leading whitespace is what str.lstrip strips (as vLLM's bad_words): NEL and no-break space too
    assert bad_words_ids(tok, ["\x85\xa0hello"]) == bad_words_ids(tok, ["hello"])
    for word, shown in ((" ", "' '"), ("\x85", "'\\x85'"), ("\xa0\u3000\t", "'\\xa0\\u3000\\t'")):
        with pytest.raises(ValueError) as e:
            bad_words_ids(tok, [word])
        assert str(e.value) == (f"bad_words entry {shown} is only whitespace: a bad word's leading whitespace is "
                                "stripped (as vLLM does), which leaves no text to ban")
    for word in ("", 5):
        with pytest.raises(ValueError, match=r"bad_words entry must be non-empty text, got (''|5)"):
            bad_words_ids(tok, [word])


# --- each warper against transformers' processor ----------------------------------------------

@pytest.mark.parametrize("field,value,processor", [
    ("min_p", 0.05, "MinPLogitsWarper(0.05)"),
    ("min_p", 0.3, "MinPLogitsWarper(0.3)"),
    ("typical_p", 0.5, "TypicalLogitsWarper(0.5)"),
    ("typical_p", 0.95, "TypicalLogitsWarper(0.95)"),
    ("epsilon_cutoff", 3e-4, "EpsilonLogitsWarper(3e-4)"),
    ("epsilon_cutoff", 0.01, "EpsilonLogitsWarper(0.01)"),
    ("eta_cutoff", 1e-3, "EtaLogitsWarper(1e-3)"),
    ("eta_cutoff", 0.05, "EtaLogitsWarper(0.05)"),
])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_each_warper_equals_transformers(field, value, processor, scale):
    from transformers.generation import logits_process as lp  # noqa: F401 - named in `processor`

    logits = _logits(scale=scale)
    ours = warp(logits, SamplingSettings(**{field: value}))
    theirs = eval("lp." + processor)(None, logits.clone())
    assert_same_distribution(ours, theirs)
    kept = torch.isfinite(ours).sum(-1)
    assert (kept < logits.shape[-1]).all() and (kept >= 1).all()  # it removed tokens, and kept some


def _row_warped(settings, ids: torch.Tensor, prompt_len: int, logits: torch.Tensor) -> torch.Tensor:
    """Each row's warped logits through a RowSampler that saw ids[r, :prompt_len] as its prompt and
    generated the rest."""
    out = []
    for r in range(ids.shape[0]):
        s = RowSampler(settings, ids[r, :prompt_len].tolist(), logits.shape[-1], seed=0)
        for t in ids[r, prompt_len:].tolist():
            s.observe(t)
        out.append(s.warped(logits[r:r + 1]))
    return torch.cat(out)


def _context(B=4, L=12, low=20, seed=1):
    """Token ids from a small range, so n-grams repeat; rows 0 and 1 end on a bad word's prefix."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, low, (B, L), generator=g)
    ids[0, -1] = 7
    ids[1, -2:] = torch.tensor([3, 4])
    ids[2, 2:4] = ids[2, -2:] = torch.tensor([1, 2])  # a trigram (1, 2, ids[2, 4]) to complete
    return ids


BAD = [[5], [7, 8], [3, 4, 11], [999]]  # [999] is the stop token: dropped, as transformers drops [eos]


@pytest.mark.parametrize("kwargs,processor", [
    ({"no_repeat_ngram_size": 1}, "NoRepeatNGramLogitsProcessor(1)"),
    ({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor(2)"),
    ({"no_repeat_ngram_size": 3}, "NoRepeatNGramLogitsProcessor(3)"),
    ({"bad_words": BAD}, f"NoBadWordsLogitsProcessor({BAD}, 999)"),
    ({"min_new_tokens": 4}, "MinNewTokensLengthLogitsProcessor(8, 4, 999)"),  # 4 generated: stopping allowed
    ({"min_new_tokens": 5}, "MinNewTokensLengthLogitsProcessor(8, 5, 999)"),  # not yet
    ({"suppress_tokens": [9, 17, 400]}, "SuppressTokensLogitsProcessor([9, 17, 400])"),
])
@pytest.mark.parametrize("greedy", [False, True])
def test_each_constraint_equals_transformers(kwargs, processor, greedy):
    from transformers.generation import logits_process as lp  # noqa: F401 - named in `processor`

    ids, logits = _context(), _logits()
    settings = SamplingSettings(stop_token_ids=(999,), temperature=0 if greedy else 1.0, **kwargs)
    ours = _row_warped(settings, ids, 8, logits)
    theirs = eval("lp." + processor)(ids, logits.clone())
    assert torch.equal(ours, theirs)
    assert torch.isfinite(ours).all() == (kwargs == {"min_new_tokens": 4})  # the others banned something


def test_all_together_equal_transformers_in_its_own_order():
    """Every warper and constraint at once (with the repetition penalty, temperature, top-k and
    top-p), against the processor list transformers' generate builds for the same settings."""
    from transformers import GenerationConfig

    hf = random_hf_model(TINY)
    common = dict(temperature=0.7, top_k=200, top_p=0.95, min_p=0.02, typical_p=0.97, epsilon_cutoff=3e-4,
                  eta_cutoff=1e-3, no_repeat_ngram_size=2, min_new_tokens=6, repetition_penalty=1.3)
    gc = GenerationConfig(do_sample=True, bad_words_ids=BAD, suppress_tokens=[9], eos_token_id=999,
                          pad_token_id=0, **common)
    hf._prepare_special_tokens(gc, kwargs_has_attention_mask=True, device="cpu")
    ids = _context()
    procs = hf._get_logits_processor(generation_config=gc, input_ids_seq_length=8, encoder_input_ids=ids[:, :8],
                                     prefix_allowed_tokens_fn=None, logits_processor=None, device="cpu",
                                     model_kwargs={})
    assert [type(p).__name__ for p in procs] == [  # the order docs/generation.md states
        "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor", "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper",
        "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper",
        "EtaLogitsWarper"]
    logits = _logits(scale=2.0)
    logits[:, :20] += 2  # the context's tokens are likely, so the constraints ban tokens the warpers keep
    settings = SamplingSettings(bad_words=BAD, suppress_tokens=(9,), stop_token_ids=(999,), seed=0,
                                top_p_mode="hf", **common)
    ours = _row_warped(settings, ids, 8, logits)
    assert_same_distribution(ours, procs(ids, logits.clone()))
    assert (torch.isfinite(ours).sum(-1) > 1).all()


# --- seeded sampling ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"min_p": 0.1}, {"typical_p": 0.8}, {"epsilon_cutoff": 1e-3}, {"eta_cutoff": 1e-3},
    {"min_p": 0.05, "typical_p": 0.9, "eta_cutoff": 1e-3, "no_repeat_ngram_size": 2, "suppress_tokens": (13,),
     "bad_words": ((262,), (11, 290)), "min_new_tokens": 12},
])
def test_seeded_sampling_is_reproducible_and_batch_independent(kwargs):
    model = varied_model(TINY, seed=1)  # a 1000-token vocabulary keeps the per-row sorts cheap
    prompts = [[464, 208, 758], [15], [40, 588, 257, 922, 111]]
    s = SamplingSettings(max_new_tokens=12, seed=5, num_samples=2, stop_token_ids=(999,), **kwargs)
    first = [c.tokens for c in generate(model, prompts, s)]
    assert [c.tokens for c in generate(model, prompts, s, batch_size=1)] == first  # same alone as batched
    assert [c.tokens for c in generate(model, prompts[1:2], s)] == first[2:4]
    if s.constrained:  # what was sampled obeys the constraints
        for c, p in zip(first, [p for p in prompts for _ in range(2)], strict=True):
            seq = p + c
            grams = list(zip(seq, seq[1:], strict=False))
            assert len(set(grams)) == len(grams) and 13 not in c and 262 not in c and len(c) == 12
    other = SamplingSettings(max_new_tokens=12, seed=6, num_samples=2, stop_token_ids=(999,), **kwargs)
    assert [c.tokens for c in generate(model, prompts, other)] != first


# --- greedy generation against transformers' generate ----------------------------------------------

def _free(model):
    return [c.tokens for c in generate(model, PROMPTS, SamplingSettings(temperature=0, max_new_tokens=16,
                                                                         stop_token_ids=()))]


def _cases(free):
    stop = free[0][2]  # row 0 would stop at its 3rd token (or before)
    return {
        "no_repeat_ngram_size": ({"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 2}, None),
        "no_repeat_1": ({"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 1}, None),
        "bad_words": ({"bad_words": ((free[0][1],), tuple(free[2][3:5]))},
                      {"bad_words_ids": [[free[0][1]], list(free[2][3:5])]}, None),
        "min_new_tokens": ({"min_new_tokens": 8}, {"min_new_tokens": 8}, stop),
        "suppress_tokens": ({"suppress_tokens": (free[1][0], free[2][2])},
                            {"suppress_tokens": [free[1][0], free[2][2]]}, None),
        "all": ({"no_repeat_ngram_size": 3, "bad_words": ((free[0][1],),), "min_new_tokens": 5,
                 "suppress_tokens": (free[1][0],)},
                {"no_repeat_ngram_size": 3, "bad_words_ids": [[free[0][1]]], "min_new_tokens": 5,
                 "suppress_tokens": [free[1][0]]}, stop),
    }


@pytest.mark.parametrize("case", ["no_repeat_ngram_size", "no_repeat_1", "bad_words", "min_new_tokens",
                                  "suppress_tokens", "all"])
def test_greedy_with_constraints_equals_transformers_generate(model, case):
    free = _free(model)
    ours_kw, hf_kw, stop = _cases(free)[case]
    s = SamplingSettings(temperature=0, max_new_tokens=16, stop_token_ids=() if stop is None else (stop,), **ours_kw)
    got = [c.tokens for c in generate(model, PROMPTS, s)]  # one batch, three lengths
    assert got != free  # the constraint changed something
    hf = hf_from_ours(model)
    pad = 50255  # in no prompt or output: padding never forms an n-gram the rows could complete
    assert all(pad not in t for t in free + got + PROMPTS)
    T = max(map(len, PROMPTS))
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=pad,
                      eos_token_id=stop, **hf_kw)[:, T:].tolist()
    want = [row[:row.index(stop) + 1] if stop in row else row for row in out]  # HF pads after eos
    assert got == want
    if stop is not None:
        assert stop in free[0][:3] and len(got[0]) >= 5  # min_new_tokens held the stop back


# --- the command line ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("warp_model")
    save_model(model, d)
    return d


def run_cli(capsys, argv):
    from gpt2kit.cli import main

    try:
        code = main(["generate", *argv])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_options_equal_the_library(capsys, model_dir, model):
    tok = Tokenizer.default()
    argv = ["Hello world", "-m", str(model_dir), "--json", "--seed", "3", "-n", "10", "--min-p", "0.05",
            "--typical-p", "0.9", "--epsilon-cutoff", "1e-4", "--eta-cutoff", "1e-3", "--no-repeat-ngram-size", "2",
            "--bad-words", "the", "--bad-words-ids", "11,290", "--min-new-tokens", "4", "--suppress-tokens", "13,198"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    s = SamplingSettings(max_new_tokens=10, seed=3, min_p=0.05, typical_p=0.9, epsilon_cutoff=1e-4, eta_cutoff=1e-3,
                         no_repeat_ngram_size=2, bad_words=((11, 290),) + bad_words_ids(tok, ["the"]),
                         min_new_tokens=4, suppress_tokens=(13, 198))
    want = generate(model, "Hello world", s, tokenizer=tok)[0]
    assert json.loads(out)["tokens"] == want.tokens


@pytest.mark.parametrize("argv,needle", [
    (["--typical-p", "0"], "typical_p must be a number in (0, 1] (1 = off), got 0.0"),
    (["--typical-p", "1.5"], "typical_p must be a number in (0, 1]"),
    (["--min-p", "-1"], "min_p must be a number in [0, 1]"),
    (["--epsilon-cutoff", "1"], "epsilon_cutoff must be a number in [0, 1)"),
    (["--eta-cutoff", "2"], "eta_cutoff must be a number in [0, 1)"),
    (["--no-repeat-ngram-size", "-2"], "no_repeat_ngram_size must be an integer >= 0"),
    (["--min-new-tokens", "20", "-n", "10"], "min_new_tokens must be an integer in [0, max_new_tokens=10]"),
    (["--bad-words", " "], "--bad-words ' ' is only whitespace"),
    (["--bad-words", "\x85"], "--bad-words '\\x85' is only whitespace"),
    (["--bad-words-ids", "1,,2"], "--bad-words-ids takes comma-separated token ids"),
    (["--bad-words-ids", "1,-2"], "bad_words entry 0 entry must be an integer >= 0, got -2"),
    (["--suppress-tokens", "a"], "--suppress-tokens takes comma-separated token ids"),
    (["--suppress-tokens", "99999"], "suppress_tokens token id 99999 is outside the vocabulary"),
])
def test_cli_bad_values_one_line_nonzero(capsys, model_dir, argv, needle, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = run_cli(capsys, ["hi", "-m", str(model_dir), "-n", "4", *argv])
    assert code != 0
    assert len(error_lines(err)) == 1 and needle in err and "Traceback" not in err, err


def test_cli_help_names_each_option_and_default(capsys):
    code, out, _ = run_cli(capsys, ["--help"])
    assert code == 0
    text = " ".join(out.split())
    text = text[text.index("options:"):]
    for flag, default in [("--min-p MIN_P", "(default: 0.0)"), ("--typical-p TYPICAL_P", "(default: 1.0)"),
                          ("--epsilon-cutoff EPSILON_CUTOFF", "(default: 0.0)"),
                          ("--eta-cutoff ETA_CUTOFF", "(default: 0.0)"),
                          ("--no-repeat-ngram-size NO_REPEAT_NGRAM_SIZE", "(default: 0)"),
                          ("--bad-words TEXT", "repeatable"), ("--bad-words-ids IDS", "repeatable"),
                          ("--min-new-tokens MIN_NEW_TOKENS", "(default: 0)"),
                          ("--suppress-tokens IDS", "(default: none)")]:
        start = text.index(flag)
        assert default in text[start:start + 200], (flag, text[start:start + 200])
