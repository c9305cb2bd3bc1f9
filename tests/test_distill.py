"""Distillation (`gpt2kit train --distill-from`): the fused loss with a teacher's probabilities as the
target, against the full logits in float64; TrainingLoss with a teacher; a run end to end, its exact
resume, and the bad inputs.

Tolerances: float32 loss and gradients within 1e-5 relative of the float64 reference (as
test_loss.py); a resumed run's losses within 1e-6 of an uninterrupted one (the exact-resume guarantee).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import random_hf_model, train_one_and_two_ranks

from gpt2kit.config import GPT2Config
from gpt2kit.data import write_shard
from gpt2kit.model import GPT2
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.loop import resume_config, train
from gpt2kit.train.loss import TrainingLoss, fused_linear_cross_entropy


def _reference(hidden, weight, targets, n_vocab, t_hidden, t_weight, share):
    """Mean over non-ignored rows of H(q, softmax(logits)), q = share * p_teacher + (1 - share) * one-hot."""
    logits = hidden.double() @ weight[:n_vocab].double().t()  # (N, V)
    p_t = torch.softmax(t_hidden.double() @ t_weight[:n_vocab].double().t(), -1)  # (N, V)
    valid = targets != -100
    one_hot = F.one_hot(torch.where(valid, targets, 0), n_vocab).double()
    q = share * p_t + (1 - share) * one_hot
    per_row = -(q * torch.log_softmax(logits, -1)).sum(-1)
    return per_row[valid].mean()


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
@pytest.mark.parametrize("share", [1.0, 0.3])
@pytest.mark.parametrize("pad", [0, 13])
def test_soft_targets_match_full_logits(chunk_rows, share, pad):
    torch.manual_seed(0)
    N, C, Ct, V = 40, 16, 24, 97
    hidden, weight = torch.randn(N, C), torch.randn(V + pad, C)
    t_hidden, t_weight = torch.randn(N, Ct), torch.randn(V + 5, Ct) * 0.5  # the teacher's own width and padding
    with torch.no_grad():
        weight[V:] = torch.randn(pad, C) * 5  # padded rows hold junk: it must not leak in
        t_weight[V:] = 50.0
    targets = torch.randint(0, V, (N,))
    targets[2] = targets[30] = -100

    def run(fn, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    ref = run(lambda h, w: _reference(h, w, targets, V, t_hidden, t_weight, share), hidden.double(), weight.double())
    got = run(lambda h, w: fused_linear_cross_entropy(h, w, targets, n_vocab=V, chunk_rows=chunk_rows,
                                                      teacher=(t_hidden, t_weight), teacher_weight=share),
              hidden, weight)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)
    assert torch.all(got[2][V:] == 0)


def test_a_teacher_equal_to_the_model_gives_its_entropy_and_no_gradient():
    """q = the model's own distribution: the loss is its entropy and softmax - q = 0."""
    torch.manual_seed(1)
    h, w = torch.randn(12, 8, requires_grad=True), torch.randn(30, 8)
    loss = fused_linear_cross_entropy(h, w, torch.randint(0, 30, (12,)), teacher=(h.detach(), w))
    p = torch.softmax(h.detach().double() @ w.double().t(), -1)
    assert loss.item() == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-5)
    loss.backward()
    assert h.grad.abs().max().item() < 1e-5


def test_bad_teacher_shapes_and_weights_are_refused():
    h, w, t = torch.randn(4, 8), torch.randn(30, 8), torch.randint(0, 30, (4,))
    with pytest.raises(ValueError, match="teacher hidden"):
        fused_linear_cross_entropy(h, w, t, teacher=(torch.randn(3, 8), w))
    with pytest.raises(ValueError, match="teacher hidden"):
        fused_linear_cross_entropy(h, w, t, teacher=(h, torch.randn(20, 8)))  # a smaller vocabulary
    with pytest.raises(ValueError, match=r"teacher_weight must be in \(0, 1\], got 0"):
        fused_linear_cross_entropy(h, w, t, teacher=(h, w), teacher_weight=0)


