"""Prepacked (oneDNN) weight copies for CPU decode steps: same logits as the plain kernels, packed
only where it applies, refreshed when the weights change, dropped with the model."""

from __future__ import annotations

import copy
import gc
import re
import weakref

import pytest
import torch
from helpers import SMALL, varied_model

from gpt2kit.config import GPT2Config
from gpt2kit.decode import PLAIN, Kernels, decode_step, is_packed
from gpt2kit.decode import packed as pk
from gpt2kit.generation import generate
from gpt2kit.kv_cache import KVCache
from gpt2kit.sampling import SamplingSettings

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")

PADDED = GPT2Config(n_vocab=300, n_vocab_padded=320, n_ctx=32, n_embd=32, n_head=4, n_layer=2)
BF16 = pytest.mark.skipif(not pk.supported(torch.bfloat16, 1), reason="no native bfloat16 on this CPU")


def _steps(model, B, packed, n=4, mask=None):
    """Logits of n decode steps after a 5-token prefill, with or without the packed matrices."""
    torch.manual_seed(1)
    V = model.config.n_vocab
    idx = torch.randint(0, V, (B, 5))
    cache = KVCache.for_model(model, B, 5 + n)
    out = []
    with torch.inference_mode():
        model(idx, cache=cache, attention_mask=None if mask is None else mask[:, :5])
        for i, tok in enumerate(torch.randint(0, V, (n, B, 1))):  # the same tokens for both paths
            m = None if mask is None else mask[:, : 6 + i]
            out.append(decode_step(model, tok, cache, m, Kernels(packed) if packed else PLAIN).float())
    return torch.stack(out)


@pytest.mark.parametrize("cfg", [SMALL, PADDED], ids=["gpt2-vocab", "padded-vocab"])
def test_float32_batch_matches_the_plain_kernels(cfg):
    model = varied_model(cfg)
    packed = pk.packed_weights(model, 3)
    assert packed is not None and packed.hint == 8
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    want, got = _steps(model, 3, None, mask=mask), _steps(model, 3, packed, mask=mask)
    assert got.shape == (4, 3, cfg.n_vocab)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_float32_single_row_keeps_the_plain_kernel():
    model = varied_model()
    assert pk.packed_weights(model, 1) is None  # MKL's mat-vec is faster for one row
    packed = pk.packed_weights(model, 4)
    assert packed.covers(2, torch.float32) and not packed.covers(1, torch.float32)  # a batch finished down to 1


@BF16
def test_bfloat16_single_row_matches_the_plain_kernels():
    model = varied_model().to(torch.bfloat16)
    packed = pk.packed_weights(model, 1)
    assert packed is not None and packed.hint == 1
    got, want = _steps(model, 1, packed), _steps(model, 1, None)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()  # bfloat16 rounding, in other places


def test_off_switches():
    model = varied_model()
    assert pk.packed_weights(model, 4, enabled=False) is None
    assert pk.packed_weights(model.to(torch.float16), 4) is None  # no fast packed half kernels


def test_refreshed_when_weights_change_and_released():
    model = varied_model()
    packed = pk.packed_weights(model, 4)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(2)  # e.g. a training step between two generations
    assert pk.packed_weights(model, 4) is packed  # the same object, refreshed
    torch.testing.assert_close(_steps(model, 2, packed), _steps(model, 2, None), atol=1e-4, rtol=1e-4)
    model.h[1].attn.c_attn.weight.data = model.h[1].attn.c_attn.weight.data.clone()  # new storage
    torch.testing.assert_close(_steps(model, 2, pk.packed_weights(model, 4)), _steps(model, 2, None),
                               atol=1e-4, rtol=1e-4)
    pk.release(model)
    assert not is_packed(model)


def test_a_replaced_parameter_is_repacked_and_a_cast_model_released():
    model = varied_model()
    packed = pk.packed_weights(model, 4)
    old = model.h[0].attn.c_attn.weight
    model.h[0].attn.c_attn.weight = torch.nn.Parameter(old.detach() * 3)  # a new object, new storage
    assert pk.packed_weights(model, 4) is packed and not packed.holds(old)
    torch.testing.assert_close(_steps(model, 2, packed), _steps(model, 2, None), atol=1e-4, rtol=1e-4)
    model.to(torch.float16)
    assert pk.packed_weights(model, 4) is None and not is_packed(model)


