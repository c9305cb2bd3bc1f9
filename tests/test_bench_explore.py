"""benchmarks/bench_explore.py on a tiny model in headless Chromium: every round of an update and of a
next-token step is timed, the text's answer comes before its views and the views before every panel.
No timing assertions. Skips where Chromium or Playwright is missing."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from helpers import SMALL, varied_model

from gpt2kit.tokenizer import Tokenizer

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_explore.py"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
pytest.importorskip("playwright.sync_api")
pytest.importorskip("fastapi")


def test_the_benchmark_times_updates_in_the_browser():
    spec = importlib.util.spec_from_file_location("bench_explore", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_explore"] = mod
    spec.loader.exec_module(mod)
    tok = Tokenizer.default()
    texts = mod.texts(tok, 20, 3)
    assert len(set(texts)) == 3 and all(len(tok.encode(t)) == 20 for t in texts)
    t = mod.run(varied_model(SMALL, seed=0), tok, tokens=20, rounds=2, chromium=CHROMIUM)
    assert {k: len(v) for k, v in t.items()} == {"answer": 2, "views": 2, "all": 2, "step": 2}
    for a, v, al, s in zip(t["answer"], t["views"], t["all"], t["step"], strict=True):
        assert 0 < a <= v <= al and s > 0
