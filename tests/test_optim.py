"""Optimizers (AdamW; Muon for block matrices + AdamW for the rest) and the cosine / WSD schedules."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2kit.config import GPT2Config
from gpt2kit.model import GPT2
from gpt2kit.train.optim import (
    Muon,
    lr_factor,
    make_optimizer,
    muon_parameters,
    newton_schulz_dtype,
    zeropower_via_newtonschulz,
)


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
    assert lr_factor(500, **kw) == pytest.approx(0.1)  # past the end: the floor
    factors = [lr_factor(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(factors, factors[1:], strict=False))
    assert lr_factor(0, schedule="cosine", warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == 1.0  # no warmup


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


needs_muon = pytest.mark.skipif(Muon is None, reason="this torch has no torch.optim.Muon")
NS = dict(ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7)


def _reference_muon(param: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float) -> torch.Tensor:
    """torch.optim.Muon's update written out in float64 (momentum 0.95, Nesterov, 5 quintic
    Newton-Schulz iterations, decoupled decay, sqrt(max(1, out/in)) scaling): the exact iteration."""
    a, b, c = NS["ns_coefficients"]
    p = param.double().clone()
    buf = torch.zeros_like(p)
    for g in grads:
        g = g.double()
        buf = buf + 0.05 * (g - buf)  # lerp(g, 1 - 0.95)
        x = g + 0.95 * (buf - g)  # Nesterov: lerp(g, buf, 0.95)
        tall = x.size(0) > x.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=NS["eps"])
        for _ in range(NS["ns_steps"]):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if tall else x
        p = p * (1 - lr * wd) - lr * math.sqrt(max(1, p.size(0) / p.size(1))) * x
    return p


@needs_muon
@pytest.mark.parametrize("shape", [(48, 16), (16, 40)])  # tall (orthogonalised transposed) and wide
def test_float32_muon_is_torchs_update_up_to_the_dtype(shape):
    """Muon(ns_dtype=float32) against the float64 iteration: 4 steps within 1e-5 relative to the
    step size. torch's own (bfloat16) Muon is ~1e-2 off the same reference, so the tolerance tells
    the dtypes apart, and a wrong coefficient, transpose or scaling would be far outside it."""
    torch.manual_seed(0)
    w0 = torch.randn(shape) * 0.1
    grads = [torch.randn(shape) for _ in range(4)]
    lr, wd = 0.02, 0.1
    ref = _reference_muon(w0, grads, lr, wd)

    def run(opt_cls, **kw):
        p = torch.nn.Parameter(w0.clone())
        opt = opt_cls([p], lr=lr, weight_decay=wd, momentum=0.95, nesterov=True, adjust_lr_fn="original", **kw)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach(), opt

    ours, opt = run(Muon, ns_dtype=torch.float32)
    theirs, _ = run(torch.optim.Muon)
    scale = (ref - w0.double()).abs().max()  # the total movement
    assert ((ours.double() - ref).abs().max() / scale) < 1e-5
    assert ((theirs.double() - ref).abs().max() / scale) > 1e-3  # bfloat16 rounding, visible at this tolerance
    # the state is torch's: it loads into torch.optim.Muon and back
    p2 = torch.nn.Parameter(w0.clone())
    torch_opt = torch.optim.Muon([p2], lr=lr, weight_decay=wd, adjust_lr_fn="original")
    torch_opt.load_state_dict(opt.state_dict())
    assert torch.equal(torch_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])
    assert torch_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


@needs_muon
def test_bfloat16_newton_schulz_is_torchs_bit_for_bit():
    """zeropower_via_newtonschulz(dtype=bfloat16) is torch's private function, operation for operation."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(1)
    for shape in [(48, 16), (16, 40), (32, 32)]:
        g = torch.randn(shape)
        assert torch.equal(zeropower_via_newtonschulz(g, dtype=torch.bfloat16, **NS),
                           _zeropower_via_newtonschulz(g, **NS))


@pytest.mark.parametrize("native", [False, True])
def test_newton_schulz_dtype_follows_the_runs_dtype_then_the_machine(monkeypatch, native):
    """A float32 run orthogonalises in float32 on every machine (with native bfloat16 too, where it
    once took torch's bfloat16); a bfloat16 run in bfloat16 off-CPU and on CPUs with native
    bfloat16, float32 on the others. make_optimizer's own default is float32."""
    import gpt2kit.train.optim

    monkeypatch.setattr(gpt2kit.train.optim, "cpu_has_native_bfloat16", lambda: native)
    assert newton_schulz_dtype("float32", "cpu") == torch.float32
    assert newton_schulz_dtype(torch.float32, "meta") == torch.float32
    assert newton_schulz_dtype("bf16", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert newton_schulz_dtype(torch.bfloat16, "meta") == torch.bfloat16
    if Muon is not None:
        assert make_optimizer(_model(), "muon", lr=1e-3, weight_decay=0.1).optimizers["muon"].ns_dtype == torch.float32
        opt = make_optimizer(_model(), "muon", lr=1e-3, weight_decay=0.1, muon_dtype="bfloat16")
        assert opt.optimizers["muon"].ns_dtype == torch.bfloat16
        with pytest.raises(ValueError, match="muon_dtype must be float32 or bfloat16, got 'float16'"):
            make_optimizer(_model(), "muon", lr=1e-3, weight_decay=0.1, muon_dtype="float16")
