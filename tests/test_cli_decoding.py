"""gpt2kit generate's decoding-method flags: speculative decoding from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import error_lines, random_model

from gpt2kit.checkpoint import save_model
from gpt2kit.cli import main
from gpt2kit.config import GPT2Config

CFG = GPT2Config(n_vocab=50257, n_ctx=128, n_embd=32, n_head=4, n_layer=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for name, cfg, seed in (("target", CFG, 5), ("draft", CFG, 6),
                            ("small_vocab", GPT2Config(n_vocab=1000, n_ctx=128, n_embd=32, n_head=4, n_layer=2), 7),
                            ("short_ctx", CFG.replace(n_ctx=32), 8)):
        d = tmp_path_factory.mktemp(name)
        save_model(random_model(cfg, seed=seed), d)
        out[name] = str(d)
    return out


def _json_tokens(out: str) -> list[list[int]]:
    return [json.loads(line)["tokens"] for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("extra", [["--prompt-lookup", "4"], ["--draft-model", "DRAFT", "--draft-tokens", "3"]])
def test_speculative_greedy_prints_plain_greedy_and_the_acceptance_rate(capsys, dirs, extra):
    base = ["generate", "the cat sat on the mat; the cat", "-m", dirs["target"], "-n", "30", "--greedy",
            "--json", "--ignore-eot"]
    assert main(base) == 0
    plain = _json_tokens(capsys.readouterr().out)
    extra = [dirs["draft"] if a == "DRAFT" else a for a in extra]
    assert main(base + extra + ["--verbose"]) == 0
    out, err = capsys.readouterr()
    assert _json_tokens(out) == plain
    assert "speculative decoding:" in err and "draft tokens accepted (" in err


@pytest.mark.parametrize("argv, needle", [
    (["--draft-tokens", "0", "--draft-model", "DRAFT"], "draft_tokens must be an integer in [1, 64], got 0"),
    (["--prompt-lookup", "100"], "prompt_lookup must be an integer in [0, 64] (0 = off), got 100"),
    (["--draft-model", "SMALL"], "vocabulary has 1000 tokens, the target's 50257"),
])
def test_bad_speculative_flags_are_one_line(capsys, dirs, argv, needle):
    argv = [{"DRAFT": dirs["draft"], "SMALL": dirs["small_vocab"]}.get(a, a) for a in argv]
    code = main(["generate", "hi", "-m", dirs["target"], "-n", "3", "--greedy"] + argv)
    err = capsys.readouterr().err
    assert code != 0 and needle in err and len(error_lines(err)) == 1


def test_a_draft_with_a_shorter_context_is_refused_in_one_line(capsys, dirs):
    needle = f"the draft model {dirs['short_ctx']} has a context of n_ctx=32, shorter than the target's n_ctx=128"
    code = main(["generate", "hi", "-m", dirs["target"], "-n", "3", "--greedy", "--draft-model", dirs["short_ctx"]])
    err = capsys.readouterr().err
    assert code != 0 and needle in err and len(error_lines(err)) == 1


def test_serve_with_a_draft_with_a_shorter_context_refuses_to_start_in_one_line(dirs):
    """In a process of its own, with a time limit: a server that started anyway would never return."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    env = {"PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "gpt2kit", "serve", "-m", dirs["target"], "--port", "0",
                           "--draft-model", dirs["short_ctx"]], capture_output=True, text=True, env=env, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode != 0 and [line for line in err if "error" in line] == err[-1:], done.stderr
    assert f"the draft model {dirs['short_ctx']} has a context of n_ctx=32, shorter than the target's n_ctx=128" \
        in err[-1]


def test_beams_from_the_command_line_are_generates(capsys, dirs):
    from gpt2kit.checkpoint import load_model, load_tokenizer
    from gpt2kit.generation import generate
    from gpt2kit.sampling import SamplingSettings

    argv = ["generate", "the cat sat", "-m", dirs["target"], "-n", "8", "--num-beams", "3",
            "--num-return-sequences", "2", "--length-penalty", "0.5", "--early-stopping", "never", "--json"]
    assert main(argv) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = generate(load_model(dirs["target"]), ["the cat sat"], SamplingSettings(
        max_new_tokens=8, num_beams=3, num_return_sequences=2, length_penalty=0.5, early_stopping="never"),
        tokenizer=load_tokenizer(dirs["target"]))
    assert [(g["tokens"], g["score"]) for g in got] == [(c.tokens, c.score) for c in want]
    assert main(argv[:-1]) == 0
    assert capsys.readouterr().out.count("BEAM") == 2


@pytest.mark.parametrize("argv, needle", [
    (["--num-beams", "0"], "num_beams must be an integer in [1, 64]"),
    (["--num-beams", "2", "--num-return-sequences", "3"],
     "num_return_sequences must be an integer in [1, num_beams=2]"),
])
def test_bad_beam_flags_are_one_line(capsys, dirs, argv, needle):
    code = main(["generate", "hi", "-m", dirs["target"], "-n", "3"] + argv)
    err = capsys.readouterr().err
    assert code != 0 and needle in err and len(error_lines(err)) == 1


def test_contrastive_search_from_the_command_line_is_generates(capsys, dirs):
    from gpt2kit.checkpoint import load_model, load_tokenizer
    from gpt2kit.generation import generate
    from gpt2kit.sampling import SamplingSettings

    argv = ["generate", "the cat sat", "-m", dirs["target"], "-n", "8", "--penalty-alpha", "0.6", "--top-k", "4",
            "--json"]
    assert main(argv) == 0
    got = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]
    want = generate(load_model(dirs["target"]), ["the cat sat"], SamplingSettings(
        max_new_tokens=8, penalty_alpha=0.6, top_k=4), tokenizer=load_tokenizer(dirs["target"]))
    assert got == [c.tokens for c in want]
    code = main(argv[:-1] + ["--penalty-alpha", "2"])
    err = capsys.readouterr().err
    assert code != 0 and "penalty_alpha must be a number in [0, 1]" in err and len(error_lines(err)) == 1
