"""The training loop: schedule, optimizer groups, outputs, exact resume, Ctrl-C, DDP, fine-tuning.

Models are tiny (2 layers, width 32, n_ctx 64, GPT-2's 50257 vocab) and the shards hold random
tokens below 512, so a run of a few steps takes well under a second. Losses are compared at the
documented tolerances: resume within 1e-6 (float32, CPU), 2 DDP ranks vs 1 within 1e-5.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2kit.config import GPT2Config
from gpt2kit.data import write_shard
from gpt2kit.model import GPT2
from gpt2kit.train.build import _make_optimizer
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.loop import resume_config, train
from gpt2kit.train.run_dir import CHECKPOINT_NAME

TINY = {"model": "gpt2-tiny", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_ctx": 64}
TINY_FLAGS = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--n-ctx", "64"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Random tokens with a skewed distribution (so there is something to learn), in llm.c shards."""
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    probs = 1.0 / np.arange(1, 513)
    probs /= probs.sum()
    write_shard(d / "train_000000.bin", rng.choice(512, size=3_000, p=probs))  # crossed mid-run
    write_shard(d / "train_000001.bin", rng.choice(512, size=20_000, p=probs))
    write_shard(d / "val_000000.bin", rng.choice(512, size=5_000, p=probs))
    return d


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and much slower when a busy machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(shards: Path, out: Path, **kw) -> TrainConfig:
    base = dict(TINY, data=str(shards), out=str(out), batch_size=4, seq_len=32, max_steps=8,
                eval_every=4, eval_steps=2, save_every=0, log_every=100)
    return TrainConfig(**(base | kw))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _metrics(out) if "loss" in r]


def _val_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in _metrics(out) if "val_loss" in r]


def _assert_same_losses(a: list[tuple[int, float]], b: list[tuple[int, float]], tol: float) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    worst = max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True))
    assert worst <= tol, f"losses differ by {worst:.3g} > {tol}: {a} vs {b}"


# --- schedule, config, optimizer ---------------------------------------------------------------


@pytest.mark.parametrize("field, value, words", [
    ("batch_size", 0, "batch_size"),
    ("max_steps", -1, "max_steps"),
    ("lr", 0.0, "lr"),
    ("min_lr", 1.0, "min_lr"),
    ("dropout", 1.0, "dropout"),
    ("dtype", "float16", "float16"),
    ("grad_clip", -1.0, "grad_clip"),
    ("total_batch_tokens", 100, "total_batch_tokens 100 is not a multiple of batch_size 4 x seq_len 32"),
])
def test_config_rejects_bad_values(tmp_path, field, value, words):
    with pytest.raises(ValueError, match=words):
        _cfg(tmp_path, tmp_path / "out", **{field: value})


def test_config_normalises_dtype(tmp_path):
    assert _cfg(tmp_path, tmp_path, dtype="bf16").dtype == "bfloat16"
    assert _cfg(tmp_path, tmp_path, dtype="fp32").dtype == "float32"


def test_batch_must_divide_total_tokens_and_fit_context(shards, tmp_path):
    with pytest.raises(ValueError, match=r"seq_len 128 exceeds the model's context n_ctx=64"):
        train(_cfg(shards, tmp_path / "a", seq_len=128))
    # Without an explicit seq_len the check happens once the model's n_ctx is known.
    with pytest.raises(ValueError, match=r"total_batch_tokens 1000 is not a multiple of batch_size 4 x "
                                         r"seq_len 64 x world_size 1 = 256"):
        train(_cfg(shards, tmp_path / "b", seq_len=None, total_batch_tokens=1000))


def test_weight_decay_on_2d_weights_only(tmp_path):
    model = GPT2.from_name("gpt2-tiny", n_layer=2, n_embd=32, n_head=2, n_ctx=64)
    opt = _make_optimizer(model, _cfg(tmp_path, tmp_path, weight_decay=0.1, optimizer="adamw"))
    decayed, plain = ({id(p) for p in g["params"]} for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in decayed} >= {"wte.weight", "wpe.weight", "h.0.attn.c_attn.weight",
                                            "h.1.mlp.c_proj.weight"}
    assert all(names[i].endswith(".weight") and ".ln_" not in names[i] for i in decayed)
    assert {names[i] for i in plain} >= {"h.0.attn.c_attn.bias", "h.0.ln_1.weight", "ln_f.weight", "ln_f.bias"}
    assert decayed | plain == set(names) and not decayed & plain
    adamw = opt.optimizers["adamw"]
    assert adamw.defaults["betas"] == (0.9, 0.95) and adamw.defaults["fused"]  # fused AdamW exists on CPU


