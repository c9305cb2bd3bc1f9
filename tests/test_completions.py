"""Prompt/completion data: prepare's shards + loss masks, the masked loaders, training on them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2kit.data import RandomWindowLoader, ShardLoader, read_shard, write_shard
from gpt2kit.data.completions import IGNORE, mask_path, prepare_completions, with_masks
from gpt2kit.tokenizer import Tokenizer


def _pairs(path: Path, n: int = 60) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sun", "moon", "river", "stone"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            prompt = " ".join(rng.choice(words, size=rng.integers(2, 8)))
            f.write(json.dumps({"prompt": f"Q{i}: {prompt}?", "completion": f" {words[i % 8]} {i}"}) + "\n")
    return path


def test_prepare_writes_masks_that_mark_completions_and_their_end(tmp_path):
    src = _pairs(tmp_path / "pairs.jsonl", n=5)
    s = prepare_completions([src], tmp_path / "data", val_fraction=0.0, shuffle_seed=None)
    assert s.documents == 5 and [p.name for p in s.train_shards] == ["train_000000.bin"]
    tokens = np.asarray(read_shard(s.train_shards[0]))
    mask = np.load(mask_path(s.train_shards[0]))
    assert mask.dtype == np.uint8 and mask.shape == tokens.shape
    tok = Tokenizer.default()
    first = json.loads(src.read_text().splitlines()[0])
    want = tok.encode(first["completion"]) + [tok.eot_token]
    n = 1 + len(tok.encode(first["prompt"])) + len(want)
    assert tokens[0] == tok.eot_token and list(mask[:n]) == [0] * (n - len(want)) + [1] * len(want)
    assert list(tokens[:n][mask[:n] == 1]) == want


@pytest.mark.parametrize("kind", ["random", "sequential"])
def test_masked_targets_are_ignored_exactly_where_the_target_is_not_a_completion(tmp_path, kind):
    s = prepare_completions([_pairs(tmp_path / "p.jsonl")], tmp_path / "data", val_fraction=0.0, shard_size=400)
    assert len(s.train_shards) >= 2  # an example may span two shards; its mask goes with it
    make = (lambda: RandomWindowLoader(tmp_path / "data", batch_size=3, seq_len=16, seed=1)) if kind == "random" \
        else (lambda: ShardLoader(tmp_path / "data", batch_size=3, seq_len=16))
    plain, masked = make(), with_masks(make())
    for _ in range(20):
        x0, y0 = plain.next_batch()
        x, y = masked.next_batch()
        assert torch.equal(x, x0)
        kept = y != IGNORE
        assert torch.equal(y[kept], y0[kept]) and 0 < kept.sum() < kept.numel()
    assert masked.state_dict() == plain.state_dict()


def test_shards_without_masks_load_as_before(tmp_path):
    write_shard(tmp_path / "train_000000.bin", np.arange(1000) % 500)
    loader = ShardLoader(tmp_path, batch_size=2, seq_len=8)
    assert with_masks(loader) is loader


def test_a_line_without_completion_is_one_clear_error(tmp_path, capsys):
    from gpt2kit.cli import main

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n', encoding="utf-8")
    assert main(["prepare", str(src), "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'p.jsonl, line 2: a prompt/completion line needs a string "completion"' in err
    assert not list((tmp_path / "d").glob("*.bin"))


def test_training_on_completions_resumes_exactly(tmp_path):
    from gpt2kit.cli import main
    from gpt2kit.train.config import TrainConfig
    from gpt2kit.train.loop import resume_config, train
    from gpt2kit.train.run_dir import CHECKPOINT_NAME

    assert main(["prepare", str(_pairs(tmp_path / "p.jsonl", n=200)), "--out", str(tmp_path / "data"),
                 "--val-fraction", "0.1"]) == 0
    kw = dict(data=str(tmp_path / "data"), model="gpt2-tiny", n_layer=2, n_embd=32, n_head=2, n_ctx=64,
              batch_size=2, seq_len=32, max_steps=8, eval_every=4, eval_steps=2, save_every=0, log_every=100,
              optimizer="adamw", lr=3e-3, total_batch_tokens=128)
    train(TrainConfig(out=str(tmp_path / "straight"), **kw))
    train(TrainConfig(out=str(tmp_path / "split"), stop_at=4, **kw))
    train(resume_config(tmp_path / "split"))

    def losses(out: Path) -> list[float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r.get("loss", r.get("val_loss")) for r in rows]

    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert len(a) == len(b) == 8 + 2 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6
    assert (tmp_path / "split" / CHECKPOINT_NAME).exists()


def test_the_training_loss_counts_only_completion_targets(tmp_path):
    import torch.nn.functional as F

    from gpt2kit.config import GPT2Config
    from gpt2kit.model import GPT2
    from gpt2kit.train.loss import TrainingLoss

    prepare_completions([_pairs(tmp_path / "p.jsonl")], tmp_path / "data", val_fraction=0.0)
    x, y = with_masks(RandomWindowLoader(tmp_path / "data", batch_size=4, seq_len=32, seed=0)).next_batch()
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=2, n_layer=2))
    logits = model(x).logits
    want = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE)
    everything = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x.roll(-1, 1).reshape(-1))
    got = TrainingLoss(model)(x, y)
    assert abs(got.item() - want.item()) <= 1e-5 and abs(got.item() - everything.item()) > 1e-4
