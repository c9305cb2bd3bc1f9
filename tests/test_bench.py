"""`gpt2kit bench`: the transformers copy, the judgement of each timing (quiet vs disturbed trials, a busy
machine), the report (the model it ran, ratios marked when in doubt, no targets), the --quick plan, the
CLI's errors, and one bounded run of the command whose output's shape is checked (never its speed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SMALL, error_lines, varied_model

from gpt2kit.bench import core
from gpt2kit.bench import timing as bench_timing
from gpt2kit.bench.report import describe_model, format_table
from gpt2kit.bench.runner import FULL, QUICK, model_facts, plan_for
from gpt2kit.bench.timing import Timing, doubt, machine_doubt, time_alternating
from gpt2kit.config import GPT2Config
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings

ROOT = Path(__file__).parents[1]
WORKLOADS = ("prefill", "decode_b1", "decode_b8")
REF, F32, BF16 = "transformers/float32", "gpt2kit/float32", "gpt2kit/bfloat16"
# words of how the project was built, which nothing the benchmark says or is written in may contain
HISTORY = re.compile(r"session [0-9]|issue [0-9]|helper h[0-9]|\btargets?\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def model():
    return varied_model(SMALL, seed=0)


# --- the transformers copy ---------------------------------------------------------------------

def test_transformers_copy_has_the_same_logits_and_greedy_tokens(model):
    hf = core.to_transformers(model)
    ids = torch.tensor([[40, 588, 257, 922, 1110, 13, 383]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-4)
    out = []
    core.hf_decode(hf, ids, 5, out)()
    settings = SamplingSettings(temperature=0, max_new_tokens=5, stop_token_ids=())
    assert out == [generate(model, ids.tolist(), settings)[0].tokens]
    assert core.weight_bytes_per_token(model) == 4 * (model.num_parameters() - model.wpe.weight[1:].numel())


# --- the judgement of a timing -------------------------------------------------------------------

@pytest.mark.parametrize("t, why", [
    (Timing(1.0, 3, 3, [1.0, 1.05, 1.1]), None),  # steady quiet trials: a figure
    (Timing(1.0, 2, 2, [1.2, 1.0]), None),  # 20% apart: within MAX_SPREAD
    (Timing(0.2, 0, 3, []), "no quiet trial (0 of 3)"),  # every trial disturbed
    (Timing(1.0, 1, 3, [1.0]), "only 1 quiet trial of 3"),  # one alone cannot show the speed held
    (Timing(1.0, 2, 2, [1.0, 1.5]), "quiet trials 50% apart"),  # the machine's speed drifted
])
def test_doubt_names_what_is_wrong_with_a_timing(t, why):
    assert doubt(t) == why


def test_machine_doubt_is_other_processes_work_before_or_after():
    assert machine_doubt(0.1, 0.3, 2) is None and machine_doubt(None, None, 2) is None
    assert machine_doubt(1.8, 0.0, 2) == "other processes were using 1.8 of 2 cores before the timings"
    assert machine_doubt(0.0, 0.9, 4) == "other processes were using 0.9 of 4 cores after the timings"


def test_time_alternating_keeps_the_best_quiet_trial_and_reports_each(monkeypatch):
    # synthetic trials: "a" is disturbed once, "b" never quiet; no clock is read
    script = {"a": [(0.5, False), (1.0, True), (0.9, True)], "b": [(0.4, False), (0.3, False), (0.6, False)]}
    monkeypatch.setattr(bench_timing, "trial", lambda fn, wait=0.0: script[fn()].pop(0))
    seen = []
    got = time_alternating({"a": lambda: "a", "b": lambda: "b"}, trials=2, max_trials=3,
                           on_trial=lambda *args: seen.append(args))
    assert got["a"] == Timing(0.9, 2, 3, [1.0, 0.9]) and doubt(got["a"]) is None  # 0.5 was disturbed
    assert got["b"] == Timing(0.3, 0, 3, []) and doubt(got["b"]) == "no quiet trial (0 of 3)"
    assert seen == [("a", 1, 0.5, False), ("b", 1, 0.4, False), ("a", 2, 1.0, True), ("b", 2, 0.3, False),
                    ("a", 3, 0.9, True), ("b", 3, 0.6, False)]


# --- the report ------------------------------------------------------------------------------------

TINY = model_facts(GPT2Config.from_name("gpt2-tiny"), 7_300_000)


def results(doubts: dict | None = None, busy: tuple = (0.0, 0.1), quick: bool = False, facts: dict = TINY) -> dict:
    """A run's results as runner.run returns them, with made-up figures."""
    tok_s = {wl: {REF: 10.0, F32: 12.0, BF16: 20.0} for wl in WORKLOADS}
    doubt_of = {wl: dict.fromkeys(tok_s[wl]) for wl in WORKLOADS}
    for (wl, name), why in (doubts or {}).items():
        doubt_of[wl][name] = why
    machine = {"cpu": "Test CPU", "cores": 2, "isa": ["avx2"], "threads": 2, "torch": "2", "transformers": "5",
               "python": "3.11", "device": "Test CPU", "device_type": "cpu"}
    return {"machine": machine, "model": facts, "quick": quick, "T": 128, "new_tokens": 16, "tok_s": tok_s,
            "quiet": {wl: dict.fromkeys(v, "2/2") for wl, v in tok_s.items()}, "doubt": doubt_of,
            "busy_cores": {"before": busy[0], "after": busy[1]}, "bytes_per_token": {"float32": 5e8, "bfloat16": 2.5e8},
            "limit_tok_s": None if quick else {"float32": 40.0, "bfloat16": 80.0},
            "bandwidth_GBs": None if quick else 20.0, "drift_tokens": 64,
            "dlogprob_next": 1e-3, "dlogprob_vocab": 2e-3, "greedy_identical": True,
            "memory_skipped": "--quick" if quick else None,
            "peak_MiB": None if quick else {REF: 100.0, F32: 90.0, BF16: 50.0}}


