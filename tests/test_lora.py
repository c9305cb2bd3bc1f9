"""LoRA: the module swap, peft's adapter format both ways, merging, and bad input.

peft is the reference: an adapter gpt2kit writes loads in peft.PeftModel on transformers' GPT-2
with the same logits (1e-4), an adapter peft writes loads in gpt2kit with the same logits (1e-4),
and a merged model equals the unmerged one (1e-5). Models are tiny random ones (tests/helpers.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY, random_model, saved_hf_base

from gpt2kit.checkpoint import CheckpointError, apply_adapter, load_model, read_adapter, save_adapter, save_model
from gpt2kit.config import GPT2Config
from gpt2kit.lora import LoRALinear, apply_lora, lora_state, merge_lora, parse_targets

peft = pytest.importorskip("peft")

ALL = "c_attn,attn.c_proj,c_fc,mlp.c_proj"


def _randomise_adapter(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in lora_state(model).values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)


def _ids(n: int = 24) -> torch.Tensor:
    return torch.randint(0, TINY.n_vocab, (2, n), generator=torch.Generator().manual_seed(5))



def test_a_fresh_adapter_changes_nothing_and_only_it_trains():
    model = random_model()
    ids = _ids()
    before = model(ids).logits
    apply_lora(model, 4, 8, targets=ALL)
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)  # lora_B starts at zero
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(trainable) == 2 * 4 * TINY.n_layer
    assert "h.0.attn.c_attn.weight" in model.state_dict()  # the base's names do not move


def test_hooks_see_the_swapped_module():
    model = apply_lora(random_model(), 2, targets="c_fc")
    seen = []
    model.h[1].mlp.c_fc.register_forward_hook(lambda m, a, o: seen.append(type(m)))
    model(_ids())
    assert seen == [LoRALinear]


def test_our_adapter_loads_in_peft_with_the_same_logits(tmp_path):
    from transformers import GPT2LMHeadModel

    base = saved_hf_base(tmp_path)
    model = apply_lora(load_model(base), 4, 16, targets=ALL)
    _randomise_adapter(model)
    save_adapter(model, tmp_path / "adapter", base=str(base))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["fan_in_fan_out"] is True and cfg["peft_type"] == "LORA" and cfg["r"] == 4
    hf = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), tmp_path / "adapter").eval()
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    plain = GPT2LMHeadModel.from_pretrained(base).eval()
    with torch.no_grad():
        assert (plain(ids).logits - theirs).abs().max() > 1e-3  # the adapter really changed the model


def test_a_peft_adapter_loads_in_gpt2kit_with_the_same_logits(tmp_path):
    from transformers import GPT2LMHeadModel

    base = saved_hf_base(tmp_path)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                          task_type="CAUSAL_LM", rank_pattern={"h.1.attn.c_attn": 2}, use_rslora=True)
    torch.manual_seed(3)
    pm = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(base), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    pm.save_pretrained(tmp_path / "peft_adapter")
    pm.eval()
    ids = _ids()
    with torch.no_grad():
        theirs = pm(ids).logits
        ours = load_model(base, adapter=tmp_path / "peft_adapter")(ids).logits
        unmerged = apply_adapter(load_model(base), tmp_path / "peft_adapter", merge=False)
        assert any(isinstance(m, LoRALinear) for m in unmerged.modules())
        swapped = unmerged(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(swapped, theirs, atol=1e-4, rtol=0)
    ad = read_adapter(tmp_path / "peft_adapter")
    assert ad.tensors["h.1.attn.c_attn"][0].shape[0] == 2 and "h.0.mlp.c_proj" in ad.tensors


def test_merged_equals_unmerged_and_the_merge_command_writes_a_plain_model(tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from gpt2kit.cli import main

    base = saved_hf_base(tmp_path)
    model = apply_lora(load_model(base), 8, 16, targets=ALL)
    _randomise_adapter(model)
    save_adapter(model, tmp_path / "adapter")
    ids = _ids()
    with torch.no_grad():
        unmerged = model(ids).logits
        merged = merge_lora(model)(ids).logits
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    out = tmp_path / "merged"
    assert main(["merge", str(base), str(tmp_path / "adapter"), str(out)]) == 0
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, unmerged, atol=1e-5, rtol=0)
    before = (out / "model.safetensors").read_bytes()
    assert main(["merge", str(base), str(tmp_path / "adapter"), str(out)]) == 1
    assert "already holds a model; pass --overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["merge", str(base), str(tmp_path / "adapter"), str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("rank, targets, words", [
    (0, ALL, r"LoRA rank must be an integer in \[1, 32\] for h.0.attn.c_attn \(96 x 32\), got 0"),
    (33, "c_fc", r"in \[1, 32\] for h.0.mlp.c_fc \(128 x 32\), got 33"),
    (2, "c_attn,q_proj", r"unknown LoRA target 'q_proj'; valid targets: attn.c_attn, attn.c_proj, mlp.c_fc"),
])
def test_bad_rank_or_target_is_one_clear_error(rank, targets, words):
    with pytest.raises(ValueError, match=words):
        apply_lora(random_model(), rank, targets=targets)


def test_parse_targets_takes_peft_short_names():
    assert parse_targets("c_proj") == ("attn.c_proj", "mlp.c_proj")
    assert parse_targets(["mlp.c_fc", "c_attn"]) == ("attn.c_attn", "mlp.c_fc")


def test_an_adapter_for_another_base_names_the_tensor(tmp_path, capsys):
    from gpt2kit.cli import main

    wide = GPT2Config(n_vocab=TINY.n_vocab, n_ctx=TINY.n_ctx, n_embd=48, n_head=4, n_layer=2)
    model = apply_lora(random_model(wide), 2, targets="c_fc")
    save_adapter(model, tmp_path / "adapter")
    base = tmp_path / "base"
    save_model(random_model(), base)
    with pytest.raises(CheckpointError, match=r"base_model.model.transformer.h.0.mlp.c_fc.lora_A.weight has shape "
                                              r"\(2, 48\), the model's h.0.mlp.c_fc \(128 x 32\) needs \(2, 32\)"):
        load_model(base, adapter=tmp_path / "adapter")
    assert main(["merge", str(base), str(tmp_path / "adapter"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lora_A.weight has shape (2, 48)" in err
    assert not (tmp_path / "out").exists()


def test_adapter_flag_on_score_and_generate(tmp_path, capsys):
    from gpt2kit.cli import main
    from gpt2kit.generation import SamplingSettings, generate
    from gpt2kit.score import score_text

    base = tmp_path / "base"
    save_model(random_model(GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2), seed=4), base)
    model = apply_lora(load_model(base), 4, 8, targets=ALL)
    _randomise_adapter(model, seed=2)
    save_adapter(model, tmp_path / "adapter")
    (tmp_path / "t.txt").write_text("the river runs to the sea", encoding="utf-8")
    assert main(["score", str(tmp_path / "t.txt"), "--model", str(base), "--adapter", str(tmp_path / "adapter"),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["nll"]
    from gpt2kit.checkpoint import load_tokenizer

    tok = load_tokenizer(base)
    adapted = load_model(base, adapter=tmp_path / "adapter")
    assert abs(got - score_text(adapted, tok, "the river runs to the sea").nll) < 1e-6
    assert abs(got - score_text(load_model(base), tok, "the river runs to the sea").nll) > 1e-3
    assert main(["generate", "the river", "--model", str(base), "--adapter", str(tmp_path / "adapter"), "--greedy",
                 "-n", "8", "--json"]) == 0
    ids = json.loads(capsys.readouterr().out.splitlines()[0])["tokens"]
    want = generate(adapted, ["the river"], SamplingSettings(max_new_tokens=8, temperature=0.0), tokenizer=tok)
    plain = generate(load_model(base), ["the river"], SamplingSettings(max_new_tokens=8, temperature=0.0),
                     tokenizer=tok)
    assert ids == want[0].tokens and ids != plain[0].tokens


def test_merge_never_writes_over_its_inputs_and_serve_checks_the_adapter_first(tmp_path, capsys):
    from gpt2kit.cli import main

    base = saved_hf_base(tmp_path)
    model = apply_lora(load_model(base), 2, targets="c_attn")
    save_adapter(model, tmp_path / "adapter")
    before = (base / "model.safetensors").read_bytes()
    assert main(["merge", str(base), str(tmp_path / "adapter"), str(base), "--overwrite"]) == 1
    assert "is the base model; write the merged model to another directory" in capsys.readouterr().err
    assert (base / "model.safetensors").read_bytes() == before
    assert main(["merge", str(base), str(tmp_path / "adapter"), str(tmp_path / "adapter")]) == 1
    assert "is the adapter" in capsys.readouterr().err
    pytest.importorskip("fastapi")
    assert main(["serve", "--model", str(base), "--adapter", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no adapter_config.json: not a LoRA adapter directory" in err


# peft's bias option: "all" trains every *bias (block Linears, LayerNorms, ln_f), "lora_only" the adapted ones.
def _peft_bias_adapter(base: Path, out: Path, bias: str, targets: list[str]):
    """An adapter peft itself trains-by-hand and saves: random lora_B and random shifts on the biases
    peft marks trainable for `bias` (so the saved biases differ from the base's)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(7)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=True, task_type="CAUSAL_LM",
                          bias=bias)
    pm = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(base), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
            elif p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    pm.save_pretrained(out)
    return pm.eval()