def test_dropped_with_the_model_and_deepcopy_still_works():
    model = varied_model()
    packed = pk.packed_weights(model, 4)
    copy.deepcopy(model)  # the packed copies live outside the module
    gone = weakref.ref(packed)
    del model, packed
    gc.collect()
    assert gone() is None


def test_auto_skips_when_the_copy_would_not_fit(monkeypatch):
    model = varied_model()
    pk.release(model)
    monkeypatch.setenv("GPT2KIT_MEM_AVAILABLE", "1000")
    assert pk.packed_weights(model, 4) is None
    assert pk.packed_weights(model, 4, enabled=True) is not None  # asked for explicitly


def test_mem_available_reads_the_override_and_refuses_a_bad_one(monkeypatch):
    from gpt2kit.machine import mem_available

    monkeypatch.delenv("GPT2KIT_MEM_AVAILABLE", raising=False)
    have = mem_available()
    assert have is None or have > 0
    monkeypatch.setenv("GPT2KIT_MEM_AVAILABLE", "12345")
    assert mem_available() == 12345
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv("GPT2KIT_MEM_AVAILABLE", bad)
        with pytest.raises(ValueError, match=rf"GPT2KIT_MEM_AVAILABLE must be a whole number of bytes >= 0, "
                                             rf"got '{re.escape(bad)}'"):
            mem_available()


def test_generate_same_tokens_packed_or_not():
    model = varied_model()
    prompts = [[464, 2068, 7586], [15496], [40, 588, 257, 922, 1110]]
    runs = [generate(model, prompts, SamplingSettings(temperature=0, max_new_tokens=12, stop_token_ids=(),
                                                      pack_weights=flag)) for flag in (False, True)]
    assert [c.tokens for c in runs[0]] == [c.tokens for c in runs[1]]


def test_a_build_that_cannot_pack_falls_back(monkeypatch):
    model = varied_model()
    pk.release(model)

    def cannot(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(pk, "_reorder", cannot)
    assert pk.packed_weights(model, 4) is None and not is_packed(model)


@BF16
def test_a_copy_packed_for_one_hint_serves_the_other_without_packing_again():
    model = varied_model().to(torch.bfloat16)
    one = pk.packed_weights(model, 1)
    assert one is not None and one.hint == 1
    assert pk.packed_weights(model, 8) is one  # a batch after a single row: the same copy, not a new one
    assert pk.packed_weights(model, 1) is one


def test_row_buckets_bound_onednns_shapes_and_keep_each_rows_product():
    """Past EXACT_ROWS, products run on row counts rounded up to an eighth of their power of two (at
    most 12.5% more rows), so prompts and scored texts of every length share a few dozen oneDNN
    shapes; the padded rows are zeros, and each real row's product is the one it gets alone."""
    buckets = {pk.rows_bucket(torch.zeros(r, 1)).shape[0] for r in range(1, 2049)}
    assert len(buckets) == pk.EXACT_ROWS + 8 * 5  # 64 exact, then 8 an octave from 64 to 2,048
    for r in (65, 100, 129, 700, 2047):
        x = torch.randn(r, 3)
        b = pk.rows_bucket(x)
        assert r < b.shape[0] <= 1.125 * r and torch.equal(b[:r], x) and not b[r:].any()
    model = varied_model()
    packed = pk.packed_weights(model, 8)
    block = packed.for_rows(100, torch.float32, True).bind(model).blocks[0]  # as a step of 100 rows runs them
    attn, proj = model.h[0].attn.c_attn, model.h[0].attn.c_proj
    x = torch.randn(100, attn.weight.shape[1])
    want = torch.nn.functional.linear(x, attn.weight, attn.bias)
    got = block.c_attn.fn(x, *block.c_attn.args)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    want = torch.nn.functional.linear(x, proj.weight, proj.bias) + 1  # the residual add, fused
    got = block.attn_c_proj.fn(x, torch.ones_like(want), *block.attn_c_proj.args)
    assert block.attn_c_proj.fused and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