def test_training_loss_uses_the_teacher_in_training_only():
    torch.manual_seed(2)
    model = GPT2(GPT2Config(n_vocab=50, n_ctx=16, n_embd=16, n_head=2, n_layer=2))
    teacher = GPT2(GPT2Config(n_vocab=50, n_ctx=16, n_embd=24, n_head=2, n_layer=3, n_vocab_padded=64)).eval()
    idx, targets = torch.randint(0, 50, (2, 10)), torch.randint(0, 50, (2, 10))
    loss_model = TrainingLoss(model, teacher=teacher, teacher_weight=0.5)
    assert not any(n.startswith("_teacher") for n, _ in loss_model.named_parameters())  # only the model's
    assert set(loss_model.state_dict()) == {f"model.{k}" for k in model.state_dict()}
    with torch.no_grad():
        s = model(idx).logits.double().reshape(-1, 50)
        p_t = torch.softmax(teacher(idx).logits.double()[..., :50].reshape(-1, 50), -1)
    q = 0.5 * p_t + 0.5 * F.one_hot(targets.reshape(-1), 50).double()
    want = -(q * torch.log_softmax(s, -1)).sum(-1).mean()
    loss_model.train()
    assert loss_model(idx, targets).item() == pytest.approx(want.item(), rel=1e-5)
    loss_model.eval()  # evaluation: the data's cross-entropy, comparable with runs without a teacher
    assert loss_model(idx, targets).item() == pytest.approx(F.cross_entropy(s, targets.reshape(-1)).item(), rel=1e-5)


# --- runs ------------------------------------------------------------------------------------------