@pytest.mark.parametrize("bias, n_biases", [("all", 6 * TINY.n_layer + 1), ("lora_only", 3 * TINY.n_layer)])
def test_a_bias_adapter_trains_and_saves_what_peft_does(tmp_path, bias, n_biases):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    base = saved_hf_base(tmp_path)
    model = apply_lora(load_model(base), 4, 8, targets="c_attn,c_proj", bias=bias)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert len(trained) == n_biases and ("ln_f.bias" in trained) == (bias == "all")
    assert ("h.0.mlp.c_fc.bias" in trained) == (bias == "all") and "h.0.attn.c_attn.bias" in trained
    _randomise_adapter(model)
    with torch.no_grad():
        for name in trained:
            model.get_parameter(name).add_(torch.randn_like(model.get_parameter(name)) * 0.3)
    assert set(lora_state(model, bias)) - set(lora_state(model)) == trained  # what a checkpoint keeps
    save_adapter(model, tmp_path / "ours", bias=bias)
    _peft_bias_adapter(base, tmp_path / "theirs", bias, ["c_attn", "c_proj"])
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "theirs"))
    assert sorted(ours) == sorted(theirs)  # peft's key names, the same set of tensors
    assert all(ours[k].shape == theirs[k].shape for k in ours)
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["bias"] == bias
    hf = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), tmp_path / "ours").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)
        without = apply_lora(load_model(base), 4, 8, targets="c_attn,c_proj")
        for k, t in lora_state(model).items():
            lora_state(without)[k].copy_(t)
        assert (without(ids).logits - hf(ids).logits).abs().max() > 1e-3  # the biases really count


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_peft_bias_adapter_loads_and_merges_in_gpt2kit(tmp_path, capsys, bias):
    from transformers import GPT2LMHeadModel

    from gpt2kit.cli import main

    base = saved_hf_base(tmp_path)
    pm = _peft_bias_adapter(base, tmp_path / "peft_adapter", bias, ["c_attn", "c_fc"])
    ids = _ids()
    with torch.no_grad():
        theirs = pm(ids).logits
        merged = load_model(base, adapter=tmp_path / "peft_adapter")(ids).logits
        unmerged_model = apply_adapter(load_model(base), tmp_path / "peft_adapter", merge=False)
        unmerged = unmerged_model(ids).logits
    torch.testing.assert_close(merged, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(unmerged, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    ad = read_adapter(tmp_path / "peft_adapter")
    assert ad.bias == bias and ("ln_f.bias" in ad.biases) == (bias == "all")
    assert "h.1.attn.c_attn.bias" in ad.biases and ("h.1.attn.c_proj.bias" in ad.biases) == (bias == "all")
    assert main(["merge", str(base), str(tmp_path / "peft_adapter"), str(tmp_path / "merged")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, unmerged, atol=1e-5, rtol=0)
    # our save of the unmerged model writes the same biases back
    save_adapter(unmerged_model, tmp_path / "again", bias=bias)
    again = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), tmp_path / "again").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs, atol=1e-4, rtol=0)


