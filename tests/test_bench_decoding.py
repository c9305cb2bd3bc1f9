"""benchmarks/bench_decoding.py's beam row on a tiny preset: both sides load the same saved random
weights, run every beam to the full length and return the same sequences (no timing assertions)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_decoding.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decoding", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_decoding"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_beam_rows_sides_agree_on_saved_random_weights(bench, tmp_path):
    from gpt2kit.checkpoint import load_model

    d = bench.beam_model_dir("random:gpt2-tiny", str(tmp_path / "w"))
    assert json.loads((Path(d) / "config.json").read_text())["n_layer"] == 4
    stamp = (Path(d) / "model.safetensors").stat().st_mtime_ns
    assert bench.beam_model_dir("random:gpt2-tiny", str(tmp_path / "w")) == d  # saved once, then reused
    assert (Path(d) / "model.safetensors").stat().st_mtime_ns == stamp
    ours, theirs = bench.beam_sides(load_model(d), d, n=12)
    a, b = ours(), theirs()
    assert a == b
    assert [len(x) for x in a] == [12] * len(bench.BEAM_PROMPTS)  # no stop token: the full length


def test_a_named_beam_model_is_used_as_given(bench):
    assert bench.beam_model_dir("/some/dir", None) == "/some/dir"


def test_the_edit_tasks_rename_whole_words_and_fit_a_512_context(bench):
    from gpt2kit.checkpoint import load_tokenizer

    prompt, body = bench.edit_task("textwrap:indent:prefix:margin")
    assert prompt.endswith("# The same function with `prefix` renamed to `margin`:\n"
                           "def indent(text, margin, predicate=None):\n")
    assert "yield (margin + line" in body and "def prefixed_lines():" in body  # `prefixed` is another word
    assert '"""' not in prompt  # the docstring is left out
    tok = load_tokenizer()
    for spec in bench.EDITS:
        prompt, body = bench.edit_task(spec)
        assert len(tok.encode(prompt)) + len(tok.encode(body)) + bench.LOOKUP <= 512, spec
    with pytest.raises(SystemExit, match="does not occur"):
        bench.edit_task("textwrap:indent:prefixed:x")  # only inside another word


def test_the_lookup_row_checks_equal_tokens_and_counts_the_renamed_ones(bench):
    from helpers import random_model

    from gpt2kit.checkpoint import load_tokenizer
    from gpt2kit.config import GPT2Config

    model = random_model(GPT2Config(n_ctx=512, n_embd=32, n_head=4, n_layer=2))  # GPT-2's vocabulary
    row = bench.bench_prompt_lookup(model, load_tokenizer(), list(bench.EDITS[:2]), 1, 6)
    assert "2 code edits: indent, filter; 12 tokens" in row
    assert "tokens equal: True" in row and "0 of 2 edits exact" in row