def row(table: str, label: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {label}"))


def test_report_of_quiet_trials_prints_ratios_as_findings_and_no_targets():
    table = format_table(results())
    assert "| decode tok/s, batch 1 (16 new) | 10.0 | 12.0 | 1.20x | 20.0 | 2.00x | 2/2, 2/2, 2/2 |" in table
    assert "unreliable" not in table.lower() and "every figure had at least 2 quiet trials" in table
    assert "| peak RSS above baseline, MiB (lower is better) | 100 | 90 | 0.90x | 50 | 0.50x | |" in table
    assert "-> 40.0 tok/s (gpt2kit at 30%, transformers at 25%)" in table
    assert not HISTORY.search(table), HISTORY.search(table)
    assert ">=" not in table and " met" not in table and "missed" not in table


def test_report_marks_the_ratios_a_doubtful_figure_enters_and_says_what_to_do():
    table = format_table(results({("decode_b8", REF): "no quiet trial (0 of 2)"}, quick=True))
    assert row(table, "decode tok/s, batch 8").count("x (unreliable)") == 2  # both ratios are over transformers'
    assert "(unreliable)" not in row(table, "prefill") + row(table, "decode tok/s, batch 1")
    assert "- decode_b8 transformers/float32: no quiet trial (0 of 2)" in table
    assert "close other programs, then rerun without --quick" in table
    assert "peak memory: not measured (--quick)" in table
    assert "physical limit, batch-1 decode: not measured (--quick" in table
    only_ours = format_table(results({("prefill", BF16): "quiet trials 40% apart"}))
    assert row(only_ours, "prefill").endswith("| 1.20x | 20.0 | 2.00x (unreliable) | 2/2, 2/2, 2/2 |")
    assert "rerun (--wait 20" in only_ours  # not a --quick run: nothing about --quick


def test_report_on_a_busy_machine_marks_every_ratio():
    table = format_table(results(busy=(1.9, 0.2)))
    rows = "\n".join(line for line in table.splitlines() if line.startswith(("| prefill", "| decode")))
    ratios = re.findall(r"\| (\d+\.\d\dx[^|]*)(?= \|)", rows)
    assert len(ratios) == 6 and all(r.endswith("x (unreliable)") for r in ratios), ratios
    assert "- other processes were using 1.9 of 2 cores before the timings" in table
    assert "gpt2kit at 30% (unreliable)" in table  # the share of the limit comes from a timing too


def test_report_names_the_model_it_ran():
    table = format_table(results())
    assert "model: gpt2-tiny (4 layers x 128, 4 heads, context 256, 7.3M parameters), random weights" in table
    assert "124M" not in table
    assert model_facts(GPT2Config(), 124_439_808)["name"] == "gpt2"
    custom = model_facts(SMALL, 1_700_000)
    assert describe_model(custom) == "custom (2 layers x 32, 4 heads, context 64, 1.7M parameters)"


# --- the plans ---------------------------------------------------------------------------------------

def work(plan) -> int:
    """Tokens one contender processes at most over a run, warm-ups included (prefill; batch 1 and batch 8,
    each a 16-token prompt and the new tokens): what every workload's time scales with."""
    return (plan.max_trials + 1) * (plan.T + 9 * (16 + plan.new_tokens))


def test_quick_is_a_small_fraction_of_the_full_run_and_starts_no_process():
    assert work(QUICK) * 10 <= work(FULL)
    assert not QUICK.memory and QUICK.max_trials == QUICK.trials == bench_timing.MIN_QUIET
    cut = plan_for(True, SMALL)  # a model's context bounds every length
    assert (cut.T, cut.new_tokens, cut.drift_tokens) == (64, 16, 64)


# --- the command ---------------------------------------------------------------------------------------

def test_cli_bench_quick_tiny_prints_progress_and_a_judged_table(tmp_path):
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "gpt2kit", "bench", "--quick", "--size", "gpt2-tiny", "--threads", "1",
           "--json", str(out_json)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)  # a bound, not a speed check
    assert done.returncode == 0, done.stderr[-2000:]
    out, err = done.stdout, done.stderr
    assert "model: gpt2-tiny (4 layers x 128, 4 heads, context 256, 7.3M parameters)" in out and "124M" not in out
    assert "| prefill tok/s (T=128) |" in out and "| decode tok/s, batch 8 (16 new) |" in out
    for wl in ("prefill", "decode tok/s, batch 1", "decode tok/s, batch 8"):
        cells = row(out, wl).split(" | ")
        assert all(re.fullmatch(r"\d+\.\d\dx( \(unreliable\))?", c) for c in cells[3:7:2]), cells
    assert ("UNRELIABLE" in out) != ("every figure had at least 2 quiet trials" in out)
    assert not HISTORY.search(out + err), HISTORY.search(out + err)
    # progress on stderr as it goes: a warm-up and two trials per workload and contender, then the end
    for wl in WORKLOADS:
        for name in (REF, F32, BF16):
            assert f"{wl}: {name} warm-up" in err and f"{wl}: {name} trial 2: " in err
    assert err.rstrip().endswith("done")
    r = json.loads(out_json.read_text())
    assert r["model"]["name"] == "gpt2-tiny" and r["T"] == 128 and r["new_tokens"] == 16 and r["quick"]
    assert set(r["doubt"]) == set(WORKLOADS) and r["greedy_identical"] and r["memory_skipped"] == "--quick"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc")
