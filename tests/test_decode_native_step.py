"""The batch-1 decode step in one native call (decode/native_step.py, csrc/step.c): the Python step's
logits and cache to float32 round-off, float32 and int8, over many positions; the same greedy
tokens; used only where every product is on a native kernel and the row is alone and unmasked;
rebuilt when a tensor moves; GPT2KIT_NATIVE_STEP=0 turns it off."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model

from gpt2kit import GPT2Config
from gpt2kit.decode import decode_step, f32, int8, kernels_for, native, native_step, use_decode_layout
from gpt2kit.generation import SamplingSettings, generate
from gpt2kit.kv_cache import KVCache
from gpt2kit.quant.modules import quantize_model, set_activations

CFG = GPT2Config(n_layer=3, n_embd=128, n_head=2, n_ctx=96)
F32_NATIVE = [k for k in f32.KERNELS if k != "torch"]


@pytest.fixture(autouse=True)
def _native_here():
    if native.step() is None or native.f32_linear() is None or native.int8_linear() is None:
        pytest.skip(f"the native kernels cannot run here: {native.why_unavailable()}")


def _f32_kernel(monkeypatch, kernel: str) -> None:
    why = native.why_f32_unavailable(kernel.removeprefix("native-"))
    if why is not None:
        pytest.skip(f"{kernel} cannot run here: {why}")
    monkeypatch.setenv(f32.ENV, kernel)
    f32.forget()


def _model(cfg: GPT2Config = CFG, scale: float = 3.0):
    m = random_model(cfg, seed=1)
    with torch.no_grad():  # larger activations than the init's, as a trained model has
        for name, p in m.named_parameters():
            if p.dim() == 2 and name != "wpe.weight":
                p.mul_(scale)
    return use_decode_layout(m)


def _native_calls() -> int:
    stats = native.solo_stats("step")
    return 0 if stats is None else stats["calls"]


def _steps(model, ids: torch.Tensor, monkeypatch, on: bool) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setenv(native_step.ENV, "1" if on else "0")
    ks = kernels_for(model, 1)
    cache = KVCache.for_model(model, 1, ids.shape[0])
    logits = torch.cat([decode_step(model, ids[i:i + 1][None], cache, None, ks) for i in range(ids.shape[0])])
    return logits, cache.kv[:, :, :, :, :cache.length].clone()


def _ids(n: int, vocab: int = 50257) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("kernel", F32_NATIVE)
def test_float32_logits_and_cache_equal_the_python_step(kernel, monkeypatch):
    _f32_kernel(monkeypatch, kernel)
    m, ids = _model(), _ids(90)
    before = _native_calls()
    ref, ref_kv = _steps(m, ids, monkeypatch, on=False)
    assert _native_calls() == before  # off: the Python step ran
    got, got_kv = _steps(m, ids, monkeypatch, on=True)
    assert _native_calls() > before  # on: the native step ran
    assert got.shape == ref.shape == (90, CFG.n_vocab)
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert (got_kv - ref_kv).abs().max().item() <= 1e-5 * max(1.0, ref_kv.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_int8_logits_and_cache_equal_the_python_step(monkeypatch):
    monkeypatch.setenv(int8.ENV, "native-avx2")
    m = quantize_model(_model())
    ids = _ids(90)
    before = _native_calls()
    ref, ref_kv = _steps(m, ids, monkeypatch, on=False)
    got, got_kv = _steps(m, ids, monkeypatch, on=True)
    assert _native_calls() > before
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert (got_kv - ref_kv).abs().max().item() <= 1e-5 * max(1.0, ref_kv.abs().max().item())


def test_greedy_generation_gives_the_same_tokens(monkeypatch):
    _f32_kernel(monkeypatch, "native-avx2")
    m = _model()
    settings = SamplingSettings(temperature=0, max_new_tokens=60, stop_token_ids=())
    out = {}
    for on in ("0", "1"):
        monkeypatch.setenv(native_step.ENV, on)
        out[on] = [c.tokens for c in generate(m, [[5, 6, 7, 8]], settings)]
    assert out["0"] == out["1"]


def test_a_padded_vocabulary_is_cut_to_n_vocab(monkeypatch):
    _f32_kernel(monkeypatch, "native-avx2")
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_ctx=32, n_vocab=1000, n_vocab_padded=1024)
    m, ids = _model(cfg), _ids(20, 1000)
    ref, _ = _steps(m, ids, monkeypatch, on=False)
    got, _ = _steps(m, ids, monkeypatch, on=True)
    assert got.shape == ref.shape == (20, 1000)
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_not_used_where_a_product_is_not_native(monkeypatch):
    m, ids = _model(), _ids(8)
    monkeypatch.setenv(f32.ENV, "torch")
    f32.forget()
    before = _native_calls()
    _steps(m, ids, monkeypatch, on=True)  # float32 on torch's products
    q = quantize_model(_model())
    set_activations(q, "int8")
    _steps(q, ids, monkeypatch, on=True)  # int8 activations
    assert _native_calls() == before


def test_not_used_for_batches_masks_or_the_shared_plain_set(monkeypatch):
    _f32_kernel(monkeypatch, "native-avx2")
    monkeypatch.setenv(native_step.ENV, "1")
    m = _model()
    before = _native_calls()
    ks = kernels_for(m, 2)
    cache = KVCache.for_model(m, 2, 4)
    decode_step(m, torch.tensor([[1], [2]]), cache, None, ks)  # two rows
    cache = KVCache.for_model(m, 1, 4)
    decode_step(m, torch.tensor([[1]]), cache, torch.ones(1, 1, dtype=torch.long), kernels_for(m, 1))  # a mask
    decode_step(m, torch.tensor([[1]]), KVCache.for_model(m, 1, 4))  # PLAIN: binds every call
    assert _native_calls() == before


def test_a_moved_parameter_rebuilds_the_step(monkeypatch):
    _f32_kernel(monkeypatch, "native-avx2")
    monkeypatch.setenv(native_step.ENV, "1")
    m, ids = _model(), _ids(6)
    ks = kernels_for(m, 1)
    cache = KVCache.for_model(m, 1, 12)
    for i in range(3):
        decode_step(m, ids[i:i + 1][None], cache, None, ks)
    first = ks.native
    assert ks.kind == "native"
    with torch.no_grad():
        w = m.h[0].mlp.c_fc.weight
        w.data = (w.data * 0.5).t().contiguous().t()  # new memory, same layout: a .data assignment
    got = decode_step(m, ids[3:4][None], cache, None, ks)
    second = ks.native
    assert second is not first and second is not None
    monkeypatch.setenv(native_step.ENV, "0")  # read when a path is chosen
    cache.length = 3
    ref = decode_step(m, ids[3:4][None], cache, None, kernels_for(m, 1))
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_an_engine_step_that_writes_elsewhere_too_keeps_the_python_step(monkeypatch):
    from gpt2kit.engine.batch_cache import StepCache

    _f32_kernel(monkeypatch, "native-avx2")
    monkeypatch.setenv(native_step.ENV, "1")
    m = _model()
    ks = kernels_for(m, 1)
    kv = KVCache.for_model(m, 1, 8).kv
    home = (torch.tensor([0]), torch.tensor([1]))  # a shorter row: its own column too
    before = _native_calls()
    decode_step(m, torch.tensor([[3]]), StepCache(kv, 2, None, home), None, ks)
    assert _native_calls() == before
    decode_step(m, torch.tensor([[3]]), StepCache(kv, 2, None, None), None, ks)  # plain: native
    assert _native_calls() > before
