"""Optimizers (AdamW; Muon for block matrices + AdamW for the rest) and the cosine / WSD schedules."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2kit.config import GPT2Config
from gpt2kit.model import GPT2
from gpt2kit.optim import lr_factor, make_optimizer, muon_parameters


def _model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config(n_vocab=100, n_ctx=16, n_embd=16, n_head=2, n_layer=2))


def test_cosine_warmup_then_half_cosine_to_min():
    kw = dict(schedule="cosine", warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_factor(0, **kw) == pytest.approx(0.1)
    assert lr_factor(9, **kw) == pytest.approx(1.0)
    assert lr_factor(10, **kw) == pytest.approx(1.0)
    assert lr_factor(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert lr_factor(110, **kw) == pytest.approx(0.1)


def test_wsd_flat_then_linear_decay_over_the_last_fraction():
    kw = dict(schedule="wsd", warmup_steps=10, max_steps=110, min_lr_ratio=0.0, decay_fraction=0.4)
    assert lr_factor(4, **kw) == pytest.approx(0.5)
    assert [lr_factor(s, **kw) for s in (10, 50, 70)] == [1.0, 1.0, 1.0]  # decay: 40 steps from step 70
    assert lr_factor(90, **kw) == pytest.approx(0.5)
    assert lr_factor(109, **kw) == pytest.approx(1 / 40)
    assert lr_factor(110, **kw) == 0.0


@pytest.mark.parametrize("kind,value", [("schedule", "linear"), ("optimizer", "sgd")])
def test_unknown_choices_name_the_valid_ones(kind, value):
    with pytest.raises(ValueError, match=rf"unknown {kind} '{value}'; valid choices"):
        if kind == "schedule":
            lr_factor(0, schedule=value, warmup_steps=0, max_steps=1, min_lr_ratio=0)
        else:
            make_optimizer(_model(), value, lr=1e-3, weight_decay=0.1)


def test_muon_takes_the_block_matrices_adamw_the_rest():
    model = _model()
    opt = make_optimizer(model, "muon", lr=1e-3, weight_decay=0.1, muon_lr=0.02)
    muon = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    adamw = {id(p) for g in opt.optimizers["adamw"].param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[i] for i in muon) == sorted(
        f"h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert muon.isdisjoint(adamw) and muon | adamw == set(names)
    assert {names[i] for i in adamw} >= {"wte.weight", "wpe.weight", "ln_f.weight", "h.0.attn.c_attn.bias"}
    assert [p for p in muon_parameters(model)] == [model.get_parameter(names[i]) for i in names if i in muon]


def test_factor_scales_each_groups_own_base_rate_and_state_round_trips():
    model = _model()
    opt = make_optimizer(model, "muon", lr=1e-3, weight_decay=0.1, muon_lr=0.02)
    opt.set_lr_factor(0.5)
    assert sorted({g["lr"] for g in opt.param_groups}) == [5e-4, 0.01]
    x = torch.randint(0, 100, (2, 16))
    model(x, targets=x).loss.backward()
    opt.step()
    state = opt.state_dict()
    assert set(state) == {"muon", "adamw"}
    other = make_optimizer(_model(), "muon", lr=1e-3, weight_decay=0.1, muon_lr=0.02)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="holds"):
        make_optimizer(_model(), "adamw", lr=1e-3, weight_decay=0.1).load_state_dict(state)


def test_muon_update_is_orthogonalised():
    """One Muon step from zero momentum moves a square matrix by lr * (roughly) an orthogonal matrix."""
    model = _model()
    opt = make_optimizer(model, "muon", lr=0.0, weight_decay=0.0, muon_lr=0.1)
    p = model.h[0].attn.c_proj.weight  # (16, 16)
    before = p.detach().clone()
    x = torch.randint(0, 100, (2, 16))
    model(x, targets=x).loss.backward()
    opt.step()
    update = (before - p.detach()) / 0.1  # (16, 16)
    sv = torch.linalg.svdvals(update)
    assert sv.max() < 1.3 and sv.median() > 0.5  # Newton-Schulz pushes singular values towards 1
    assert math.isfinite(float(update.sum()))


def test_muon_missing_is_one_clear_error(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    with pytest.raises(ValueError, match=r"needs torch.optim.Muon.*--optimizer adamw"):
        make_optimizer(_model(), "muon", lr=1e-3, weight_decay=0.1)