def test_an_unknown_bias_names_the_valid_ones(tmp_path):
    from gpt2kit.train.config import TrainConfig

    valid = r"unknown LoRA bias 'some'; valid choices: none, all, lora_only"
    with pytest.raises(ValueError, match=valid):
        apply_lora(random_model(), 2, bias="some")
    with pytest.raises(ValueError, match=valid):
        TrainConfig(data="d", out="o", lora_rank=2, lora_bias="some")
    with pytest.raises(ValueError, match="--lora-bias all needs --lora-rank"):
        TrainConfig(data="d", out="o", lora_bias="all")
    model = apply_lora(random_model(), 2, targets="c_fc")
    save_adapter(model, tmp_path / "adapter")
    cfg_file = tmp_path / "adapter" / "adapter_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"bias": "some"}))
    with pytest.raises(CheckpointError, match=r"unknown bias 'some'; valid choices: none, all, lora_only"):
        read_adapter(tmp_path / "adapter")


def test_a_bias_for_another_base_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_adapter(apply_lora(random_model(), 2, targets="c_fc", bias="all"), tmp_path / "adapter", bias="all")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    state = load_file(weights) | {"base_model.model.transformer.h.0.ln_1.bias": torch.zeros(48)}
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=r"the bias for h.0.ln_1.bias has shape \(48,\), the model's is \(32,\)"):
        apply_adapter(random_model(), tmp_path / "adapter")


