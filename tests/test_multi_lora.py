"""Many LoRA adapters on one base (gpt2kit.lora.enable_multi_lora): each row of a batch runs its own
adapter, or the base, through one batched product; every row equals its adapter merged into the
base (load_model(base, adapter=DIR)) within 1e-4, and base rows equal the plain base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import random_model

from gpt2kit.checkpoint import CheckpointError, load_model, save_adapter, save_model
from gpt2kit.checkpoint.adapter import add_adapter
from gpt2kit.lora import apply_lora, enable_multi_lora, lora_state, merge_lora, unmerge_lora


def make_adapter(path: Path, rank: int, targets: str, seed: int, **kw) -> Path:
    model = apply_lora(random_model(), rank, targets=targets, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in lora_state(model, kw.get("bias", "none")).values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return save_adapter(model, path, bias=kw.get("bias", "none"))


@pytest.fixture
def setup(tmp_path):
    base = save_model(random_model(), tmp_path / "base")
    ads = [make_adapter(tmp_path / "a", 2, "c_attn", 1),
           make_adapter(tmp_path / "b", 4, "c_attn,attn.c_proj,c_fc,mlp.c_proj", 2, alpha=3)]
    return base, ads


def multi(base, ads):
    model = load_model(base)
    enable_multi_lora(model)
    for i, d in enumerate(ads):
        assert add_adapter(model, f"ad{i}", d) == i
    return model


# Two adapters: 2 or more adapted rows run the stacked form, fewer the gathered one (AdapterBank.set_rows).
@pytest.mark.parametrize("index", [[1, -1, 0, 1], [-1, 1, -1, -1], [0]], ids=["stacked", "gathered", "gathered-all"])
def test_each_row_equals_its_adapter_merged_and_base_rows_the_base(setup, index):
    base, ads = setup
    model = multi(base, ads)
    idx = torch.randint(0, 64, (len(index), 9), generator=torch.Generator().manual_seed(3))
    model.adapter_bank.set_rows(index)
    assert (model.adapter_bank.mask is not None) == (sum(i >= 0 for i in index) >= 2)
    merged = {-1: load_model(base), 0: load_model(base, adapter=ads[0]), 1: load_model(base, adapter=ads[1])}
    with torch.no_grad():
        got = model(idx).logits
        for r, a in enumerate(index):
            ref = merged[a](idx[r:r + 1]).logits
            torch.testing.assert_close(got[r:r + 1], ref, atol=1e-4, rtol=0)
            if a >= 0:
                assert (ref - merged[-1](idx[r:r + 1]).logits).abs().max() > 1e-3  # the adapter changes the logits
            else:  # a base row is the plain base on the same batch, exactly
                assert torch.equal(got[r], merged[-1](idx).logits[r])


def test_a_removed_adapter_frees_its_slot_and_the_others_keep_theirs(setup, tmp_path):
    base, ads = setup
    model = multi(base, ads)
    bank = model.adapter_bank
    before = [b for b in model.buffers()]
    bank.remove("ad0")
    assert bank.names == [None, "ad1"] and not any(a is b for a, b in zip(model.buffers(), before, strict=True))
    with pytest.raises(ValueError, match="out of range: 0"):
        bank.set_rows([0])
    idx = torch.arange(6)[None]
    bank.set_rows([1])
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, load_model(base, adapter=ads[1])(idx).logits, atol=1e-4, rtol=0)
    c = make_adapter(tmp_path / "c", 3, "c_fc", 7)
    assert add_adapter(model, "c", c) == 0  # the free slot
    bank.set_rows([0])
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, load_model(base, adapter=c)(idx).logits, atol=1e-4, rtol=0)
    bank.remove("ad1")
    assert bank.names == ["c"]
    with pytest.raises(ValueError, match="no adapter named 'ad1'"):
        bank.remove("ad1")


def test_an_engine_knows_which_adapters_its_rows_run(setup):
    from gpt2kit.engine import Engine
    from gpt2kit.engine.scheduler import runs_adapter
    from gpt2kit.sampling import SamplingSettings

    base, ads = setup
    engine = Engine(multi(base, ads), max_batch=2)
    row = engine.new_row([1, 2, 3], SamplingSettings(max_new_tokens=3, temperature=0, stop_token_ids=()))
    row.adapter = 1
    engine.submit([row])
    seen = [runs_adapter(engine, 1)]
    while engine.has_work:
        engine.step()
        seen.append(runs_adapter(engine, 1))
    assert seen[:-1] == [True] * (len(seen) - 1) and seen[-1] is False and not runs_adapter(engine, 0)


def test_no_index_is_the_base_and_a_bad_index_is_refused(setup):
    base, ads = setup
    model = multi(base, ads)
    idx = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(model(idx).logits, load_model(base)(idx).logits)
    with pytest.raises(ValueError, match="out of range: 2 with 2"):
        model.adapter_bank.set_rows([2])


def test_adapters_that_train_biases_or_do_not_fit_are_refused_and_the_bank_is_unchanged(setup, tmp_path):
    base, ads = setup
    model = multi(base, ads)
    biased = make_adapter(tmp_path / "c", 2, "c_attn", 4, bias="all")
    with pytest.raises(CheckpointError, match="trains biases.*serve it alone"):
        add_adapter(model, "c", biased)
    with pytest.raises(ValueError, match="already loaded"):
        add_adapter(model, "ad0", ads[0])
    assert list(model.adapter_bank.adapters) == ["ad0", "ad1"]


def _adapted(tokens=None):
    base = random_model().eval()
    model = apply_lora(random_model().eval(), 2, targets="c_attn,mlp.c_fc", tokens=tokens)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in lora_state(model).values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return base, model


@pytest.mark.parametrize("tokens", [None, [3, 7, 11]])
def test_disable_adapter_gives_the_base_inside_and_the_adapted_model_after(tokens):
    base, model = _adapted(tokens)
    idx = torch.tensor([[3, 7, 11, 20, 5]])
    with torch.no_grad():
        adapted, plain = model(idx).logits, base(idx).logits
        assert (adapted - plain).abs().max() > 1e-2
        with model.disable_adapter():
            assert torch.equal(model(idx).logits, plain)
        assert torch.equal(model(idx).logits, adapted)


def test_merge_without_unloading_then_unmerge_and_disable_while_merged():
    base, model = _adapted()
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        adapted, plain = model(idx).logits, base(idx).logits
        merge_lora(model, unload=False)
        torch.testing.assert_close(model(idx).logits, adapted, atol=1e-5, rtol=0)
        with model.disable_adapter():  # the update taken out, then merged again
            torch.testing.assert_close(model(idx).logits, plain, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(idx).logits, adapted, atol=1e-5, rtol=0)
        unmerge_lora(model)
        torch.testing.assert_close(model(idx).logits, adapted, atol=1e-5, rtol=0)
        with model.disable_adapter():
            torch.testing.assert_close(model(idx).logits, plain, atol=1e-5, rtol=0)


def test_disable_adapter_turns_off_the_multi_adapter_rows(setup):
    base, ads = setup
    model = multi(base, ads)
    model.adapter_bank.set_rows([0])
    idx = torch.arange(6)[None]
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(idx).logits, load_model(base)(idx).logits)


def _decode(model, prompts, adapters, **kw):
    from gpt2kit.engine import Engine
    from gpt2kit.sampling import SamplingSettings

    engine = Engine(model, **kw)
    settings = SamplingSettings(max_new_tokens=8, temperature=0, stop_token_ids=())
    rows = [engine.new_row(p, settings, logprobs=0) for p in prompts]
    for row, a in zip(rows, adapters, strict=True):
        row.adapter = a
    engine.submit(rows)
    events = []
    while engine.has_work:
        events += engine.step()
    return [([e.token for e in events if e.row is row], [e.logprob for e in events if e.row is row]) for row in rows]


@pytest.mark.parametrize("adapters", [[0, -1, 1, 0], [-1, 1, -1, -1]], ids=["stacked", "gathered"])
@pytest.mark.parametrize("pack", [False, True])
def test_engine_rows_of_different_adapters_decode_together_as_each_served_alone_merged(setup, pack, adapters):
    base, ads = setup
    prompts = [[5, 9, 2, 40, 7], [1, 2, 3, 4, 5, 6, 7], [60, 3, 8], [11, 12, 13, 14, 15, 16]]
    got = _decode(multi(base, ads), prompts, adapters, pack_weights=pack, prefill_chunk=4)
    merged = {-1: load_model(base), 0: load_model(base, adapter=ads[0]), 1: load_model(base, adapter=ads[1])}
    for (tokens, logprobs), p, a in zip(got, prompts, adapters, strict=True):
        [(want_tokens, want_logprobs)] = _decode(merged[a], [p], [-1], pack_weights=pack, prefill_chunk=4)
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
        if a >= 0:  # the adapter does change what is decoded
            [(_, plain)] = _decode(merged[-1], [p], [-1], pack_weights=pack, prefill_chunk=4)
            assert (torch.tensor(logprobs) - torch.tensor(plain)).abs().max() > 1e-3
