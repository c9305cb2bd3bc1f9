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
