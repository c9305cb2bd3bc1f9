"""Model-FLOPs utilisation: the per-token count equals nanoGPT's formula, frozen matrices skip their
weight gradient, a known GPU's peak comes from its data sheet, and a training run logs MFU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpt2kit.config import GPT2Config
from gpt2kit.data import write_shard
from gpt2kit.lora import apply_lora
from gpt2kit.model import GPT2
from gpt2kit.train import flops
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.loop import train

CFG = GPT2Config(n_vocab=101, n_ctx=32, n_embd=16, n_head=2, n_layer=3)


def test_flops_per_token_is_nanogpts_estimate():
    model = GPT2(CFG)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()  # nanoGPT's non-embedding count
    assert flops.flops_per_token(model, 24) == 6 * n + 12 * CFG.n_layer * 24 * CFG.n_embd


def test_frozen_matrices_count_forward_and_input_gradient_only():
    model = GPT2(CFG)
    apply_lora(model, 2, 4, targets=("c_attn",))
    frozen = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad and "wpe" not in n)
    trained = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "wpe" not in n)
    assert frozen and trained
    assert flops.flops_per_token(model, 8) == 4 * frozen + 6 * trained + 12 * CFG.n_layer * 8 * CFG.n_embd


def test_a_known_gpu_takes_its_data_sheet_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak = flops.peak_rate(torch.device("cuda"), torch.bfloat16)
    assert peak.flops == 989.4e12 and "H100" in peak.source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert flops.peak_rate(torch.device("cuda"), torch.bfloat16).flops == 756.0e12


def test_a_cpu_peak_is_measured_and_mfu_is_the_share_of_it():
    peak = flops.peak_rate(torch.device("cpu"), torch.float32)
    assert peak.source.startswith("measured") and peak.flops > 1e6
    assert flops.mfu(1000.0, 2e6, flops.PeakRate(4e9, "x")) == pytest.approx(0.5)
    assert flops.mfu(1000.0, 2e6, flops.PeakRate(4e9, "x"), world_size=2) == pytest.approx(0.25)


def test_a_training_run_logs_and_prints_its_mfu(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        write_shard(tmp_path / f"{split}_000000.bin", rng.integers(0, 50257, n).astype(np.uint16))
    train(TrainConfig(data=str(tmp_path), out=str(tmp_path / "out"), model="gpt2-tiny", n_layer=1, n_embd=16,
                      n_head=2, n_ctx=32, batch_size=2, seq_len=16, max_steps=2, log_every=1,
                      eval_every=0))
    recs = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert steps and all(r["mfu"] > 0 for r in steps)
    err = capsys.readouterr().err
    assert "MFU: model FLOPs" in err and "(MFU " in err
