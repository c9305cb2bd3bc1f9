"""train --fsdp: FSDP2 on 2 gloo processes (torchrun) equals one process, and resumes exactly.

Tolerances: the loss curve of 2 sharded ranks within 1e-5 of one process over 20 steps,
a resume from the sharded checkpoint within 1e-6 of the straight run (float32, CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2kit.data import write_shard

COMMON = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--n-ctx", "64", "--seq-len", "32", "--max-steps", "20",
          "--optimizer", "adamw", "--total-batch-tokens", "256", "--eval-every", "10", "--eval-steps", "2",
          "--lr", "3e-3", "--dropout", "0.0", "--log-every", "100"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    write_shard(d / "train_000000.bin", rng.integers(0, 512, 8_000))
    write_shard(d / "val_000000.bin", rng.integers(0, 512, 3_000))
    return d


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return env | {"PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}


def _run(args: list[str], ranks: int, kill_at: str | None = None) -> str:
    """Run `gpt2kit train` (torchrun for 2+ ranks); with kill_at, rank 0 SIGKILLs itself at that point
    of a save (GPT2KIT_KILL_AT) and the run must have died of it. Returns stderr."""
    head = [sys.executable, "-m", "gpt2kit", "train"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "gpt2kit",
         "train"]
    env = _env() | ({"GPT2KIT_KILL_AT": kill_at} if kill_at else {})
    proc = subprocess.run([*head, *args], capture_output=True, text=True, env=env, timeout=600)
    if kill_at is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode != 0 and ("Signal 9 (SIGKILL)" in proc.stderr or "exitcode  : -9" in proc.stderr), \
            proc.stderr[-3000:]
    return proc.stderr


def _curve(out: Path) -> list[tuple[int, str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in rows for k in ("loss", "val_loss") if k in r]


def _close(a, b, tol: float) -> None:
    assert [(s, k) for s, k, _ in a] == [(s, k) for s, k, _ in b] and a
    worst = max(abs(x - y) for (_, _, x), (_, _, y) in zip(a, b, strict=True))
    assert worst <= tol, f"curves differ by {worst:.3g} > {tol}"


@pytest.fixture(scope="module")
def two(data, tmp_path_factory) -> Path:
    """An uninterrupted 20-step run on 2 FSDP ranks: what every split run must reproduce."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp") / "two"
    _run(["--data", str(data), *COMMON, "--batch-size", "2", "--fsdp", "--out", str(out)], 2)
    return out


def test_fsdp_two_ranks_equal_one_process_and_resume_exactly(data, two, tmp_path):
    from safetensors.torch import load_file

    common = ["--data", str(data), *COMMON]
    _run([*common, "--batch-size", "4", "--out", str(tmp_path / "one")], 1)
    _close(_curve(tmp_path / "one"), _curve(two), 1e-5)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()  # the final model is one HF directory, written by rank 0
    for k in a:  # Adam divides by sqrt(v): last-bit gradient differences reach the weights at ~1e-5
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=0)
    sharded = sorted(p.name for p in two.glob("checkpoint.step*.dcp"))
    assert sharded == ["checkpoint.step00000020.dcp"]  # the older sharded checkpoints were removed

    split = tmp_path / "split"
    _run([*common, "--batch-size", "2", "--fsdp", "--out", str(split), "--stop-at", "10"], 2)
    killed = split / "checkpoint.step00000015.dcp"  # what a save killed with -9 leaves: a partial directory
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"partial")
    _run(["--out", str(split), "--resume"], 2)  # checkpoint.pt still names step 10's complete directory
    _close(_curve(two), _curve(split), 1e-6)
    assert not killed.exists()


def test_kill_9_during_a_sharded_or_model_save_loses_nothing(data, two, tmp_path):
    """SIGKILL inside each save an FSDP run makes (GPT2KIT_KILL_AT): checkpoint.pt always names a whole
    sharded checkpoint, nothing half-written is loaded, and the run still ends exactly as `two` did."""
    from safetensors.torch import load_file

    from gpt2kit.train.run_dir import read_checkpoint

    run = tmp_path / "run"
    ckpt = run / "checkpoint.pt"
    # 1. killed while the final model is swapped in (step 20): checkpoint.pt is still step 10's
    _run(["--data", str(data), *COMMON, "--batch-size", "2", "--fsdp", "--save-every", "10", "--out", str(run)], 2,
         kill_at="directory-swap")
    saved = read_checkpoint(ckpt)
    assert saved["step"] == 10 and (run / saved["sharded"] / ".metadata").is_file()
    assert not (run / "config.json").exists()
    # 2. nothing to train at --max-steps 10, but the model was never written: it is exported from the
    # loaded shards, and the sharded checkpoint checkpoint.pt names is not rewritten (no sharded save)
    _run(["--out", str(run), "--resume", "--max-steps", "10"], 2, kill_at=None)
    assert (run / "config.json").is_file() and read_checkpoint(ckpt)["sharded"] == saved["sharded"]
    # 3. killed inside the sharded save of step 20: the ranks' shards written, no .metadata yet
    _run(["--out", str(run), "--resume", "--max-steps", "20"], 2, kill_at="sharded-save")
    partial = run / "checkpoint.step00000020.dcp"
    assert partial.is_dir() and not (partial / ".metadata").exists() and list(partial.glob("*.distcp"))
    assert read_checkpoint(ckpt)["step"] == 10 and (run / saved["sharded"] / ".metadata").is_file()
    # 4. resuming loads step 10's shards and ends exactly where the uninterrupted run did
    _run(["--out", str(run), "--resume", "--max-steps", "20"], 2)
    _close(_curve(two), _curve(run), 1e-6)
    a, b = load_file(two / "model.safetensors"), load_file(run / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0)
    assert sorted(p.name for p in run.glob("checkpoint.step*.dcp")) == ["checkpoint.step00000020.dcp"]
    assert (partial / ".metadata").is_file() and not list(tmp_path.glob(".run.saving-*"))


def test_fsdp_without_torchrun_or_with_muon_or_lora_is_one_clear_line(data, tmp_path, capsys, monkeypatch):
    from gpt2kit.cli import main

    base = ["train", "--data", str(data), "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--n-ctx", "64",
            "--max-steps", "1", "--fsdp"]
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cases = [([], "--fsdp shards the model across processes started by torchrun"),
             (["--optimizer", "muon"], "--fsdp needs --optimizer adamw"),
             (["--lora-rank", "2"], "--lora-rank cannot be combined with --fsdp")]
    for i, (flags, words) in enumerate(cases):
        if flags[:2] == ["--optimizer", "muon"]:
            from gpt2kit.train.config import muon_available

            if not muon_available():
                continue
        assert main([*base, "--out", str(tmp_path / f"o{i}"), *flags]) == 1
        err = capsys.readouterr().err
        assert words in err and err.count("error:") == 1, err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*base, "--out", str(tmp_path / "one")]) == 1
    assert "--fsdp with WORLD_SIZE=1 shards nothing" in capsys.readouterr().err
