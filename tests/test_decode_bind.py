"""decode.bind: the decode step's tensors resolved once per kernel set and re-bound whenever the model
changes (a module swap, a replaced parameter, load_state_dict, in-place edits), so a kernel set
kept across steps never computes with stale weights; and the Python calls a decoded token costs."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import random_model
from torch import nn

from gpt2kit.config import GPT2Config
from gpt2kit.decode import PLAIN, decode_step, kernels_for
from gpt2kit.kv_cache import KVCache

CFG = GPT2Config(n_vocab=300, n_ctx=32, n_embd=32, n_head=4, n_layer=3)
PACKED = pytest.param(True, id="packed", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                                                  reason="no oneDNN in this torch build"))
KINDS = [pytest.param(False, id="plain"), PACKED]


def _step(model, kernels, B=2):
    """One decode step's logits after a 6-token prefill, and the forward's for the same tokens."""
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, model.config.n_vocab, (B, 7), generator=g)
    caches = [KVCache.for_model(model, B, 7) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            model(idx[:, :6], cache=c)
        want = model(idx[:, 6:], cache=caches[0], last_logits_only=True).logits[:, -1]
        got = decode_step(model, idx[:, 6:], caches[1], None, kernels)
    return got, want


def _check(model, kernels, packed):
    got, want = _step(model, kernels)
    if packed:  # oneDNN's kernels: the same math, float32 rounding apart
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # the plain kernels are the forward's ops on the same values
        assert torch.equal(got, want)


def _kept(model, packed):
    """A kernel set as generation keeps it, used once (so it holds a binding)."""
    kernels = kernels_for(model, 2, pack=packed)
    assert kernels is not None and (kernels is not PLAIN)
    _check(model, kernels, packed)
    return kernels


class Doubled(nn.Module):
    """A swapped-in layer that is not an nn.Linear: the step must call it as a module."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def _new_linear(old: nn.Linear, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(old.in_features, old.out_features)


CHANGES = {
    "module swapped": lambda m: setattr(m.h[0].mlp, "c_fc", _new_linear(m.h[0].mlp.c_fc, 5)),
    "swapped for a non-Linear": lambda m: setattr(m.h[1].attn, "c_proj", Doubled(m.h[1].attn.c_proj)),
    "block replaced": lambda m: m.h.__setitem__(2, copy.deepcopy(m.h[0])),
    "parameter replaced": lambda m: setattr(m.h[1].attn.c_attn, "weight",
                                            nn.Parameter(m.h[1].attn.c_attn.weight.detach() * 1.5)),
    "load_state_dict": lambda m: m.load_state_dict(random_model(CFG, seed=7).state_dict()),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(random_model(CFG, seed=8).state_dict(),
                                                                assign=True),
    "in-place matrix edit": lambda m: m.h[0].attn.c_proj.weight.mul_(2),
    "in-place head edit": lambda m: m.wte.weight.add_(0.5),
    "in-place LayerNorm edit": lambda m: m.ln_f.weight.add_(1.0),
}


@pytest.mark.parametrize("packed", KINDS)
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_kept_kernel_set_sees_every_change_to_the_model(change, packed):
    model = random_model(CFG)
    kernels = _kept(model, packed)
    with torch.no_grad():
        CHANGES[change](model)
    model.eval()
    _check(model, kernels, packed)  # the same kernel set, the new weights


@pytest.mark.parametrize("packed", KINDS)
def test_the_binding_is_kept_until_the_model_changes(packed):
    model = random_model(CFG)
    kernels = _kept(model, packed)
    kv = torch.empty(0)  # a float32 CPU cache's dtype and device

    def bound(m):
        return kernels.bound(m, 2, kv)  # the step's one check

    first = bound(model)
    assert bound(model) is first  # resolved once, not per step
    with torch.no_grad():
        model.h[0].mlp.c_proj.weight.mul_(0.5)
    assert (bound(model) is first) is not packed  # a packed copy is stale after an in-place edit
    model.h[0].mlp.c_proj = _new_linear(model.h[0].mlp.c_proj, 9)
    assert bound(model) is not first
    other = random_model(CFG, seed=4)
    assert bound(other) is not bound(model)  # another model's tensors are never used


# --- Python-level calls per decoded token (cProfile counts: deterministic, no timing) ---------------

def _bench_calls():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_calls.py"
    spec = importlib.util.spec_from_file_location("bench_calls_for_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_decoded_token_costs_few_python_calls():
    # 12 layers as GPT-2 124M (32 wide: the same calls as 768); docs/benchmarks.md, "Python calls per
    # decoded token", has the counts and what they are made of.
    bench = _bench_calls()
    model = bench.build(layers=12, small=True)
    # batch 1 through gpt2kit.generate, a 150-token run less a 50-token run: the step's 12 blocks of
    # 10 calls (2 layer norms, 4 products and the GELU, attention, 2 reshapes) and the engine around them
    assert bench.marginal_calls_per_token(model) <= 220
    settings = bench.sampled_settings(11)
    assert bench.calls_per_token(model, batch=1, tokens=8, settings=settings) <= 260
    # batch 8, sampled: each row's draw checks its distribution is finite and asks its constraints
    # what they ban
    assert bench.calls_per_token(model, batch=8, tokens=8, settings=settings) <= 560


def test_a_batch_1_int8_token_in_c_checks_its_addresses_without_python_calls(monkeypatch):
    """The whole step in C (decode.native_step) is checked once per step, its tensors' addresses in one
    pass: the token costs the engine's calls, not one per tensor."""
    from gpt2kit.decode import int8, native

    if native.step() is None or native.int8_linear() is None:
        pytest.skip(f"the native kernels cannot run here: {native.why_unavailable()}")
    monkeypatch.setenv(int8.ENV, "native-avx2")
    bench = _bench_calls()
    model = bench.build(layers=12, small=True, int8=True)
    assert bench.calls_per_token(model, batch=1, tokens=8) <= 150


def test_the_decode_path_imports_nothing_above_its_floor():
    """decode/ sits below gpt2kit.quant (whose modules call decode.int8) and the engine: the native step
    knows an int8 module by the product it declares (decode.int8.Int8Weights), not by its class."""
    import ast

    import gpt2kit.decode as decode

    allowed = ("gpt2kit.decode", "gpt2kit.model", "gpt2kit.config", "gpt2kit.kv_cache", "gpt2kit.machine",
               "gpt2kit._io")
    for path in Path(decode.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        above = {n for n in names if n.startswith("gpt2kit") and not n.startswith(allowed)}
        assert not above, f"{path.name} imports {sorted(above)}"