STUDENT = GPT2Config(n_vocab=600, n_ctx=64, n_embd=32, n_head=2, n_layer=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    random_hf_model(STUDENT, seed=3).save_pretrained(root / "student")
    random_hf_model(STUDENT.replace(n_embd=48, n_layer=3), seed=4).save_pretrained(root / "teacher")
    random_hf_model(STUDENT.replace(n_vocab=700), seed=5).save_pretrained(root / "other-vocab")
    random_hf_model(STUDENT.replace(n_ctx=16), seed=6).save_pretrained(root / "short")
    rng = np.random.default_rng(0)
    write_shard(root / "train_000000.bin", rng.integers(0, 512, size=6_000))
    write_shard(root / "val_000000.bin", rng.integers(0, 512, size=2_000))
    return {"root": root, "data": root}


def _cfg(dirs: dict[str, Path], out: Path, **kw) -> TrainConfig:
    settings = dict(data=str(dirs["data"]), model=str(dirs["root"] / "student"), out=str(out), batch_size=2,
                    seq_len=32, max_steps=6, lr=3e-3, eval_every=3, eval_steps=2, save_every=3, log_every=100,
                    optimizer="adamw", distill_from=str(dirs["root"] / "teacher"), distill_dtype="float32")
    return TrainConfig(**(settings | kw))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_distilled_run_moves_the_student_towards_the_teacher_and_resumes_exactly(dirs, tmp_path):
    from gpt2kit.checkpoint import load_model

    full = train(_cfg(dirs, tmp_path / "full"))
    losses = [r["loss"] for r in _records(tmp_path / "full") if "loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert full.val_loss is not None  # evaluation ran (on the data's tokens)

    train(_cfg(dirs, tmp_path / "part", stop_at=3))
    train(resume_config(tmp_path / "part"))
    resumed = [r["loss"] for r in _records(tmp_path / "part") if "loss" in r]
    assert len(resumed) == len(losses)
    assert max(abs(a - b) for a, b in zip(resumed, losses, strict=True)) <= 1e-6

    # The KL to the teacher fell: the student's distribution moved towards the teacher's.
    idx = torch.from_numpy(np.random.default_rng(1).integers(0, 512, (4, 32)))
    teacher = load_model(dirs["root"] / "teacher")

    def kl(model_dir: Path) -> float:
        with torch.no_grad():
            p_t = torch.log_softmax(teacher(idx).logits, -1)
            p_s = torch.log_softmax(load_model(model_dir)(idx).logits, -1)
        return F.kl_div(p_s, p_t, log_target=True, reduction="batchmean").item()

    assert kl(tmp_path / "full") < 0.8 * kl(dirs["root"] / "student")


def test_distilling_a_lora_adapter(dirs, tmp_path):
    train(_cfg(dirs, tmp_path / "lora", lora_rank=4, max_steps=2, eval_every=0, save_every=0))
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()


def test_distilling_with_bf16_autocast_tracks_float32(dirs, tmp_path):
    train(_cfg(dirs, tmp_path / "f32", max_steps=3, eval_every=0, save_every=0))
    train(_cfg(dirs, tmp_path / "bf16", max_steps=3, eval_every=0, save_every=0, dtype="bfloat16"))
    a = [r["loss"] for r in _records(tmp_path / "f32") if "loss" in r]
    b = [r["loss"] for r in _records(tmp_path / "bf16") if "loss" in r]
    assert a != b and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 0.05


def test_distilling_on_two_ranks_matches_one_process(dirs, tmp_path):
    """torchrun, 2 gloo ranks x batch 2 == 1 process x batch 4: each rank's teacher sees its own rows."""
    common = ["--data", str(dirs["data"]), "--model", str(dirs["root"] / "student"), "--seq-len", "32",
              "--max-steps", "3", "--optimizer", "adamw", "--lr", "1e-2", "--total-batch-tokens", "128",
              "--eval-every", "0", "--distill-from", str(dirs["root"] / "teacher"), "--distill-weight", "0.7",
              "--distill-dtype", "float32"]
    train_one_and_two_ranks(common, 4, tmp_path / "one", tmp_path / "two")
    a = [r["loss"] for r in _records(tmp_path / "one") if "loss" in r]
    b = [r["loss"] for r in _records(tmp_path / "two") if "loss" in r]
    assert len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5


@pytest.mark.parametrize("change, message", [
    ({"distill_from": "other-vocab"}, "its vocabulary has 700 tokens, the model's 600"),
    ({"distill_from": "short"}, "its context is 16 tokens, shorter than --seq-len 32"),
])
def test_a_teacher_that_cannot_teach_is_refused_before_training(dirs, tmp_path, change, message):
    cfg = _cfg(dirs, tmp_path / "bad", distill_from=str(dirs["root"] / change["distill_from"]))
    with pytest.raises(ValueError, match=message):
        train(cfg)
    assert not (tmp_path / "bad" / "checkpoint.pt").exists()


def test_bad_distill_settings_are_refused(dirs, tmp_path):
    with pytest.raises(ValueError, match=r"distill_weight must be a number in \(0, 1\], got 1.5"):
        _cfg(dirs, tmp_path, distill_weight=1.5)
    with pytest.raises(ValueError, match="--distill-weight needs --distill-from"):
        _cfg(dirs, tmp_path, distill_from=None, distill_dtype=None, distill_weight=0.5)
    with pytest.raises(ValueError, match="--distill-dtype needs --distill-from"):
        _cfg(dirs, tmp_path, distill_from=None)
    with pytest.raises(ValueError, match="unknown distill dtype 'float16'"):
        _cfg(dirs, tmp_path, distill_dtype="float16")
    with pytest.raises(ValueError, match="--distill-from cannot be combined with --fsdp"):
        _cfg(dirs, tmp_path, fsdp=True)


def test_the_cli_says_one_line_for_a_teacher_with_another_vocabulary(dirs, tmp_path, capsys):
    from gpt2kit.cli import main

    code = main(["train", "--data", str(dirs["data"]), "--model", str(dirs["root"] / "student"), "--out",
                 str(tmp_path / "cli"), "--max-steps", "1", "--seq-len", "32", "--batch-size", "2",
                 "--distill-from", str(dirs["root"] / "other-vocab")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and "its vocabulary has 700 tokens" in err[-1]
