"""Trainable embedding rows beside LoRA (gpt2kit.lora.TrainableTokens; peft's trainable_token_indices):
the rows replace the base's in the lookup and the tied head, only they and the adapters train, and
the adapter round-trips with peft (peft.PeftModel on transformers' GPT-2 is the reference, 1e-4);
`gpt2kit train --lora-tokens N` picks the N ids the train split uses most."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TINY, random_model, saved_hf_base

from gpt2kit.checkpoint import CheckpointError, apply_adapter, load_model, read_adapter, save_adapter
from gpt2kit.data.shard import most_used_tokens, write_shard
from gpt2kit.lora import TrainableTokens, apply_lora, lora_state, merge_lora

peft = pytest.importorskip("peft")

TOKENS = [3, 17, 250, 999]


def _ids() -> torch.Tensor:
    ids = torch.randint(0, TINY.n_vocab, (2, 20), generator=torch.Generator().manual_seed(5))
    ids[0, :4] = torch.tensor(TOKENS)  # the trained rows are looked up, and predicted (head)
    return ids


def _randomise(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in lora_state(model).values():
            if t.is_floating_point():
                t.copy_(t + torch.randn(t.shape, generator=g) * 0.1)



def test_fresh_rows_change_nothing_and_only_they_and_the_adapters_train():
    model = random_model()
    ids = _ids()
    before, table = model(ids).logits, model.wte.weight.detach().clone()
    apply_lora(model, 2, 4, targets="c_attn", tokens=TOKENS)
    assert isinstance(model.wte, TrainableTokens)
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted([f"h.{i}.attn.c_attn.lora_{p}" for i in range(TINY.n_layer) for p in "AB"]
                               + ["wte.trainable_tokens"])
    model(ids, targets=ids).loss.backward()
    assert model.wte.trainable_tokens.grad.abs().sum(1).gt(0).all()  # every row reached: lookup and head
    with torch.no_grad():
        model.wte.trainable_tokens[1] += 1.0
    logits = model(ids).logits
    assert (logits - before).abs().max() > 1e-3
    assert torch.equal(model.wte.weight, table)  # the base table is untouched
    assert torch.equal(model.wte.merged_weight()[TOKENS[0]], table[TOKENS[0]] + 0)
    assert not torch.equal(model.wte.merged_weight()[TOKENS[1]], table[TOKENS[1]])


def test_the_training_loss_reads_the_rows_in_its_fused_head():
    from gpt2kit.train.loss import TrainingLoss

    model = apply_lora(random_model(), 2, targets="c_fc", tokens=TOKENS)
    _randomise(model)
    ids = _ids()
    fused = TrainingLoss(model)(ids[:, :-1], ids[:, 1:])
    plain = torch.nn.functional.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=0)


def test_our_rows_load_in_peft_with_the_same_logits_and_merge_exactly(tmp_path):
    from transformers import GPT2LMHeadModel

    base = saved_hf_base(tmp_path)
    model = apply_lora(load_model(base), 4, 8, targets="c_attn,c_fc", tokens=TOKENS)
    _randomise(model)
    save_adapter(model, tmp_path / "ours", base=str(base))
    cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert cfg["trainable_token_indices"] == TOKENS
    hf = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), tmp_path / "ours").eval()
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids).logits
        loaded = load_model(base, adapter=tmp_path / "ours")(ids).logits
        merged = merge_lora(model)(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(loaded, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(merged, ours, atol=1e-5, rtol=0)
    assert type(model.wte) is torch.nn.Embedding


def test_a_peft_adapter_with_trainable_tokens_loads_merged_and_unmerged(tmp_path):
    from transformers import GPT2LMHeadModel

    base = saved_hf_base(tmp_path)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_proj"], fan_in_fan_out=True, task_type="CAUSAL_LM",
                          trainable_token_indices=TOKENS)
    torch.manual_seed(3)
    pm = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(base), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name:
                p.add_(torch.randn_like(p) * 0.1)
    pm.save_pretrained(tmp_path / "theirs")
    pm.eval()
    ids = _ids()
    with torch.no_grad():
        theirs = pm(ids).logits
        merged = load_model(base, adapter=tmp_path / "theirs")(ids).logits
        unmerged = apply_adapter(load_model(base), tmp_path / "theirs", merge=False)
        assert isinstance(unmerged.wte, TrainableTokens)
        swapped = unmerged(ids).logits
    torch.testing.assert_close(merged, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(swapped, theirs, atol=1e-4, rtol=0)
    assert read_adapter(tmp_path / "theirs").tokens[0] == TOKENS


def test_bad_tokens_are_one_clear_error(tmp_path):
    for bad, words in (([], "token ids in [0,"), ([5, TINY.n_vocab], f"[0, {TINY.n_vocab})"), ([4, 4], "distinct"),
                       ("12", "list of token ids")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            apply_lora(random_model(), 2, tokens=bad)
    base = saved_hf_base(tmp_path)
    model = apply_lora(load_model(base), 2, targets="c_attn", tokens=TOKENS)
    save_adapter(model, tmp_path / "a", base=str(base))
    cfg_file = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["trainable_token_indices"] = TOKENS[:2]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lists 2 tokens"):
        read_adapter(tmp_path / "a")
    cfg["trainable_token_indices"] = [3, 17, 250, TINY.n_vocab + 5]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="made for another base"):
        load_model(base, adapter=tmp_path / "a")


def test_most_used_tokens_counts_the_shards(tmp_path):
    write_shard(tmp_path / "train_000000.bin", [5, 5, 9, 2, 9, 5])
    write_shard(tmp_path / "train_000001.bin", [2, 7, 7, 7, 9])
    files = sorted(tmp_path.glob("train_*.bin"))
    assert most_used_tokens(files, 3, 50257) == [5, 7, 9]  # 3, 3 (tie: lower id first), 3 ... then 2
    assert most_used_tokens(files, 10, 50257) == [5, 7, 9, 2]


def test_train_lora_tokens_end_to_end(tmp_path, capsys):
    from gpt2kit.cli import main

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "train_000000.bin", rng.integers(0, 40, 4000))  # ids 0..39 only
    write_shard(data / "val_000000.bin", rng.integers(0, 40, 600))
    base = saved_hf_base(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--model", str(base), "--lora-rank", "2",
                 "--lora-tokens", "6", "--batch-size", "2", "--seq-len", "16", "--max-steps", "3",
                 "--eval-every", "0", "--lr", "1e-2"]) == 0
    ad = read_adapter(out)
    assert len(ad.tokens[0]) == 6 and max(ad.tokens[0]) < 40
    base_rows = load_model(base).wte.weight[ad.tokens[0]]
    assert not torch.allclose(ad.tokens[1], base_rows)  # the rows trained
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "x"), "--model", str(base),
                 "--lora-tokens", "6", "--max-steps", "1"]) != 0
    assert "--lora-tokens 6 needs --lora-rank" in capsys.readouterr().err
