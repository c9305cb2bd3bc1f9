"""benchmarks/bench_lora_quality.py end to end on a tiny random model (--quick): the corpus prepared, the
held-out files named (and exactly the files of prepare's validation split), one full and one LoRA run
trained and evaluated, the adapter's size against the model's. No timing or quality assertions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from gpt2kit.checkpoint import load_tokenizer
from gpt2kit.data import read_shard

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_lora_quality.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_lora_quality", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_lora_quality"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_quick_mode_runs_full_and_lora_and_names_the_held_out_files(bench, tmp_path, capsys):
    r = bench.main(["--quick", "--work", str(tmp_path), "--lora-bias-lrs", "1e-2", "--frozen-emb-lrs", "3e-3",
                    "--lora-tokens-lrs", "1e-2", "--lora-tokens", "20"])
    assert [(row["method"], row["steps"]) for row in r["runs"]] == [
        ("full", 3), ("lora", 3), ("lora, bias all", 3), ("full, embeddings frozen", 3), ("lora + tokens", 3)]
    full, lora, lora_bias, frozen, tokens = r["runs"]
    assert tokens["trained_parameters"] == 65_536 + 20 * 128  # the adapters and 20 embedding rows
    assert tokens["output_bytes"] - lora["output_bytes"] > 20 * 128 * 4 and tokens["config_bytes"] > 0
    assert full["output_bytes"] == frozen["output_bytes"] == r["model_bytes"]
    assert 0 < lora["output_bytes"] < lora_bias["output_bytes"] <= 0.02 * r["model_bytes"]  # rank 8 on gpt2-tiny
    # gpt2-tiny (4 layers, 128 wide): 4 x 16,384 adapter values; 4 x 1,408 + 128 (ln_f) biases; the embeddings
    assert lora["trained_parameters"] == 65_536 and lora_bias["trained_parameters"] == 65_536 + 5_760
    assert full["trained_parameters"] - frozen["trained_parameters"] == (50_257 + 64) * 128
    held = r["held_out_files"]
    assert len(held) == r["prepare"]["val_documents"] == 3 and set(held) < set(r["files"])
    tok = load_tokenizer(None)  # prepare's val split holds exactly these files (an <|endoftext|> before each)
    val = read_shard(tmp_path / "data" / "val_000000.bin")
    assert len(val) == sum(len(tok.encode(Path(f).read_text())) + 1 for f in held)
    out = capsys.readouterr().out
    assert "| full (best) | 0.003 |" in out and "| lora (best) | 0.01 |" in out and "best LoRA - best full = " in out
    assert "best LoRA + bias all - best full = " in out and "| full, embeddings frozen (best) | 0.003 |" in out


def test_corpus_files_leave_out_tests_and_the_bases_inputs(bench, tmp_path):
    for rel in ("pkg/a.py", "pkg/test/t.py", "pkg/tests/u.py", "pkg/test_x.py", "pkg/sub/b.py", "top.py",
                "pkg/notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    got = bench.corpus_files([str(tmp_path / "pkg"), str(tmp_path / "top.py")], "*.py", {"test", "tests"},
                             {str(tmp_path / "top.py")})
    assert got == [tmp_path / "pkg/a.py", tmp_path / "pkg/sub/b.py"]
