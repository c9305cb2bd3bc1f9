"""benchmarks/bench_prefix_cache.py on a tiny model: it runs, times every case of every trial, and
checks that the first token with the cache equals the one without. No timing assertions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from helpers import SMALL, varied_model

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_prefix_cache.py"


def test_the_benchmark_runs_and_compares_first_tokens():
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_prefix_cache"] = mod
    spec.loader.exec_module(mod)
    times = mod.run(varied_model(SMALL, seed=0), prompt=40, shared=34, trials=2)
    assert {k: len(v) for k, v in times.items()} == {"without": 2, "with": 2, "miss": 2}
    assert all(t > 0 for v in times.values() for t in v)