@pytest.mark.skipif(getattr(torch.optim, "Muon", None) is None, reason="torch.optim.Muon needs PyTorch 2.9+")
@pytest.mark.parametrize("dtype, want", [("float32", torch.float32), ("bf16", torch.bfloat16)])
def test_muon_orthogonalises_in_the_runs_dtype_on_a_cpu_with_native_bfloat16(shards, tmp_path, monkeypatch,
                                                                              dtype, want):
    """The default optimizer (Muon) on a CPU that multiplies bfloat16 natively (AVX512-BF16 / AMX,
    stood in for here): a float32 run runs every Newton-Schulz iteration in float32, none in
    torch's bfloat16 one; a bfloat16 run in bfloat16. The resolved choice is saved with the run."""
    import torch.optim._muon

    import gpt2kit.train.optim

    seen: list[torch.dtype] = []
    ours, torchs = gpt2kit.train.optim.zeropower_via_newtonschulz, torch.optim._muon._zeropower_via_newtonschulz
    monkeypatch.setattr(gpt2kit.train.optim, "cpu_has_native_bfloat16", lambda: True)

    def spy(grad, ns_coefficients, ns_steps, eps, dtype):
        seen.append(dtype)
        return ours(grad, ns_coefficients, ns_steps, eps, dtype)

    monkeypatch.setattr(gpt2kit.train.optim, "zeropower_via_newtonschulz", spy)
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz",
                        lambda g, *a, **kw: seen.append(torch.bfloat16) or torchs(g, *a, **kw))  # always bf16
    train(_cfg(shards, tmp_path / "run", max_steps=2, eval_every=0, dtype=dtype))
    assert len(seen) == 2 * 8 and set(seen) == {want}, seen  # 2 steps x 8 block matrices
    saved = torch.load(tmp_path / "run" / CHECKPOINT_NAME, weights_only=True)["config"]
    assert (saved["optimizer"], saved["muon_dtype"]) == ("muon", str(want).removeprefix("torch."))


def test_muon_dtype_option(shards, tmp_path):
    assert _cfg(tmp_path, tmp_path, muon_dtype="bf16").muon_dtype == "bfloat16"
    with pytest.raises(ValueError, match="TrainConfig.muon_dtype must be one of .*got 'float16'"):
        _cfg(tmp_path, tmp_path, muon_dtype="float16")
    with pytest.raises(ValueError, match="--muon-dtype bfloat16 needs --optimizer muon"):
        train(_cfg(shards, tmp_path / "a", optimizer="adamw", muon_dtype="bfloat16"))


# --- a run and its outputs ----------------------------------------------------------------------


def test_train_writes_metrics_plot_checkpoint_and_hf_model(shards, tmp_path):
    out = tmp_path / "run"
    result = train(_cfg(shards, out, max_steps=12, lr=3e-3, eval_every=4))
    assert result.step == 12 and result.tokens == 12 * 4 * 32
    records = _metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(set(r) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} for r in steps)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    assert [s for s, _ in _val_losses(out)] == [4, 8, 12]  # from scratch: no evaluation of the untrained model
    assert steps[0]["loss"] == pytest.approx(math.log(50257), abs=0.1)  # GPT-2 init: near-uniform
    val = [v for _, v in _val_losses(out)]
    assert val[-1] < steps[0]["loss"] - 0.5, f"validation loss did not fall: {val}"
    assert result.val_loss == val[-1] and result.loss == steps[-1]["loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    assert ckpt["step"] == 12 and set(ckpt) >= {"model", "optimizer", "rng", "loader", "config"}
    assert ckpt["config"]["seq_len"] == 32 and ckpt["config"]["warmup_steps"] == 12 // 20


def test_final_model_loads_in_transformers_with_the_same_logits(shards, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from gpt2kit.checkpoint import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    train(_cfg(shards, out, max_steps=3, lr=3e-3))
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    assert ckpt["model_config"]["n_vocab_padded"] == 50304  # trained with the padded head; HF files hold 50257
    trained = GPT2(GPT2Config(**ckpt["model_config"]))
    trained.load_state_dict(ckpt["model"])
    trained.eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trained(idx).logits
        theirs = hf(idx).logits
        again = load_model(out)(idx).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    torch.testing.assert_close(again, ours, atol=1e-5, rtol=0)


def test_same_seed_same_run_other_seed_other_run(shards, tmp_path):
    kw = dict(max_steps=4, dropout=0.1, eval_every=0)
    train(_cfg(shards, tmp_path / "a", **kw))
    train(_cfg(shards, tmp_path / "b", **kw))
    train(_cfg(shards, tmp_path / "c", seed=7, **kw))
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    assert _losses(tmp_path / "a") != _losses(tmp_path / "c")


def test_bf16_autocast_tracks_float32(shards, tmp_path):
    train(_cfg(shards, tmp_path / "f32", max_steps=4, lr=3e-3, eval_every=0))
    train(_cfg(shards, tmp_path / "bf16", max_steps=4, lr=3e-3, eval_every=0, dtype="bf16"))
    a, b = _losses(tmp_path / "f32"), _losses(tmp_path / "bf16")
    assert a != b  # bf16 matmuls really ran
    _assert_same_losses(a, b, tol=0.05)
    saved = torch.load(tmp_path / "bf16" / CHECKPOINT_NAME, weights_only=True)["model"]
    assert all(t.dtype == torch.float32 for t in saved.values())  # float32 master weights


# --- nothing lost -------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling, optimizer, schedule",
                         [("random", "muon", "wsd"), ("sequential", "adamw", "cosine")])
def test_resume_continues_exactly(shards, tmp_path, sampling, optimizer, schedule):
    """2N steps straight == N steps, --resume, N steps: same per-step losses (float32 CPU, 1e-6).

    With dropout (RNG state), gradient accumulation (loader position mid-step) and, when sequential,
    a shard boundary crossed after the resume; both optimizers (Muon's momentum, AdamW's moments)."""
    kw = dict(max_steps=16, dropout=0.1, total_batch_tokens=4 * 32 * 2, eval_every=4, save_every=0,
              sampling=sampling, optimizer=optimizer, schedule=schedule)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(_cfg(shards, straight, **kw))
    first = train(_cfg(shards, split, stop_at=8, **kw))
    assert first.step == 8 and (split / CHECKPOINT_NAME).exists() and (split / "config.json").exists()
    second = train(resume_config(split))
    assert second.step == 16 and second.tokens == 8 * 256
    _assert_same_losses(_losses(straight), _losses(split), tol=1e-6)
    _assert_same_losses(_val_losses(straight), _val_losses(split), tol=1e-6)
    a = torch.load(straight / CHECKPOINT_NAME, weights_only=True)
    b = torch.load(split / CHECKPOINT_NAME, weights_only=True)
    assert a["loader"] == b["loader"]
    if sampling == "sequential":
        assert a["loader"]["shard"] == 1  # the run went on into shard 1
    else:
        assert a["loader"]["batches"] == 32  # 16 steps of 2 micro-steps
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=1e-6, rtol=0)


