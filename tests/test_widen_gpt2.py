"""benchmarks/widen_gpt2.py: the widened model computes the original's function (it is how the
speculative-decoding benchmark gets a target of GPT-2 124M's shape from one trained here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import varied_model

from gpt2kit.checkpoint import load_model, save_model
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "widen_gpt2.py"


@pytest.fixture(scope="module")
def widen_mod():
    spec = importlib.util.spec_from_file_location("widen_gpt2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["widen_gpt2"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_widened_model_gives_the_same_logits_and_greedy_tokens(widen_mod, tmp_path):
    small = varied_model()
    wide = widen_mod.widen(small)
    c, w = small.config, wide.config
    assert (w.n_embd, w.n_head, w.head_dim, w.n_layer) == (2 * c.n_embd, 2 * c.n_head, c.head_dim, c.n_layer)
    assert wide.num_parameters() > 2 * small.num_parameters()
    idx = torch.randint(0, c.n_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(idx).logits, wide(idx).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    save_model(wide, tmp_path / "wide")  # through the checkpoint format and gpt2kit's decode path
    again = load_model(tmp_path / "wide")
    s = SamplingSettings(max_new_tokens=16, temperature=0, stop_token_ids=())
    assert generate(again, [[1, 2, 3]], s)[0].tokens == generate(small, [[1, 2, 3]], s)[0].tokens


def test_noise_makes_the_copies_differ_and_moves_the_logits_a_little(widen_mod):
    small = varied_model()
    wide = widen_mod.widen(small, noise=1e-4, seed=1)
    q = wide.h[0].attn.c_attn.weight
    C = small.config.n_embd
    assert not torch.equal(q[:C], q[C:2 * C])  # the two copies of the heads differ
    idx = torch.arange(12)[None]
    with torch.no_grad():
        gap = (wide(idx).logits - small(idx).logits).abs().max().item()
    assert 1e-5 < gap < 0.5
