"""decode/layout.py: the decode layout keeps every value, and large matrices move onto huge-page
mappings of their own (values, strides and the tied head kept; a replaced matrix frees its mapping;
GPT2KIT_HUGE_PAGES=0 leaves them where they are)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import random_model

from gpt2kit import GPT2Config
from gpt2kit.decode import layout, use_decode_layout
from gpt2kit.quant.modules import quantize_model

CFG = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_ctx=64, n_vocab=4096)  # wte 4 MiB, c_fc 1 MiB


@pytest.fixture(autouse=True)
def _huge_pages_here():
    if not layout.huge_pages_available():
        pytest.skip("no transparent huge pages here (not Linux, THP 'never', or GPT2KIT_HUGE_PAGES=0)")


def test_large_matrices_move_with_values_strides_and_tying_kept():
    m = random_model(CFG)
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    use_decode_layout(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert layout.is_on_huge_pages(m.wte.weight)  # 4 MiB
    assert m.wte.weight.stride() == (1, CFG.n_vocab)  # the decode layout: (in, out) storage
    assert m.wte.weight.data_ptr() % (2 << 20) == 0  # starts on a huge page
    assert not layout.is_on_huge_pages(m.h[0].mlp.c_fc.weight)  # 1 MiB: below HUGE_MIN_BYTES
    assert not layout.is_on_huge_pages(m.wpe.weight)
    logits = m(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    use_decode_layout(m)  # again: nothing moves
    assert m.wte.weight.data_ptr() % (2 << 20) == 0


def test_a_buffer_weight_of_an_int8_model_moves_and_a_replaced_matrix_is_freed():
    m = use_decode_layout(random_model(CFG))
    float_ptr = m.wte.weight.untyped_storage().data_ptr()
    assert float_ptr in layout._MAPS
    quantize_model(m)  # wte becomes int8 rows (4096 x 256 = 1 MiB) and the float table goes
    gc.collect()
    assert float_ptr not in layout._MAPS  # its mapping was released with it


def test_the_switch_leaves_matrices_where_they_are(monkeypatch):
    monkeypatch.setenv("GPT2KIT_HUGE_PAGES", "0")
    assert not layout.huge_pages_available()
    m = use_decode_layout(random_model(CFG))
    assert not layout.is_on_huge_pages(m.wte.weight)


def test_on_huge_pages_copies_any_layout():
    for t in (torch.randn(700, 900), torch.randn(900, 700).t(), torch.randn(600, 1000)[:, ::2],
              torch.randint(-127, 128, (2048, 1100), dtype=torch.int8)):
        got = layout.on_huge_pages(t)
        assert torch.equal(got, t) and got.dtype == t.dtype and layout.is_on_huge_pages(got)
        if t.stride() == (1, t.shape[0]) or t.is_contiguous():
            assert got.stride() == t.stride()