def test_resume_after_a_crash_redoes_the_lost_steps(shards, tmp_path):
    """Steps logged after the last checkpoint are dropped from metrics.jsonl and redone."""
    kw = dict(max_steps=10, save_every=4, eval_every=0)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(_cfg(shards, straight, **kw))
    train(_cfg(shards, crashed, stop_at=4, **kw))
    shutil.copy(crashed / CHECKPOINT_NAME, tmp_path / "step4.pt")
    train(resume_config(crashed, stop_at=7))  # steps 5-7 logged ...
    shutil.copy(tmp_path / "step4.pt", crashed / CHECKPOINT_NAME)  # ... but the process died before saving
    train(resume_config(crashed))
    _assert_same_losses(_losses(straight), _losses(crashed), tol=1e-6)


def test_resume_can_extend_but_not_change_the_run(shards, tmp_path):
    out = tmp_path / "run"
    train(_cfg(shards, out, max_steps=4, eval_every=0))
    with pytest.raises(ValueError, match=r"lr \(checkpoint 0.0006, now 0.001\)"):
        train(resume_config(out, lr=1e-3))
    with pytest.raises(FileExistsError, match="pass --resume"):
        train(_cfg(shards, out, max_steps=4))
    result = train(resume_config(out, max_steps=6))  # extending the schedule is allowed
    assert result.step == 6 and [s for s, _ in _losses(out)] == list(range(1, 7))


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume"):
        resume_config(tmp_path)


