"""train --fsdp: FSDP2 on 2 gloo processes (torchrun) equals one process, and resumes exactly.

The issue's tolerances: the loss curve of 2 sharded ranks within 1e-5 of one process over 20 steps,
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


def _run(args: list[str], ranks: int) -> None:
    head = [sys.executable, "-m", "gpt2kit", "train"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "gpt2kit",
         "train"]
    proc = subprocess.run([*head, *args], capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _curve(out: Path) -> list[tuple[int, str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in rows for k in ("loss", "val_loss") if k in r]


def _close(a, b, tol: float) -> None:
    assert [(s, k) for s, k, _ in a] == [(s, k) for s, k, _ in b] and a
    worst = max(abs(x - y) for (_, _, x), (_, _, y) in zip(a, b, strict=True))
    assert worst <= tol, f"curves differ by {worst:.3g} > {tol}"


def test_fsdp_two_ranks_equal_one_process_and_resume_exactly(data, tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from safetensors.torch import load_file

    common = ["--data", str(data), *COMMON]
    _run([*common, "--batch-size", "4", "--out", str(tmp_path / "one")], 1)
    _run([*common, "--batch-size", "2", "--fsdp", "--out", str(tmp_path / "two")], 2)
    _close(_curve(tmp_path / "one"), _curve(tmp_path / "two"), 1e-5)
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys()  # the final model is one HF directory, written by rank 0
    for k in one:  # Adam divides by sqrt(v): last-bit gradient differences reach the weights at ~1e-5
        torch.testing.assert_close(two[k], one[k], atol=1e-4, rtol=0)
    sharded = sorted(p.name for p in (tmp_path / "two").glob("checkpoint.step*.dcp"))
    assert sharded == ["checkpoint.step00000020.dcp"]  # the older sharded checkpoints were removed

    split = tmp_path / "split"
    _run([*common, "--batch-size", "2", "--fsdp", "--out", str(split), "--stop-at", "10"], 2)
    killed = split / "checkpoint.step00000015.dcp"  # what a save killed with -9 leaves: a partial directory
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"partial")
    _run(["--out", str(split), "--resume"], 2)  # checkpoint.pt still names step 10's complete directory
    _close(_curve(tmp_path / "two"), _curve(split), 1e-6)
    assert not killed.exists()


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
            from gpt2kit.train_config import muon_available

            if not muon_available():
                continue
        assert main([*base, "--out", str(tmp_path / f"o{i}"), *flags]) == 1
        err = capsys.readouterr().err
        assert words in err and err.count("error:") == 1, err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*base, "--out", str(tmp_path / "one")]) == 1
    assert "--fsdp with WORLD_SIZE=1 shards nothing" in capsys.readouterr().err
