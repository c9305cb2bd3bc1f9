"""fused_linear_cross_entropy and TrainingLoss against F.cross_entropy on full logits (float64 reference).

Tolerances: float32 loss and gradients within 1e-5 relative of the float64 reference; bfloat16
autocast within 2e-2 (the products are rounded to 8 bits of mantissa).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpt2kit.config import GPT2Config
from gpt2kit.model import GPT2
from gpt2kit.train.loss import TrainingLoss, fused_linear_cross_entropy


def _reference(hidden, weight, targets, n_vocab, ignore_index=-100):
    logits = hidden.double() @ weight[:n_vocab].double().t()  # (N, V)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)


def _grads(fn, hidden, weight):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("pad", [0, 13])
def test_matches_full_logits_loss_and_gradients(chunk_rows, pad):
    torch.manual_seed(0)
    N, C, V = 50, 16, 97
    hidden = torch.randn(N, C)
    weight = torch.randn(V + pad, C)
    with torch.no_grad():
        weight[V:] = torch.randn(pad, C) * 5  # padded rows hold junk: it must not leak into the loss
    targets = torch.randint(0, V, (N,))
    targets[3] = targets[17] = -100
    ref = _grads(lambda h, w: _reference(h, w, targets, V), hidden.double(), weight.double())
    got = _grads(lambda h, w: fused_linear_cross_entropy(h, w, targets, n_vocab=V, chunk_rows=chunk_rows),
                 hidden, weight)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)
    assert torch.all(got[2][V:] == 0)  # padded rows get no gradient


def test_scaled_backward_and_no_grad():
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(2, 5, 8), torch.randn(40, 8), torch.randint(0, 40, (2, 5))
    h = hidden.clone().requires_grad_()
    (fused_linear_cross_entropy(h, weight, targets, chunk_rows=3) * 0.25).backward()
    h_ref = hidden.clone().requires_grad_()
    (_reference(h_ref.reshape(-1, 8), weight, targets.reshape(-1), 40) * 0.25).backward()
    torch.testing.assert_close(h.grad.double(), h_ref.grad.double(), rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, targets)
    assert loss.item() == pytest.approx(_reference(hidden.reshape(-1, 8), weight, targets.reshape(-1), 40).item(),
                                        rel=1e-6)


def test_bad_shapes_are_value_errors():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(h, torch.randn(10, 9), t)
    with pytest.raises(ValueError, match="targets shape"):
        fused_linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="n_vocab"):
        fused_linear_cross_entropy(h, w, t, n_vocab=11)


@pytest.mark.parametrize("padded", [None, 1024])
def test_training_loss_equals_the_models_own_loss(padded):
    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=1000, n_ctx=32, n_embd=32, n_head=4, n_layer=2, n_vocab_padded=padded)
    model = GPT2(cfg)
    idx, targets = torch.randint(0, 1000, (3, 32)), torch.randint(0, 1000, (3, 32))
    ref = model(idx, targets=targets).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = TrainingLoss(model, chunk_rows=40)(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_bf16_autocast_close_to_float32():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=1000, n_ctx=32, n_embd=32, n_head=4, n_layer=2))
    idx, targets = torch.randint(0, 1000, (2, 32)), torch.randint(0, 1000, (2, 32))
    f32 = TrainingLoss(model)(idx, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = TrainingLoss(model)(idx, targets)
    bf16.backward()
    assert bf16.dtype == torch.float32
    assert bf16.item() == pytest.approx(f32.item(), rel=2e-2)
    assert model.wte.weight.grad.dtype == torch.float32
