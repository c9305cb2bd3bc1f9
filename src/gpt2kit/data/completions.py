"""Prompt/completion fine-tuning data: shards with a loss mask beside them, and loaders that apply it.

`gpt2kit prepare pairs.jsonl --out data/` on a .jsonl whose lines are {"prompt": ..., "completion": ...}
writes, per example,

    tokens  <|endoftext|> prompt... completion... <|endoftext|>
    mask       0           0 ... 0    1 ... 1         1

packed into ordinary llm.c token shards (train_000000.bin, ...) with, beside each, its mask
(train_000000.mask.npy: uint8, one per token). Training takes the loss only where the *target*
token's mask is 1: the completion and the <|endoftext|> that ends it, so the model learns to answer
and to stop, never to write prompts. The loaders are unchanged: `with_masks(loader)` reads the same
windows from the masks (RandomWindowLoader.windows, ShardLoader's position), so random windows,
W ranks = one process in the windows drawn, and exact resume (the loader's state alone) all hold;
shards without masks (llm.c's, `prepare` on text) load unchanged. Each micro-batch's loss is the
mean over its own unmasked targets.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpt2kit._io import atomic_write
from gpt2kit.data import DEFAULT_SHUFFLE_SEED, MAX_SHARD_TOKENS, PrepareSummary, RandomWindowLoader, write_shard
from gpt2kit.tokenizer import Tokenizer

MASK_SUFFIX = ".mask.npy"
IGNORE = -100  # the target value the loss skips (gpt2kit.train.loss's ignore_index)


def mask_path(shard: str | os.PathLike[str]) -> Path:
    shard = Path(shard)
    return shard.with_name(shard.name.removesuffix(".bin") + MASK_SUFFIX)


def is_prompt_completion(path: str | os.PathLike[str]) -> bool:
    """Whether a .jsonl file's first non-blank line is an object with a "prompt" field."""
    p = Path(path)
    if p.suffix.lower() != ".jsonl" or not p.is_file():
        return False
    with open(p, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except ValueError:
                    return False
                return isinstance(obj, dict) and "prompt" in obj
    return False


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The (prompt, completion) of every non-blank line; a bad line raises naming file and line."""
    pairs = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: invalid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}, line {lineno}: expected an object, found {type(obj).__name__}")
            for key in ("prompt", "completion"):
                if not isinstance(obj.get(key), str):
                    raise ValueError(f'{path}, line {lineno}: a prompt/completion line needs a string "{key}" '
                                     f"field, found keys {sorted(obj)}")
            if not obj["completion"]:
                raise ValueError(f'{path}, line {lineno}: "completion" is empty: nothing to learn from')
            pairs.append((obj["prompt"], obj["completion"]))
    return pairs


def _val_examples(val_fraction: float, n: int) -> int:
    if val_fraction == 0 or n < 2:
        return 0
    return min(max(1, math.ceil(round(val_fraction * n, 9))), n - 1)


def prepare_completions(inputs: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], *,
                        val_fraction: float = 0.0005, shard_size: int = 100_000_000, overwrite: bool = False,
                        shuffle_seed: int | None = DEFAULT_SHUFFLE_SEED) -> PrepareSummary:
    """Tokenize prompt/completion .jsonl files into shards + masks (see the module doc).

    Examples are shuffled by shuffle_seed (None: file order) and the first ceil(val_fraction * n)
    go to validation, as `prepare` does with documents."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not 1 <= shard_size <= MAX_SHARD_TOKENS:
        raise ValueError(f"shard_size must be in [1, {MAX_SHARD_TOKENS}], got {shard_size}")
    pairs = [p for path in inputs for p in read_pairs(Path(path))]
    if not pairs:
        raise ValueError(f"empty corpus: no prompt/completion lines in {', '.join(map(str, inputs))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted([*out.glob("*train_*.bin"), *out.glob("*val_*.bin"), *out.glob("*" + MASK_SUFFIX)])
    if stale and not overwrite:
        raise FileExistsError(f"{out} already holds shards ({stale[0].name}, ...); pass --overwrite "
                              f"(overwrite=True) to replace them, or choose another output directory")
    for p in stale:
        p.unlink()
    order = np.arange(len(pairs)) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(
        len(pairs))
    tok = Tokenizer.default()
    eot = tok.eot_token
    n_val = _val_examples(val_fraction, len(pairs))
    written: dict[str, list[Path]] = {"val": [], "train": []}
    counts = {"val": 0, "train": 0}
    for split, idx in (("val", order[:n_val]), ("train", order[n_val:])):
        tokens, mask = [], []
        for i in idx:
            prompt, completion = tok.encode(pairs[i][0]), tok.encode(pairs[i][1])
            tokens += [eot, *prompt, *completion, eot]
            mask += [0] * (1 + len(prompt)) + [1] * (len(completion) + 1)
        t, m = np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8)
        counts[split] = len(t)
        for k, s in enumerate(range(0, len(t), shard_size)):
            shard = out / f"{split}_{k:06d}.bin"
            write_shard(shard, t[s : s + shard_size])
            piece = m[s : s + shard_size]
            atomic_write(mask_path(shard), lambda f, piece=piece: np.save(f, piece, allow_pickle=False))
            written[split].append(shard)
    summary = PrepareSummary(out_dir=out, documents=len(pairs), val_documents=n_val, train_tokens=counts["train"],
                             val_tokens=counts["val"], train_shards=written["train"], val_shards=written["val"])
    record = summary.to_dict() | {"inputs": [str(i) for i in inputs], "kind": "prompt/completion",
                                  "mask": f"<shard>{MASK_SUFFIX}: uint8 per token, 1 = target counted in the loss",
                                  "val_fraction": val_fraction, "shard_size": shard_size, "shuffle_seed": shuffle_seed}
    atomic_write(out / "prepare.json", lambda f: f.write(json.dumps(record, indent=2).encode() + b"\n"))
    return summary


class MaskedLoader:
    """A ShardLoader or RandomWindowLoader whose targets are IGNORE where the mask is 0; the same
    windows, the same state."""

    def __init__(self, loader: Any, masks: list[np.ndarray]) -> None:
        self.loader, self.masks = loader, masks
        self.files, self.counts = loader.files, loader.counts

    def next_batch(self):
        import torch

        ld = self.loader
        B, T = ld.B, ld.T
        if isinstance(ld, RandomWindowLoader):
            shards, offsets = ld.windows(ld.batches)
            m = np.stack([self.masks[int(s)][o + 1 : o + T + 1] for s, o in zip(shards, offsets, strict=True)])
        else:  # ShardLoader: rank r's slice of the window at `position` in the current shard
            start = ld.position + ld.rank * B * T
            m = self.masks[ld.shard][start + 1 : start + B * T + 1].reshape(B, T)
        x, y = ld.next_batch()  # (B, T), (B, T)
        return x, torch.where(torch.from_numpy(m.astype(bool)), y, IGNORE)

    def reset(self) -> None:
        self.loader.reset()

    def check_vocab(self, n_vocab: int) -> None:
        self.loader.check_vocab(n_vocab)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def with_masks(loader: Any) -> Any:
    """The loader with its shards' masks applied, or the loader itself when its shards have none."""
    if loader is None:
        return None
    paths = [mask_path(f) for f in loader.files]
    have = [p.exists() for p in paths]
    if not any(have):
        return loader
    if not all(have):
        missing = next(p for p, h in zip(paths, have, strict=True) if not h)
        raise ValueError(f"{missing} is missing: some shards of this split have loss masks and others not; "
                         f"prepare the data again into an empty directory")
    masks = []
    for p, n in zip(paths, loader.counts, strict=True):
        m = np.load(p, mmap_mode="r", allow_pickle=False)
        if m.ndim != 1 or m.dtype != np.uint8 or len(m) != n:
            raise ValueError(f"{p}: a loss mask must be 1-D uint8 with one value per token of its shard ({n}), "
                             f"got shape {m.shape} dtype {m.dtype}")
        masks.append(m)
    return MaskedLoader(loader, masks)