def test_crash_mid_save_leaves_the_previous_checkpoint_whole(shards, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_cfg(shards, out, max_steps=2, eval_every=0))
    before = (out / CHECKPOINT_NAME).read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        real_save({"half": torch.zeros(1000)}, f)  # some bytes reach the temporary file ...
        raise OSError("disk full")  # ... then the save dies

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        train(resume_config(out, max_steps=4))
    assert (out / CHECKPOINT_NAME).read_bytes() == before
    assert not list(out.glob(".*.tmp"))
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["step"] == 2


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training exited early: {proc.communicate()}")
        path = out / "metrics.jsonl"
        if path.exists() and sum('"loss"' in line for line in path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps within {timeout}s")


def _env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_ctrl_c_saves_a_checkpoint_then_resume_continues(shards, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gpt2kit", "train", "--data", str(shards), "--out", str(out), *TINY_FLAGS,
           "--batch-size", "4", "--seq-len", "32", "--max-steps", "100000", "--eval-every", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for_steps(out, 3, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "SIGINT received" in err and "continue with --resume" in err
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    logged = [s for s, _ in _losses(out)]
    assert ckpt["step"] >= 3 and logged == list(range(1, ckpt["step"] + 1))
    assert (out / "config.json").exists()  # the model so far, usable by generate/score
    result = train(resume_config(out, max_steps=ckpt["step"] + 2, stop_at=None))
    assert result.step == ckpt["step"] + 2


# --- data parallel ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [None, "adamw"])
def test_two_ranks_match_one_process(shards, tmp_path, optimizer):
    """torchrun with 2 gloo ranks x batch 2 == 1 process x batch 4 (same global batch, 2 micro-steps),
    float32, within 1e-5, with the default optimizer (Muon + AdamW) and with AdamW alone.

    Random windows (the default sampling). Muon orthogonalises a float32 run in float32 on every
    machine; in bfloat16 the last-bit difference between an all-reduced and a one-process gradient
    sum rounds to different updates (~3e-5 apart after six steps, 9e-4 after forty)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    common = ["--data", str(shards), *TINY_FLAGS, "--seq-len", "32", "--max-steps", "6",
              *(["--optimizer", optimizer] if optimizer else []),
              "--total-batch-tokens", str(4 * 32 * 2), "--eval-every", "3", "--eval-steps", "2"]
    one = subprocess.run([sys.executable, "-m", "gpt2kit", "train", *common, "--batch-size", "4",
                          "--out", str(tmp_path / "one")], capture_output=True, text=True, env=_env(), timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "gpt2kit", "train", *common, "--batch-size", "2", "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert two.returncode == 0, two.stderr
    assert "2 x 2 x 32 tokens x 2 micro-steps" in two.stderr
    _assert_same_losses(_losses(tmp_path / "one"), _losses(tmp_path / "two"), tol=1e-5)
    _assert_same_losses(_val_losses(tmp_path / "one"), _val_losses(tmp_path / "two"), tol=1e-5)
    assert two.stdout.count("model and checkpoint in") == 1  # rank 0 alone reports


# --- fine-tuning and the CLI ------------------------------------------------------------------


def test_fine_tune_a_saved_checkpoint(shards, tmp_path):
    from gpt2kit.checkpoint import save_model

    torch.manual_seed(0)
    base = GPT2.from_name("gpt2-tiny", n_layer=2, n_embd=32, n_head=2, n_ctx=64)
    save_model(base, tmp_path / "base")
    with pytest.raises(ValueError, match="--n-layer only apply to from-scratch runs"):
        train(TrainConfig(data=str(shards), out=str(tmp_path / "x"), model=str(tmp_path / "base"), n_layer=3))
    ft = dict(data=str(shards), model=str(tmp_path / "base"), batch_size=4, seq_len=32, lr=1e-3, eval_every=0)
    train(TrainConfig(out=str(tmp_path / "dropout"), max_steps=1, dropout=0.1, **ft))
    assert torch.load(tmp_path / "dropout" / CHECKPOINT_NAME, weights_only=True)["model_config"]["dropout"] == 0.1
    out = tmp_path / "ft"
    train(TrainConfig(out=str(out), max_steps=3, **(ft | {"eval_every": 3, "eval_steps": 2})))
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    tuned = GPT2(base.config)
    tuned.load_state_dict(ckpt["model"])  # the base's architecture ...
    with torch.no_grad():
        idx = torch.randint(0, 512, (1, 16))
        assert not torch.equal(tuned.eval()(idx).logits, base.eval()(idx).logits)  # ... with trained weights
    # The first step's loss is the base model's own loss on the first batch (random windows, seed 1337).
    from gpt2kit.data import RandomWindowLoader

    x, y = RandomWindowLoader(shards, batch_size=4, seq_len=32, seed=1337).next_batch()
    with torch.no_grad():
        want = base(x, targets=y).loss.item()
    assert _losses(out)[0][1] == pytest.approx(want, abs=1e-5)
    # Fine-tuning evaluates the base before the first step (from scratch, the untrained model is not):
    # the mean loss of the validation split's first 2 batches.
    from gpt2kit.data import ShardLoader

    val = ShardLoader(shards, "val", batch_size=4, seq_len=32)
    with torch.no_grad():
        want = sum(base(x, targets=y).loss.item() for x, y in (val.next_batch() for _ in range(2))) / 2
    assert [s for s, _ in _val_losses(out)] == [0, 3]
    assert _val_losses(out)[0][1] == pytest.approx(want, abs=1e-5)


def test_a_mistyped_model_name_lists_the_presets_and_the_published_names(shards, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        train(TrainConfig(data=str(shards), out=str(tmp_path / "o"), model="gpt2-huge", max_steps=1))
    msg = str(e.value)
    assert "neither a preset to train from scratch (gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-tiny, " \
           "gpt2-mini)" in msg
    assert "a published GPT-2 name: gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2" in msg, msg
    with pytest.raises(FileNotFoundError, match="did you mean gpt2-tiny"):
        train(TrainConfig(data=str(shards), out=str(tmp_path / "o"), model="gpt2-tinny", max_steps=1))


def test_cli_prepare_then_train(tmp_path, capsys):
    from gpt2kit.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 40)
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "shards"), "--val-fraction", "0.2",
                 "--workers", "1"]) == 0
    assert "20 documents" in capsys.readouterr().out
    out = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "shards"), "--out", str(out), *TINY_FLAGS, "--batch-size", "2",
            "--seq-len", "32", "--max-steps", "4", "--eval-every", "2", "--eval-steps", "1", "--lr", "3e-3",
            "--stop-at", "2"]
    assert main(argv) == 0
    assert "step 2" in capsys.readouterr().out
    assert main(["train", "--out", str(out), "--resume"]) == 0  # every other setting comes from the checkpoint
    assert "step 4" in capsys.readouterr().out
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4]
    assert main(["train", "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "bad"), *TINY_FLAGS,
                 "--total-batch-tokens", "1000", "--batch-size", "2", "--seq-len", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpt2kit train: error: total_batch_tokens 1000 is not a multiple of") and err.count("\n") == 1
    assert main(["train", "--out", str(tmp_path / "nodata")]) == 1
    assert "--data is required" in capsys.readouterr().err


# --- exact resume of a fine-tune, whatever layout the loader gave -------------------------------


def _hf_base(tmp_path: Path) -> Path:
    from helpers import random_hf_model

    from gpt2kit.config import GPT2Config

    path = tmp_path / "hf_base"
    random_hf_model(GPT2Config(n_vocab=600, n_ctx=64, n_embd=32, n_head=2, n_layer=2), seed=3).save_pretrained(path)
    return path


def _tf_base(tmp_path: Path) -> Path:
    return Path(__file__).parent / "fixtures" / "openai_tf_tiny"


def _bf16_base(tmp_path: Path) -> Path:
    """An HF directory holding bfloat16 weights: the float32 fine-tune converts them at load."""
    from helpers import random_hf_model

    from gpt2kit.config import GPT2Config

    path = tmp_path / "bf16_base"
    hf = random_hf_model(GPT2Config(n_vocab=600, n_ctx=64, n_embd=32, n_head=2, n_layer=2), seed=4)
    hf.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("make_base", [_hf_base, _tf_base, _bf16_base], ids=["hf", "openai_tf", "bf16"])
def test_resume_of_a_fine_tune_continues_exactly(shards, tmp_path, make_base):
    """A fine-tune from a loaded checkpoint (whose matrices the loader may hand over in any memory
    layout) resumed at step N == the straight run, per step within 1e-6 (float32 CPU, fused AdamW)."""
    from gpt2kit.checkpoint import load_model

    base = make_base(tmp_path)
    n_vocab = load_model(base).config.n_vocab
    data = tmp_path / "data"  # tokens the base's vocabulary holds
    data.mkdir()
    rng = np.random.default_rng(1)
    write_shard(data / "train_000000.bin", rng.integers(0, min(n_vocab, 512), size=6_000))
    n_ctx = load_model(base).config.n_ctx
    kw = dict(data=str(data), model=str(base), batch_size=2, seq_len=min(16, n_ctx), lr=3e-3, max_steps=10,
              eval_every=0, save_every=0, log_every=100)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(TrainConfig(out=str(straight), **kw))
    train(TrainConfig(out=str(split), stop_at=4, **kw))
    train(resume_config(split))
    _assert_same_losses(_losses(straight), _losses(split), tol=1e-6)
    a = torch.load(straight / CHECKPOINT_NAME, weights_only=True)["model"]
    b = torch.load(split / CHECKPOINT_NAME, weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_restored_optimizer_state_takes_its_parameters_layout(tmp_path):
    """An AdamW state saved with column-major moments (as checkpoints of older versions hold) steps
    exactly like the same state held row-major (fused AdamW pairs elements by memory slot)."""
    from gpt2kit.train.build import _match_param_layout

    cfg = _cfg(tmp_path, tmp_path, lr=1e-2, optimizer="adamw")
    torch.manual_seed(0)
    model = GPT2.from_name("gpt2-tiny", n_layer=1, n_embd=32, n_head=2, n_ctx=64)
    opt = _make_optimizer(model, cfg)
    idx = torch.randint(0, 512, (2, 16))
    model(idx, targets=idx).loss.backward()
    opt.step()
    opt.zero_grad()
    state = copy.deepcopy(opt.state_dict()["adamw"])  # state_dict() shares the live per-parameter dicts
    # The same values, stored transposed (what a run over loader-given column-major matrices saved).
    for s in state["state"].values():
        for k, v in s.items():
            if v.dim() == 2:
                s[k] = v.t().contiguous().t()
    twins = []
    for fix in (False, True):
        m = GPT2.from_name("gpt2-tiny", n_layer=1, n_embd=32, n_head=2, n_ctx=64)
        m.load_state_dict(model.state_dict())
        o = _make_optimizer(m, cfg)
        o.load_state_dict(copy.deepcopy(state))  # loading keeps the tensors; step() updates them in place
        if fix:
            _match_param_layout(o)
        m(idx, targets=idx).loss.backward()
        o.step()
        twins.append(m)
    model(idx, targets=idx).loss.backward()
    opt.step()
    for (name, want), got in zip(model.state_dict().items(), twins[1].state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.allclose(b, w, atol=1e-6) for b, w in zip(twins[0].state_dict().values(),
                                                                   model.state_dict().values(), strict=True))


# --- one run per OUT; failed runs leave nothing behind ------------------------------------------

_HOLD_OUT = r"""
import sys, time
from pathlib import Path
from gpt2kit.train.distributed import setup
from gpt2kit.train.run_dir import claim_out
with claim_out(Path(sys.argv[1]), setup("cpu")):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_second_run_into_the_same_out_names_the_holder(shards, tmp_path):
    import socket

    from gpt2kit.train.run_dir import OutInUse

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_OUT, str(out)], stdout=subprocess.PIPE, text=True,
                              env=_env())
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(OutInUse, match=rf"{out} is in use by another training run \(pid {holder.pid} on "
                                           rf"{socket.gethostname()}, since "):
            train(_cfg(shards, out, max_steps=2, eval_every=0))
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    train(_cfg(shards, out, max_steps=2, eval_every=0))  # the kernel dropped the dead holder's lock
    train(resume_config(out, max_steps=3))  # and each run released its own


def test_a_failed_run_removes_the_out_it_created(shards, tmp_path):
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="seq_len 128 exceeds"):
        train(_cfg(shards, out, seq_len=128))
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    with pytest.raises(ValueError, match="seq_len 128 exceeds"):
        train(_cfg(shards, existing, seq_len=128))
    assert existing.is_dir()  # not ours to remove
    with pytest.raises(NotADirectoryError, match="is a file"):
        train(_cfg(shards, tmp_path / "a_file", max_steps=1)) if (tmp_path / "a_file").write_text("x") else None