def test_disable_adapter_is_the_base_bit_for_bit_and_restores_the_adapter_after_an_error():
    """`with model.disable_adapter():` (peft's disable_adapter) on one loaded model: inside, the logits
    and greedy tokens are the base model's exactly; after, an error included, the adapted ones; merged
    without unloading, the adapted logits within 1e-5, and unmerge_lora gives them back within rounding."""
    import copy

    from gpt2kit import SamplingSettings, generate
    from gpt2kit.lora import merge_lora, unmerge_lora

    base = random_model()
    model = apply_lora(copy.deepcopy(base), 4, targets=ALL, tokens=[3, 7, 11])
    _randomise_adapter(model)
    ids = torch.tensor([[3, 7, 11, 500, 42, 9]])
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=10, stop_token_ids=())
    with torch.no_grad():
        want_base, adapted = base(ids).logits, model(ids).logits
        assert (want_base - adapted).abs().max() > 1e-3  # the adapter changes the logits
        with model.disable_adapter():
            assert torch.equal(model(ids).logits, want_base)
            assert generate(model, [[3, 7, 11]], greedy)[0].tokens == generate(base, [[3, 7, 11]], greedy)[0].tokens
        assert torch.equal(model(ids).logits, adapted)
        with pytest.raises(RuntimeError, match="inside"), model.disable_adapter():
            raise RuntimeError("inside")
        assert torch.equal(model(ids).logits, adapted)
        merge_lora(model, unload=False)
        assert (model(ids).logits - adapted).abs().max() < 1e-5
        unmerge_lora(model)
        assert (model(ids).logits - adapted).abs().max() < 1e-5
