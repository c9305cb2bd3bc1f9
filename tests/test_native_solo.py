"""csrc/solo.h, the native kernels' fallback to one thread when their other threads start late: a
call's result does not depend on how many threads ran it, the fallback engages when starts are late
(GPT2KIT_NATIVE_LATE_US=0 makes every start late) and stays off when turned off (a negative value),
and its counters are readable from Python. Each case runs in a fresh process: the threshold is read
once per library."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpt2kit.decode import native

SCRIPT = r"""
import json, sys
import torch
from gpt2kit.decode import native
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 96, generator=g)
out = {}
wt = torch.randn(96, 200, generator=g)  # (in, out): the float32 decode layout
f = native.f32_linear()
ys = []
for threads in (2, 1, 2, 2):
    y = torch.empty(3, 200)
    f(x.data_ptr(), 3, 96, wt.data_ptr(), 200, 200, None, y.data_ptr(), threads, 1)
    ys.append(y)
out["f32_equal"] = all(torch.equal(ys[0], y) for y in ys)
out["f32_close"] = bool(torch.allclose(ys[0], x @ wt, atol=1e-4))
w8 = torch.randint(-127, 128, (200, 96), dtype=torch.int8, generator=g)
s = torch.rand(200, generator=g)
torch.set_num_threads(1)
one = native.run_int8_linear(x, w8, s, None)
torch.set_num_threads(2)
out["int8_equal"] = all(torch.equal(one, native.run_int8_linear(x, w8, s, None)) for _ in range(3))
if native.why_int8act_unavailable("avx2") is None:
    torch.set_num_threads(1)
    one = native.run_int8act_linear(x, w8, s, None, "avx2")
    torch.set_num_threads(2)
    out["int8act_equal"] = all(torch.equal(one, native.run_int8act_linear(x, w8, s, None, "avx2"))
                               for _ in range(3))
out["stats"] = {lib: native.solo_stats(lib) for lib in ("f32_linear", "int8_linear", "int8act_linear")}
print(json.dumps(out))
"""


def _run(late_us: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GPT2KIT_NATIVE_LATE_US"}
    if late_us is not None:
        env["GPT2KIT_NATIVE_LATE_US"] = late_us
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def _native_here():
    if native.f32_linear() is None or native.int8_linear() is None:
        pytest.skip(f"the native kernels cannot run here: {native.why_unavailable()}")


def _results_equal(out: dict) -> None:
    assert out["f32_equal"] and out["f32_close"] and out["int8_equal"]
    assert out.get("int8act_equal", True)


def test_every_start_late_sends_calls_to_one_thread_with_the_same_results():
    out = _run("0")
    _results_equal(out)
    for lib in ("f32_linear", "int8_linear"):
        stats = out["stats"][lib]
        # the first call on two threads is late by definition; the calls after it go to one thread
        assert stats["late_starts"] >= 1 and stats["solo_calls"] >= 1, (lib, stats)
        # one call in each library asked for one thread: neither sent there nor watched
        assert stats["calls"] == stats["solo_calls"] + sum(stats["start_delay"].values()) + 1


def test_a_negative_threshold_turns_the_fallback_off():
    out = _run("-1")
    _results_equal(out)
    for lib in ("f32_linear", "int8_linear"):
        stats = out["stats"][lib]
        assert stats["solo_calls"] == 0 and stats["late_starts"] == 0 and sum(stats["start_delay"].values()) == 0


def test_the_default_threshold_gives_the_same_results():
    out = _run(None)
    _results_equal(out)
    assert out["stats"]["f32_linear"]["calls"] == 4


def test_stats_of_a_library_not_loaded_is_none():
    assert native.solo_stats("no_such_library") is None


def test_bench_load_runs_its_smallest_case():
    """benchmarks/bench_load.py (the fallback's benchmark) end to end on a tiny model: a table row per
    contender and busy count (no timing assertions)."""
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_load.py"
    done = subprocess.run([sys.executable, str(script), "--size", "gpt2-tiny", "--trials", "1", "--new-tokens", "2",
                           "--busy", "0", "1", "--contenders", "float32", "int8-nosolo"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 4 and any("int8-nosolo" in r and "| 0% |" in r for r in rows)
