"""gpt2kit.serve.memory: the caps on oneDNN's caches (set in the environment, a user's own values
kept), the heap trim (once per quiet spell of the engine loop, at most every `every` seconds while
busy), and benchmarks/bench_serve_rss.py run end to end on a tiny model. Memory figures are
measured by the benchmark (docs/serving.md, "Memory"), not asserted here."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import SMALL, random_model

from gpt2kit.decode.packed import CACHE_VARIABLES, bound_caches, cache_entries
from gpt2kit.engine import Engine, EngineLoop
from gpt2kit.sampling import SamplingSettings
from gpt2kit.serve.memory import HeapTrim, bound_kernel_caches
from gpt2kit.serve.options import ServeOptions


@pytest.fixture
def no_cache_env(monkeypatch):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    for name in CACHE_VARIABLES:  # monkeypatch restores what it deleted; drop what the code set
        os.environ.pop(name, None)


def test_cache_entries_cover_every_row_count_of_a_batch_plus_prompt_chunks():
    assert cache_entries(8) == 10 * 8 + 64 and cache_entries(32) == 10 * 32 + 64
    assert cache_entries(8, engines=2) == 2 * cache_entries(8)


def test_bound_caches_sets_both_variables_and_keeps_a_users_own(no_cache_env, monkeypatch):
    assert bound_caches(104) == {name: "104" for name in CACHE_VARIABLES}
    assert all(os.environ[name] == "104" for name in CACHE_VARIABLES)
    for name in CACHE_VARIABLES:
        os.environ.pop(name)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert bound_caches(50) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "50", "LRU_CACHE_CAPACITY": "7"}


def test_a_server_bounds_the_caches_for_its_batch_and_its_speculation(no_cache_env):
    assert bound_kernel_caches(ServeOptions(max_batch=8))["LRU_CACHE_CAPACITY"] == str(cache_entries(8))
    for name in CACHE_VARIABLES:
        os.environ.pop(name)
    assert bound_kernel_caches(ServeOptions(max_batch=4, prompt_lookup=3)) == \
        {name: str(cache_entries(4, 2)) for name in CACHE_VARIABLES}


def test_creating_a_server_sets_the_caps_before_its_model_loads(no_cache_env):
    from gpt2kit.serve.server import Server

    seen = {}

    def loader():  # what the environment holds when the model would load
        seen.update({name: os.environ.get(name) for name in CACHE_VARIABLES})
        raise RuntimeError("no model here")

    server = Server(loader, ServeOptions(max_batch=3))
    server._load()
    assert seen == {name: str(cache_entries(3)) for name in CACHE_VARIABLES}
    assert isinstance(server.load_error, RuntimeError)


def test_heap_trim_runs_when_idle_and_at_most_every_interval_while_busy(monkeypatch):
    calls = []
    trim = HeapTrim(every=30.0)
    monkeypatch.setattr(trim, "_trim", calls.append)
    clock = [1000.0]
    monkeypatch.setattr("gpt2kit.serve.memory.time.monotonic", lambda: clock[0])
    trim.last = clock[0]
    trim(False)  # busy, just after a trim
    clock[0] += 29.0
    trim(False)
    assert calls == []
    trim(True)  # idle: always
    assert calls == [0]
    clock[0] += 31.0
    trim(False)
    trim(False)
    assert calls == [0, 0] and trim.calls == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_heap_trim_calls_the_c_librarys_malloc_trim():
    trim = HeapTrim()
    assert trim._trim is not None
    trim(True)
    assert trim.calls == 1


def test_the_engine_loop_tidies_once_per_quiet_spell_and_after_steps():
    """Waits on events, not on the clock: a loaded machine only makes the worker slower, which can
    only mean fewer tidy calls, never a wrong pattern."""
    model = random_model(SMALL)
    calls, lock = [], threading.Lock()
    quiet = [threading.Event(), threading.Event()]

    def tidy(idle):
        with lock:
            calls.append(idle)
            if idle:
                quiet[calls.count(True) - 1].set()

    done = threading.Event()
    engine = Engine(model)
    loop = EngineLoop(engine, lambda events: [done.set() for e in events if e.finish_reason], lambda r, e: None,
                      tidy=tidy, tidy_after=0.05).start()
    try:
        assert quiet[0].wait(60)  # quiet from the start: one tidy ...
        time.sleep(0.3)
        with lock:
            assert calls == [True]  # ... not one per wait
        row = engine.new_row([464, 2068], SamplingSettings(temperature=0, max_new_tokens=5, stop_token_ids=()))
        loop.submit([row])
        assert done.wait(60)
        assert quiet[1].wait(60)  # quiet again after the row
    finally:
        loop.stop()
    with lock:
        assert calls[0] is True and calls[-1] is True and calls.count(True) == 2
        assert calls[1:-1] == [False] * loop.steps  # after every step


def test_bench_serve_rss_runs_a_part_of_the_mix_and_prints_a_trace(tmp_path, capsys):
    script = Path(__file__).parents[1] / "benchmarks" / "bench_serve_rss.py"
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("bench_serve_rss", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit):
        bench.main(["--kinds", "completion,nonsense"])
    assert "--kinds: unknown ['nonsense']" in capsys.readouterr().err
    assert bench.main(["--requests", "12", "--settle", "4", "--every", "4", "--clients", "2", "--quiet", "0",
                       "--kinds", "completion,echo-score,bad"]) == 0
    out = capsys.readouterr().out
    assert "12 requests (bad, completion, echo-score), 2 clients, settled after 4" in out
    assert "RSS after requests: 4: " in out and ", 12: " in out