# --- a damaged checkpoint, a diverged run, a full disk ---------------------------------------------


def test_a_bit_flipped_checkpoint_is_refused(shards, tmp_path):
    out = tmp_path / "run"
    train(_cfg(shards, out, max_steps=2, eval_every=0))
    path = out / CHECKPOINT_NAME
    good = path.read_bytes()
    assert torch.load(path, weights_only=True)["step"] == 2  # torch still reads the file with its trailer
    for where in (len(good) // 2, len(good) - 10):  # inside a tensor; inside the recorded checksum
        bad = bytearray(good)
        bad[where] ^= 0x10
        path.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=r"checkpoint\.pt: checksum mismatch: the file was damaged"):
            train(resume_config(out, max_steps=4))
    path.write_bytes(good)
    assert train(resume_config(out, max_steps=3)).step == 3


def _strict_json(line: str):
    def refuse(name: str):
        raise ValueError(f"bare {name} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


def test_a_diverging_run_stops_without_overwriting_the_last_good_checkpoint(shards, tmp_path, capsys):
    from gpt2kit.cli import main

    out = tmp_path / "run"
    # An absurd rate: step 1 is finite, its update makes the weights ~1e30, step 2's logits overflow.
    argv = ["train", "--data", str(shards), "--out", str(out), *TINY_FLAGS, "--batch-size", "4", "--seq-len", "32",
            "--max-steps", "6", "--eval-every", "0", "--save-every", "1", "--lr", "1e30", "--warmup-steps", "0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("gpt2kit train: error: step 2: loss nan") and "stopped without saving: the last good " \
        f"checkpoint is {out / CHECKPOINT_NAME} (step 1)" in last, err
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    assert ckpt["step"] >= 1
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert not (out / "model.safetensors").exists()  # never exported the diverged weights
    records = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, ckpt["step"] + 1))
    assert all(math.isfinite(r["loss"]) for r in records)