def test_peak_memory_process_reports_each_step_as_it_goes():
    lines = []
    mib = core.peak_memory("gpt2kit", "bfloat16", 8, 2, 1, log=lines.append)
    assert lines == ["model built", "prefill T=8 done", "batch-8 decode, 2 new tokens done"]
    assert mib > 200  # gpt2 124M in bfloat16 is 249 MB of weights


def test_cli_bench_bad_threads(capsys):
    from gpt2kit.cli import main

    assert main(["bench", "--threads", "0"]) != 0
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "--threads" in err


def test_cli_bench_names_the_presets_for_a_bad_size(capsys):
    from gpt2kit.cli import main

    assert main(["bench", "--size", "gpt3"]) == 1
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "gpt2-tiny" in err  # the presets are listed


@pytest.mark.parametrize("device,needle", [("cuda", "CUDA is not available"), ("tpu", "not a device")])
def test_cli_bench_bad_device_one_line(capsys, device, needle):
    from gpt2kit.cli import main

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["bench", "--device", device, "--no-memory"]) != 0
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and needle in err


def test_bench_device_is_its_own_contract():
    # devices.resolve_device takes any device a model loads onto; the benchmark's takes cpu or cuda only
    from gpt2kit.devices import resolve_device

    assert core.bench_device("cpu") == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta")
    with pytest.raises(ValueError, match="the benchmark runs on cpu or cuda"):
        core.bench_device("meta")


def test_the_benchmark_code_says_what_it_measures_not_how_it_was_built():
    files = [*(ROOT / "src" / "gpt2kit" / "bench").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    words = re.compile(r"session [0-9]|issue [0-9]|helper h[0-9]", re.IGNORECASE)
    found = [f"{f.name}:{i}: {line.strip()}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if words.search(line)]
    assert not found, "\n".join(found)
