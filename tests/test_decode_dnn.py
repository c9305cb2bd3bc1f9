"""A prompt's prefill on the flat loop (decode.path.prompt_kernels): oneDNN's fused products of many
float32 rows (decode/dnn.py) and the last block at each row's last position alone give the forward's
logits and cache to float32 round-off and the same greedy tokens; the C kernel for small float32
batches (decode.f32.decide_few) gives the forward's steps; the overrides are one clear line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_model

from gpt2kit.config import GPT2Config
from gpt2kit.decode import (
    FORWARD,
    decode_step,
    decode_tokens,
    dnn,
    f32,
    kernel_choice,
    kernels_for,
    native,
    prefill,
    use_decode_layout,
)
from gpt2kit.decode import path as decode_path
from gpt2kit.kv_cache import KVCache

# More than plain.FEW_ROWS rows a prompt, so its products run on the prompt kernel.
CFG = GPT2Config(n_vocab=300, n_ctx=96, n_embd=64, n_head=4, n_layer=3)
ONEDNN = pytest.param("onednn", marks=pytest.mark.skipif(not dnn.available(), reason="no oneDNN linear here"))


@pytest.fixture
def model():
    return random_model(CFG, seed=4)


def _forward(model, idx, mask=None):
    cache = KVCache.for_model(model, idx.shape[0], idx.shape[1] + 8)
    with torch.inference_mode():
        logits = model(idx, attention_mask=mask, cache=cache).logits  # (B, T, V)
    return logits, cache


@pytest.mark.parametrize("kernel", ["torch", ONEDNN])
def test_prefill_is_the_forward_to_round_off(kernel, model, monkeypatch):
    monkeypatch.setenv(dnn.ENV, kernel)
    idx = torch.randint(0, CFG.n_vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    assert not decode_path.prompt_kernels(model).forward  # the flat loop, not the forward
    want, ref_cache = _forward(model, idx)
    cache = KVCache.for_model(model, 2, 48)
    got = prefill(model, idx, None, cache)  # (B, V)
    torch.testing.assert_close(got, want[:, -1], rtol=1e-4, atol=1e-4)
    assert cache.length == 40
    torch.testing.assert_close(cache.kv[..., :40, :], ref_cache.kv[..., :40, :], rtol=1e-4, atol=1e-4)
    # and the decode after it: the same greedy tokens as after the forward's prefill
    toks = {}
    for name, c, logits in (("flat", cache, got), ("forward", ref_cache, want[:, -1])):
        out = []
        for _ in range(6):
            tok = logits.argmax(-1, keepdim=True)  # (B, 1)
            out.append(tok)
            logits = decode_step(model, tok, c, kernels=FORWARD)
        toks[name] = torch.cat(out, 1)
    assert torch.equal(toks["flat"], toks["forward"])


@pytest.mark.parametrize("kernel", ["torch", ONEDNN])
def test_a_left_padded_prompt_and_rows_of_different_lengths(kernel, model, monkeypatch):
    monkeypatch.setenv(dnn.ENV, kernel)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, CFG.n_vocab, (2, 30), generator=g)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0  # row 1 left-padded
    want, _ = _forward(model, idx, mask)
    got = prefill(model, idx, mask, KVCache.for_model(model, 2, 38))
    torch.testing.assert_close(got, want[:, -1], rtol=1e-4, atol=1e-4)
    # rows of different lengths after 5 cached tokens: each row's logits at its own last token
    head = torch.randint(0, CFG.n_vocab, (2, 5), generator=g)
    last = [24, 11]
    full, _ = _forward(model, torch.cat([head, idx], 1))
    cache = KVCache.for_model(model, 2, 40)
    prefill(model, head, None, cache)
    got = decode_tokens(model, idx, cache, None, decode_path.prompt_kernels(model), last=last)  # (B, V)
    torch.testing.assert_close(got, torch.stack([full[b, 5 + n] for b, n in enumerate(last)]), rtol=1e-4, atol=1e-4)


def test_a_model_with_hooks_or_in_training_prefills_on_its_forward(model):
    handle = model.h[0].register_forward_hook(lambda *a: None)
    assert decode_path.prompt_kernels(model) is FORWARD
    handle.remove()
    assert decode_path.prompt_kernels(model.train()) is FORWARD


def test_the_override_is_checked(model, monkeypatch):
    monkeypatch.setenv(dnn.ENV, "mkl")
    with pytest.raises(ValueError, match="GPT2KIT_PROMPT_KERNEL='mkl' is not a prompt kernel; valid choices: torch"):
        prefill(model, torch.tensor([[1, 2, 3]]), None, KVCache.for_model(model, 1, 3))


def test_the_measurement_keeps_the_default_unless_clearly_beaten(model, monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_choice.STORE_ENV, str(tmp_path))
    monkeypatch.delenv(dnn.ENV, raising=False)
    fc = model.h[0].mlp.c_fc
    monkeypatch.setenv(kernel_choice.TIMINGS_ENV, '{"torch": [1.0, 1.0, 1.0, 1.0], "onednn": [0.5, 0.5, 0.5, 0.5]}')
    choice = dnn.choose(fc.weight, fc.bias, fresh=True)
    assert (choice.kernel, choice.source) == ("onednn" if dnn.available() else "torch", "measured")
    monkeypatch.setenv(kernel_choice.TIMINGS_ENV, '{"torch": [1.0, 1.0, 1.0, 1.0], "onednn": [0.95, 0.95, 0.95, 0.95]}')
    assert dnn.choose(fc.weight, fc.bias, fresh=True).kernel == dnn.default_kernel()
    kernel_choice.REGISTRY.forget("prompt")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("kernel", [k for k in f32.KERNELS if k != "torch"])
def test_a_small_float32_batch_on_the_c_kernel_is_the_forward(kernel, model):
    why = native.why_f32_unavailable(kernel.removeprefix("native-"))
    if why is not None:
        pytest.skip(f"{kernel} cannot run here: {why}")
    use_decode_layout(model)
    ks = kernels_for(model, 4, pack=True)
    ks.kernel_set.use_few(kernel)
    assert ks.kernel_set.for_rows(4, torch.float32, True).product is not torch.nn.functional.linear
    idx = torch.randint(0, CFG.n_vocab, (4, 9), generator=torch.Generator().manual_seed(3))
    want, _ = _forward(model, idx)
    cache = KVCache.for_model(model, 4, 9)
    prefill(model, idx[:, :6], None, cache, FORWARD)
    for t in range(6, 9):
        got = decode_step(model, idx[:, t:t + 1], cache, kernels=ks)
        torch.testing.assert_close(got, want[:, t], rtol=1e-4, atol=1e-4)


def test_few_rows_measured_choice_and_its_check(model, monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_choice.STORE_ENV, str(tmp_path))
    ks = kernels_for(model, 4, pack=True)
    if not isinstance(ks.kernel_set, decode_path.PackedWeights):
        pytest.skip("no packed copies here")
    mats = decode_path._f32_matrices(model) or [(model.h[0].mlp.c_fc.weight, model.h[0].mlp.c_fc.bias)]
    natives = [k for k in f32.KERNELS[1:] if native.why_f32_unavailable(k.removeprefix("native-")) is None]
    if not natives:
        pytest.skip("no C kernel here")
    fast = {"packed": [1.0] * 4, **{k: [0.5] * 4 for k in natives}}
    monkeypatch.setenv(kernel_choice.TIMINGS_ENV, json.dumps(fast))
    choice = f32.decide_few("t", mats, ks.kernel_set.matrix, fresh=True)
    assert choice.source == "measured" and choice.kernel in natives
    monkeypatch.setenv(kernel_choice.TIMINGS_ENV, json.dumps({k: [0.97] * 4 for k in natives} | {"packed": [1.0] * 4}))
    default = f32.FEW_DEFAULTS[kernel_choice.family()]
    assert f32.decide_few("t", mats, ks.kernel_set.matrix, fresh=True).kernel == default
    kernel_choice.REGISTRY.forget("f32-few")