def test_metrics_never_write_a_bare_nan(tmp_path):
    from gpt2kit.train.metrics import Metrics

    m = Metrics(tmp_path, None)
    m.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    m.close()
    assert _strict_json((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": None, "grad_norm": None}


@pytest.mark.parametrize("failure", ["oserror", "torch"])
def test_a_full_disk_says_so(shards, tmp_path, monkeypatch, failure):
    import errno

    out = tmp_path / "run"
    train(_cfg(shards, out, max_steps=2, eval_every=0))
    before = (out / CHECKPOINT_NAME).read_bytes()
    real_statvfs = os.statvfs

    def full(obj, f, *args, **kwargs):
        f.write(b"x" * 1000)
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255)))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=rf"no space left on {out} while writing checkpoint\.pt"):
        train(resume_config(out, max_steps=4))
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    assert (out / CHECKPOINT_NAME).read_bytes() == before


def test_a_full_disk_while_exporting_the_model_names_out_and_keeps_the_state(shards, tmp_path, monkeypatch):
    """safetensors' own error type (neither OSError nor RuntimeError) on a full disk is reported as one,
    naming OUT, after checkpoint.pt is written."""
    from safetensors import SafetensorError

    from gpt2kit.train import finetune

    out = tmp_path / "run"

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(finetune, "save_output", full)
    with pytest.raises(OSError, match=rf"no space left on {out} while saving the model; {CHECKPOINT_NAME} "
                                      r"\(step 2\) was saved"):
        train(_cfg(shards, out, max_steps=2, eval_every=0))
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["step"] == 2


def test_ctrl_c_during_a_step_stops_after_that_step(shards, tmp_path, monkeypatch):
    """The stop flag is read after the backward pass: a signal during step 3 ends the run at step 3."""
    from gpt2kit.data import RandomWindowLoader, ShardLoader

    calls = {"train": 0}

    def signalling(real):
        def next_batch(self):
            if self.files[0].name.startswith("train"):
                calls["train"] += 1
                if calls["train"] == 3:  # step 3's batch: the signal arrives while step 3 runs
                    os.kill(os.getpid(), signal.SIGINT)
            return real(self)
        return next_batch

    for loader in (ShardLoader, RandomWindowLoader):  # whichever --sampling the run uses
        monkeypatch.setattr(loader, "next_batch", signalling(loader.next_batch))
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(shards, out, max_steps=10, eval_every=0))
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["step"] == 3
    assert [s for s, _ in _losses(out)] == [1, 2, 3]


def test_parameter_count_without_building():
    from gpt2kit.config import GPT2Config
    from gpt2kit.train.build import parameter_count

    for config in (GPT2Config.from_name("gpt2-tiny", n_layer=3, n_embd=48, n_head=3, n_ctx=32),
                   GPT2Config(n_vocab=1000, n_vocab_padded=1024, n_ctx=64, n_embd=32, n_head=4, n_layer=2)):
        assert parameter_count(config) == GPT2(config).num_parameters()


