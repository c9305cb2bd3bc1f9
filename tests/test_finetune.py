"""Training with LoRA, frozen parameters and activation checkpointing (gpt2kit.train.finetune).

Tiny models (2 layers, width 32) on random shards, a few steps each. Tolerances, as documented:
exact resume within 1e-6, activation checkpointing within 1e-6 of a run without (float32, CPU),
2 DDP ranks within 1e-5 of one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import error_lines, random_hf_model, train_one_and_two_ranks

from gpt2kit.checkpoint import load_model
from gpt2kit.config import GPT2Config
from gpt2kit.data import write_shard
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.loop import resume_config, train
from gpt2kit.train.run_dir import CHECKPOINT_NAME

BASE_CFG = GPT2Config(n_vocab=600, n_ctx=64, n_embd=32, n_head=2, n_layer=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base") / "hf"
    random_hf_model(BASE_CFG, seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    probs = 1.0 / np.arange(1, 513)
    probs /= probs.sum()
    write_shard(d / "train_000000.bin", rng.choice(512, size=8_000, p=probs))
    write_shard(d / "val_000000.bin", rng.choice(512, size=3_000, p=probs))
    return d


def _cfg(data: Path, base: Path, out: Path, **kw) -> TrainConfig:
    settings = dict(data=str(data), model=str(base), out=str(out), batch_size=2, seq_len=32, max_steps=8, lr=3e-3,
                    eval_every=4, eval_steps=2, save_every=0, log_every=100, optimizer="adamw")
    return TrainConfig(**(settings | kw))


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _close(a: list[float], b: list[float], tol: float) -> None:
    assert len(a) == len(b) and a
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= tol, f"losses differ by {worst:.3g} > {tol}: {a} vs {b}"


# --- LoRA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_lora_run_writes_a_peft_adapter_that_loads_back(data, base, tmp_path, optimizer):
    peft = pytest.importorskip("peft")
    from transformers import GPT2LMHeadModel

    out = tmp_path / "run"
    result = train(_cfg(data, base, out, lora_rank=4, optimizer=optimizer, lr=1e-2, muon_lr=0.05))
    losses = _losses(out)
    assert losses[-1] < losses[0]  # the adapter learned something
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists() and (out / "vocab.json").is_file()
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["base_model_name_or_path"] == str(base)
    saved = torch.load(out / CHECKPOINT_NAME, weights_only=True)["model"]
    assert saved and all(k.endswith((".lora_A", ".lora_B")) for k in saved)  # only the adapter is kept
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    hf = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), out).eval()
    with torch.no_grad():
        ours = load_model(base, adapter=out)(ids).logits
        torch.testing.assert_close(ours, hf(ids).logits, atol=1e-4, rtol=0)
        assert (ours - load_model(base)(ids).logits).abs().max() > 1e-3
    assert result.val_loss is not None


def test_lora_bias_all_run_trains_and_saves_the_biases_as_peft_does(data, base, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from gpt2kit.cli import main

    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--model", str(base), "--out", str(out), "--batch-size", "2",
                 "--seq-len", "32", "--max-steps", "6", "--lr", "1e-2", "--eval-every", "0", "--optimizer", "adamw",
                 "--lora-rank", "4", "--lora-bias", "all"]) == 0
    said = capsys.readouterr()
    assert "training 4,832 of" in said.out + said.err  # 4,096 adapter values + 736 bias values
    assert json.loads((out / "adapter_config.json").read_text())["bias"] == "all"
    saved = load_file(out / "adapter_model.safetensors")
    ln_f = saved["base_model.model.transformer.ln_f.bias"]
    assert (ln_f - load_model(base).ln_f.bias).abs().max() > 1e-4  # the bias trained and was saved
    assert "base_model.model.transformer.h.1.mlp.c_proj.base_layer.bias" in saved
    kept = torch.load(out / CHECKPOINT_NAME, weights_only=True)["model"]
    assert "ln_f.bias" in kept and "h.0.ln_1.bias" in kept  # resume restores the biases too
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    hf = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(load_model(base, adapter=out)(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bias, tokens", [("none", None), ("all", None), ("none", 5)])
def test_lora_resume_is_exact(data, base, tmp_path, bias, tokens):
    kw = dict(lora_rank=4, lora_dropout=0.1, dropout=0.1, optimizer="muon", max_steps=10, total_batch_tokens=128,
              lora_bias=bias, lora_tokens=tokens)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(_cfg(data, base, straight, **kw))
    train(_cfg(data, base, split, stop_at=5, **kw))
    train(resume_config(split))
    _close(_losses(straight), _losses(split), 1e-6)
    a = torch.load(straight / CHECKPOINT_NAME, weights_only=True)["model"]
    b = torch.load(split / CHECKPOINT_NAME, weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_kill_9_during_the_adapter_save_keeps_the_previous_adapter_and_resume_redoes_it(data, base, tmp_path):
    """SIGKILL inside the adapter save (GPT2KIT_KILL_AT=directory-swap: the new adapter complete beside
    the old one, not swapped in): the previous adapter is untouched and loads, and resuming ends with
    the adapter and losses of an uninterrupted run."""
    from safetensors.torch import load_file

    kw = dict(lora_rank=4, max_steps=6, eval_every=0)
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(_cfg(data, base, straight, **kw))
    train(_cfg(data, base, run, stop_at=3, **kw))
    before = {p.name: p.read_bytes() for p in run.glob("adapter*")}
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1",
                        "HF_HUB_OFFLINE": "1", "GPT2KIT_KILL_AT": "directory-swap"}
    killed = subprocess.run([sys.executable, "-m", "gpt2kit", "train", "--out", str(run), "--resume"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "step 6/6" in killed.stderr  # killed in the final save, after the last step
    assert {p.name: p.read_bytes() for p in run.glob("adapter*")} == before and len(before) == 2
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the previous adapter loads, and is not a no-op
        assert (load_model(base, adapter=run)(ids).logits - load_model(base)(ids).logits).abs().max() > 1e-4
    assert list(tmp_path.glob(".run.saving-*"))  # the killed save's staging directory, never taken for OUT
    result = train(resume_config(run))
    assert result.step == 6
    _close(_losses(straight), _losses(run), 1e-6)
    a, b = load_file(straight / "adapter_model.safetensors"), load_file(run / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0)
    assert not list(tmp_path.glob(".run.saving-*"))  # removed by the next save


def test_lora_with_bf16_autocast_tracks_float32(data, base, tmp_path):
    train(_cfg(data, base, tmp_path / "f32", lora_rank=4, max_steps=4, eval_every=0))
    train(_cfg(data, base, tmp_path / "bf16", lora_rank=4, max_steps=4, eval_every=0, dtype="bfloat16"))
    a, b = _losses(tmp_path / "f32"), _losses(tmp_path / "bf16")
    assert a != b
    _close(a, b, 0.05)


def test_lora_two_ranks_match_one_process(data, base, tmp_path):
    common = ["--data", str(data), "--model", str(base), "--seq-len", "32", "--max-steps", "4", "--optimizer",
              "adamw", "--lr", "1e-2", "--total-batch-tokens", "128", "--eval-every", "0", "--lora-rank", "4",
              "--activation-checkpointing"]
    train_one_and_two_ranks(common, 4, tmp_path / "one", tmp_path / "two")
    _close(_losses(tmp_path / "one"), _losses(tmp_path / "two"), 1e-5)


def test_lora_bad_settings_are_one_line(data, base, tmp_path, capsys):
    from gpt2kit.cli import main

    common = ["train", "--data", str(data), "--model", str(base), "--max-steps", "1"]
    cases = [(["--lora-rank", "0"], "TrainConfig.lora_rank must be an integer >= 1, got 0"),
             (["--lora-rank", "40"], "LoRA rank must be an integer in [1, 32] for h.0.attn.c_attn (96 x 32), got 40"),
             (["--lora-rank", "2", "--lora-targets", "c_attn,q_proj"],
              "unknown LoRA target 'q_proj'; valid targets: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj"),
             (["--lora-rank", "2", "--freeze", "wte.*"], "cannot be combined with --lora-rank"),
             (["--lora-rank", "2", "--lora-bias", "some"],
              "unknown LoRA bias 'some'; valid choices: none, all, lora_only"),
             (["--lora-bias", "all"], "--lora-bias all needs --lora-rank")]
    for i, (flags, words) in enumerate(cases):
        assert main([*common, "--out", str(tmp_path / f"o{i}"), *flags]) == 1
        err = capsys.readouterr().err
        assert words in err.splitlines()[-1] and err.count("error:") == 1, err
        assert not (tmp_path / f"o{i}" / "adapter_config.json").exists()


def test_a_lora_run_says_it_wrote_an_adapter_and_the_loader_says_how_to_use_it(data, base, tmp_path, capsys):
    from gpt2kit.cli import main

    out = tmp_path / "lora"
    assert main(["train", "--data", str(data), "--model", str(base), "--out", str(out), "--batch-size", "2",
                 "--seq-len", "32", "--max-steps", "2", "--eval-every", "0", "--lora-rank", "2"]) == 0
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("done: step 2, loss ")
    assert last.endswith(f"; adapter in {out} (use --model {base} --adapter {out}, or gpt2kit merge)"), last
    assert main(["generate", "hello", "--model", str(out)]) == 1
    assert error_lines(capsys.readouterr().err) == [f"gpt2kit generate: error: {out}: a LoRA adapter (peft's format), "
                                                    f"not a model; made for the base {str(base)!r}: use --model "
                                                    f"{base} --adapter {out}, or gpt2kit merge"]
    assert main(["train", "--data", str(data), "--model", str(base), "--out", str(tmp_path / "full"), "--batch-size",
                 "2", "--seq-len", "32", "--max-steps", "1", "--eval-every", "0"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"; model in {tmp_path / 'full'}")


# --- activation checkpointing -------------------------------------------------------------------


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    from gpt2kit.model import GPT2
    from gpt2kit.train.finetune import checkpoint_blocks
    from gpt2kit.train.loss import TrainingLoss

    torch.manual_seed(0)
    plain = GPT2(BASE_CFG.replace(dropout=0.1)).train()
    ckpt = GPT2(BASE_CFG.replace(dropout=0.1)).train()
    ckpt.load_state_dict(plain.state_dict())
    checkpoint_blocks(ckpt)
    assert list(ckpt.state_dict()) == list(plain.state_dict())  # names untouched
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    losses, saved = [], []
    for model in (plain, ckpt):
        torch.manual_seed(7)  # the same dropout masks; the recompute must replay them
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = TrainingLoss(model)(x, y)
        loss.backward()
        losses.append(loss.item())
        saved.append(count[0])
    assert saved[1] < saved[0] / 2  # the blocks' activations were not kept
    assert abs(losses[0] - losses[1]) <= 1e-6
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_run_equals_plain_run(data, base, tmp_path):
    train(_cfg(data, base, tmp_path / "plain", max_steps=4, dropout=0.1))
    train(_cfg(data, base, tmp_path / "ckpt", max_steps=4, dropout=0.1, activation_checkpointing=True))
    _close(_losses(tmp_path / "plain"), _losses(tmp_path / "ckpt"), 1e-6)


# --- freezing -----------------------------------------------------------------------------------


def test_freeze_and_train_only_by_name(data, base, tmp_path):
    from safetensors.torch import load_file

    before = load_file(base / "model.safetensors")
    train(_cfg(data, base, tmp_path / "frozen", max_steps=3, eval_every=0, freeze="wte.*,wpe.*,h.0.*"))
    after = load_file(tmp_path / "frozen" / "model.safetensors")
    for k, t in after.items():
        same = torch.equal(t, before[k])
        frozen = k.startswith(("transformer.wte.", "transformer.wpe.", "transformer.h.0."))
        assert same == frozen, k
    train(_cfg(data, base, tmp_path / "only", max_steps=3, eval_every=0, train_only="h.1.mlp.*", optimizer="muon"))
    after = load_file(tmp_path / "only" / "model.safetensors")
    changed = {k for k, t in after.items() if not torch.equal(t, before[k])}
    assert changed == {f"transformer.h.1.mlp.{m}.{p}" for m in ("c_fc", "c_proj") for p in ("weight", "bias")}


def test_a_freeze_glob_that_matches_nothing_is_named(data, base, tmp_path):
    with pytest.raises(ValueError, match=r"--freeze 'embed\.\*' matches no parameter; names look like wte.weight"):
        train(_cfg(data, base, tmp_path / "x", freeze="embed.*"))
    with pytest.raises(ValueError, match="leaves no parameter to train"):
        train(_cfg(data, base, tmp_path / "y", train_only="h.0.*", freeze="h.*"))
