"""benchmarks/bench_gpu.py on a CPU with torch.compile's eager backend: everything but the timings runs
(the four decoders, the logit and token checks, a compiled training run's MFU), and a decoder whose
tokens differ makes the script exit 1. No timing assertions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_gpu.py"
ARGS = ["--device", "cpu", "--size", "gpt2-tiny", "--backend", "eager", "--new-tokens", "4", "--trials", "1",
        "--train-steps", "2", "--batch", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_checks_and_the_table_run_on_a_cpu(bench, capsys):
    assert bench.main(ARGS) == 0
    out = capsys.readouterr().out
    assert "max |diff|" in out
    for name in ("| decode batch 1 | gpt2kit compile |", "| decode batch 8 | transformers compile |",
                 "| train gpt2-tiny, float32, 2 x 32 | gpt2kit |"):
        assert name in out
    assert "MFU" in out.splitlines()[-1]


def test_a_decoder_whose_tokens_differ_fails_the_run(bench, monkeypatch, capsys):
    real = bench.contenders

    def with_a_wrong_one(model, hf, backend):
        runs = real(model, hf, backend)
        good = runs["gpt2kit"]
        runs["gpt2kit"] = lambda ids, n: (good(ids, n) + 1) % model.config.n_vocab
        return runs
    monkeypatch.setattr(bench, "contenders", with_a_wrong_one)
    monkeypatch.setattr(bench, "is_tie", lambda *a: False)
    monkeypatch.setattr(bench, "training", lambda args, device: "| train | skipped |")
    assert bench.main(ARGS) == 1
    assert "tokens differ from transformers'" in capsys.readouterr().err


def test_first_difference_names_the_row_and_token(bench):
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert bench.first_difference(a, a.clone()) is None
    b = a.clone()
    b[1, 2] = 0
    assert bench.first_difference(a, b) == (1, 2)