def test_a_model_too_big_for_memory_is_refused_before_allocating(shards, tmp_path, capsys):
    from gpt2kit.cli import main

    out = tmp_path / "huge"
    t0 = time.monotonic()
    code = main(["train", "--data", str(shards), "--out", str(out), "--n-layer", "1000000", "--max-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and time.monotonic() - t0 < 30
    assert re.fullmatch(r"gpt2kit train: error: preset 'gpt2-tiny' n_layer=1000000 has 198\.3B parameters: "
                        r"training needs 2\.9 TiB on cpu for its float32 weights, gradients and AdamW state "
                        r"\(before activations\), but only [\d,.]+ [KMGT]iB is available", err), err
    assert not out.exists()


def test_a_token_outside_the_models_vocabulary_is_found_before_training(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    tokens = np.random.default_rng(0).integers(0, 512, size=4000)
    write_shard(data / "train_000000.bin", tokens)
    tokens[777] = 50300  # e.g. data tokenized with a padded or larger vocabulary
    write_shard(data / "train_000001.bin", tokens)
    with pytest.raises(ValueError, match=r"train_000001\.bin: token 50300 at offset 777 is outside the model's "
                                         r"vocabulary \(n_vocab 50257, ids 0\.\.50256\); this shard holds ids up "
                                         r"to 50300: the data was tokenized for a larger vocabulary"):
        train(_cfg(data, tmp_path / "run", max_steps=2, eval_every=0))
    assert not (tmp_path / "run").exists()


def test_resume_cannot_go_back_and_says_when_there_is_nothing_to_do(shards, tmp_path, capsys):
    from gpt2kit.cli import main

    out = tmp_path / "run"
    train(_cfg(shards, out, max_steps=3, eval_every=0))
    with pytest.raises(ValueError, match=r"--max-steps 2 is below the step .*checkpoint\.pt is at \(3\); a run "
                                         r"cannot go back"):
        train(resume_config(out, max_steps=2))
    capsys.readouterr()
    before = (out / CHECKPOINT_NAME).read_bytes()
    assert main(["train", "--out", str(out), "--resume"]) == 0
    captured = capsys.readouterr()
    assert captured.out == (f"nothing to do: {out} is already at step 3; pass a larger --max-steps with --resume "
                            f"to extend the run\n")
    assert (out / CHECKPOINT_NAME).read_bytes() == before


def test_log_lines_carry_elapsed_time_and_eta_and_evaluations_show_progress(shards, tmp_path, capsys):
    from gpt2kit.train.metrics import Reporter

    train(_cfg(shards, tmp_path / "run", max_steps=4, log_every=2, eval_every=4))
    err = capsys.readouterr().err  # not a terminal: plain lines
    steps = [line for line in err.splitlines() if line.startswith("step ") and "| loss" in line]
    assert [line.split(" ")[1] for line in steps] == ["2/4", "4/4"]
    assert all(re.search(r"\| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$", line) for line in steps), steps
    assert re.search(r"^step 4: val loss \d+\.\d{4} \(2 batches, \d+\.\d s\)$", err, re.M), err

    rep = Reporter(True, 0, 10, log_every=100, heartbeat=0.0)  # heartbeat 0: every step and batch reports
    rep.step({"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0}, 3.0)
    with rep.evaluating(3) as advance:
        for _ in range(3):
            advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("| ETA 0:00:27")  # 3 s per step, 9 steps left
    assert lines[1:] == [f"evaluating: {i}/3 batches, 0:00:00" for i in (1, 2, 3)]


def test_eta_counts_the_evaluations_still_to_come():
    from gpt2kit.train.metrics import eta_seconds, evaluations_left

    assert evaluations_left(0, 300, 50) == 6  # 50, 100, ..., 300 (the last is one of them)
    assert evaluations_left(120, 300, 50) == 4  # 150, 200, 250, 300
    assert evaluations_left(120, 310, 50) == 5  # 150 ... 300 and the last step, 310
    assert evaluations_left(3, 10, 0) == 1  # no periodic evaluations: only the last step's
    # a step's line comes before its own evaluation, which is still to run
    assert evaluations_left(50, 300, 50) == 6  # 50 (next), 100, ..., 300
    assert evaluations_left(300, 310, 50) == 2  # 300 (next) and 310
    assert evaluations_left(10, 10, 5) == 1  # the last step's evaluation, after its line
    assert evaluations_left(10, 10, 0) == 1
    assert evaluations_left(11, 10, 5) == 0
    # 180 steps left at 2 s, 4 evaluations at 30 s
    assert eta_seconds(step=120, total=300, seconds_per_step=2.0, eval_every=50, seconds_per_eval=30.0) == 480.0
    assert eta_seconds(step=120, total=300, seconds_per_step=2.0, eval_every=50, seconds_per_eval=None) == 360.0
    # the last step's line: no step left, its evaluation still to come
    assert eta_seconds(step=300, total=300, seconds_per_step=2.0, eval_every=50, seconds_per_eval=30.0) == 30.0


def test_reporter_eta_estimates_evaluations_from_tokens_then_from_measured_ones(capsys):
    from gpt2kit.train.metrics import Reporter, eta_seconds

    # 300 tokens per evaluation; a step of 300 tokens took 3 s, so an evaluation is estimated at 3 s
    rep = Reporter(True, 0, 10, log_every=100, heartbeat=0.0, eval_every=5, eval_tokens=300)
    rep.step({"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0}, 3.0)
    assert capsys.readouterr().err.rstrip().endswith("| ETA 0:00:33")  # 9 steps x 3 s + 2 evaluations x 3 s
    with rep.evaluating(1) as advance:
        advance()
    assert rep.eta(1) == eta_seconds(step=1, total=10, seconds_per_step=3.0, eval_every=5,
                                     seconds_per_eval=rep.eval_seconds)  # the measured evaluation


def test_loss_plot_tells_train_from_validation_and_draws_lr_and_grad_norm(tmp_path):
    from matplotlib.colors import to_rgba

    from gpt2kit.train.metrics import Metrics

    m = Metrics(tmp_path, None)
    for step in range(1, 21):
        m.log({"step": step, "loss": 5.0 - step / 10, "lr": step * 1e-4, "grad_norm": 1.0 + step % 3,
               "tokens_per_s": 100.0})
        if step % 10 == 0:
            m.log({"step": step, "val_loss": 5.2 - step / 10})
    fig = m.figure("tiny on shards")
    m.close()
    loss_ax, lr_ax, gn_ax = fig.axes
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert {"train", "train (smoothed)", "validation"} <= set(lines)
    assert to_rgba(lines["train (smoothed)"].get_color()) != to_rgba(lines["validation"].get_color())
    legend = loss_ax.get_legend()
    assert legend is not None
    handles = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles, strict=True))
    assert to_rgba(handles["train (smoothed)"].get_color()) != to_rgba(handles["validation"].get_color())
    assert list(lines["validation"].get_xdata()) == [10, 20]
    (lr_line,) = lr_ax.get_lines()
    assert list(lr_line.get_ydata()) == pytest.approx([s * 1e-4 for s in range(1, 21)])
    (gn_line,) = gn_ax.get_lines()
    assert list(gn_line.get_ydata()) == [1.0 + s % 3 for s in range(1, 21)]
    assert lr_ax.get_ylabel() == "lr" and gn_ax.get_ylabel() == "grad norm"
    assert gn_ax.get_xlabel() == "step"


def test_temporaries_of_a_killed_run_are_removed_and_warnings_are_one_line(tmp_path, capsys):
    from gpt2kit.cli import main

    data = tmp_path / "data"  # no validation shards: a warning
    data.mkdir()
    write_shard(data / "train_000000.bin", np.random.default_rng(0).integers(0, 512, size=2000))
    out = tmp_path / "run"
    out.mkdir()
    stale = [out / ".checkpoint.pt.k2j4x_8q.tmp", out / ".model.safetensors.abcdefgh.tmp"]
    for p in stale:
        p.write_bytes(b"half a file")
    mine = out / ".notes.tmp"
    mine.write_text("not ours")
    argv = ["train", "--data", str(data), "--out", str(out), *TINY_FLAGS, "--batch-size", "2", "--seq-len", "32",
            "--max-steps", "1"]
    assert main(argv) == 0
    assert not any(p.exists() for p in stale) and mine.exists()
    err = capsys.readouterr().err
    assert f"gpt2kit train: warning: {data} has no val_*.bin shards: no validation loss will be reported\n" in err
    assert "warnings.warn" not in err and "UserWarning" not in err


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "sgd"], "unknown optimizer 'sgd'; valid choices: adamw, muon"),
    (["--schedule", "linear"], "unknown schedule 'linear'; valid choices: cosine, wsd"),
    (["--sampling", "shuffled"], "unknown sampling 'shuffled'; valid choices: random, sequential"),
    (["--muon-lr", "0"], "TrainConfig.muon_lr must be a number > 0, got 0.0"),
])
def test_cli_bad_training_choices_are_one_line(shards, tmp_path, capsys, flags, message):
    from gpt2kit.cli import main

    assert main(["train", "--data", str(shards), "--out", str(tmp_path / "x"), *TINY_FLAGS, *flags]) == 1
    err = capsys.readouterr().err
    assert err == f"gpt2kit train: error: {message}\n"


def test_cli_muon_on_a_torch_without_it_and_a_non_integer_seed(shards, tmp_path, capsys, monkeypatch):
    from gpt2kit.cli import main

    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    argv = ["train", "--data", str(shards), "--out", str(tmp_path / "x"), *TINY_FLAGS]
    assert main([*argv, "--optimizer", "muon"]) == 1
    err = capsys.readouterr().err
    assert "needs torch.optim.Muon" in err and "--optimizer adamw" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        main([*argv, "--seed", "1.5"])
    assert e.value.code == 2 and "argument --seed: invalid int value: '1.5'" in capsys.readouterr().err
    # without Muon the default falls back to AdamW
    cfg = TrainConfig(data=str(shards), out=str(tmp_path / "y"), **TINY)
    from gpt2kit.train.build import _default_optimizer
    assert cfg.optimizer is None and _default_optimizer() == "adamw"


def test_every_train_setting_is_a_flag_with_its_default_and_in_the_docs(monkeypatch, capsys):
    """The CLI's train flags are TrainConfig's fields: none missing, none restated by hand (read
    through the parser's public face: what it parses and the help it prints)."""
    import dataclasses
    import re

    from gpt2kit.cli import build_parser

    parsed = vars(build_parser().parse_args(["train", "--out", "o"]))  # command, func, debug: the top level's
    monkeypatch.setenv("COLUMNS", "100000")  # one line per option's help: nothing wrapped
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    blocks: dict[str, str] = {}  # --flag -> its help, as printed
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):
            flag = next(w.rstrip(",") for w in line.split() if w.startswith("--"))
            blocks[flag] = line
        elif line.startswith("    ") and blocks:
            blocks[flag] += " " + line.strip()
    table = (Path(__file__).parents[1] / "docs" / "training.md").read_text(encoding="utf-8")
    table = table[table.index("## All options"):]
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        # only given flags override a resumed run's settings
        assert parsed[f.name] == ("o" if f.name == "out" else None)
        assert f.metadata["help"] in blocks[flag]
        if f.default not in (dataclasses.MISSING, None, False):
            assert f"(default: {f.default})" in blocks[flag]
        assert re.search(rf"{flag}(?![\w-])", table), f"{flag} missing from docs/training.md's options table"
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(parsed) - fields - {"command", "func", "debug"} == {"quantize"}
    assert set(blocks) - {"--" + name.replace("_", "-") for name in fields} == {"--help"}  # --quantize: hidden
