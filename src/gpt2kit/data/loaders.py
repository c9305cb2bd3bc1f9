"""The two batch loaders over token shards, with one constructor shape and resumable state.

ShardLoader reads the shards in order (llm.c/nanoGPT's sequential read); RandomWindowLoader draws
windows at random from all of them (what training uses by default). Both take the same arguments,
checked by one function, and give (x, y) int64 (B, T) batches on the CPU.

Legend: B batch size, T sequence length, W world size (number of data-parallel ranks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gpt2kit.data.shard import check_vocab, find_shards, read_shard, shard_token_count
from gpt2kit.validate import check_int

if TYPE_CHECKING:
    import torch

Source = str | os.PathLike | Sequence[str | os.PathLike]  # a shard directory, one shard, or a list of shards


def open_shards(who: str, data_dir_or_files: Source, split: str, *, batch_size: int, seq_len: int, rank: int,
                world_size: int) -> tuple[list[Path], list[int]]:
    """What both loaders' constructors share: the checks of their arguments, then the shard files they
    read (a directory's `split` shards, one file, or the files given) and each one's token count."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if isinstance(data_dir_or_files, (str, os.PathLike)):
        p = Path(data_dir_or_files)
        files = find_shards(p, split) if p.is_dir() else [p]
    else:
        files = [Path(f) for f in data_dir_or_files]
        if not files:
            raise ValueError(f"{who} needs at least one shard file")
    return files, [shard_token_count(f) for f in files]


class ShardLoader:
    """Endless (x, y) batches from shards, split across data-parallel ranks as in llm.c/nanoGPT.

    Each step covers a window of W*B*T + 1 tokens starting at `position` in the current shard;
    rank r reads the r-th B*T (+1) slice of it, so ranks 0..W-1 stacked give exactly the batch
    one process with batch size W*B would get. Then position advances by W*B*T; when the next
    window does not fit, the loader moves to the next shard, and after the last shard wraps to
    the first and increments `epoch`. The tail of a shard that does not fill a window is skipped.

    The state (shard, position, epoch) is the same on every rank, so one rank's state_dict()
    resumes all of them exactly.
    """

    def __init__(
        self,
        data_dir_or_files: Source,
        split: str = "train",
        *,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.files, self.counts = open_shards(type(self).__name__, data_dir_or_files, split, batch_size=batch_size,
                                              seq_len=seq_len, rank=rank, world_size=world_size)
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.window = world_size * batch_size * seq_len + 1
        for f, n in zip(self.files, self.counts, strict=True):
            if n < self.window:
                raise ValueError(
                    f"{f}: shard has {n} tokens, fewer than the {self.window} one step needs "
                    f"(world_size {world_size} * batch_size {batch_size} * seq_len {seq_len} + 1)"
                )
        self.reset()

    def check_vocab(self, n_vocab: int) -> None:
        """Raise ValueError naming the shard and offset of the first token id >= n_vocab, if any."""
        check_vocab(self.files, n_vocab)

    def reset(self) -> None:
        """Back to the start of the first shard, epoch 0."""
        self._set(shard=0, position=0, epoch=0)

    def _set(self, shard: int, position: int, epoch: int) -> None:
        self.shard, self.position, self.epoch = shard, position, epoch
        self._tokens = read_shard(self.files[shard])  # only the current shard stays mapped

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x, y), int64 tensors of shape (B, T) on the CPU; y[b, t] == x[b, t + 1] in the stream."""
        import torch

        BT = self.B * self.T
        start = self.position + self.rank * BT
        buf = torch.from_numpy(self._tokens[start : start + BT + 1].astype(np.int64))  # (B*T + 1,)
        x = buf[:-1].view(self.B, self.T)  # (B, T)
        y = buf[1:].view(self.B, self.T)  # (B, T)
        self._advance(self.position + self.world_size * BT)
        return x, y

    def _advance(self, position: int) -> None:
        if position + self.window <= self.counts[self.shard]:
            self.position = position
        elif self.shard + 1 < len(self.files):
            self._set(self.shard + 1, 0, self.epoch)
        else:
            self._set(0, 0, self.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "position": self.position,
            "epoch": self.epoch,
            "shard_name": self.files[self.shard].name,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); with the same shards and B, T, W the next batches are identical."""
        shard, position, epoch = int(state["shard"]), int(state["position"]), int(state["epoch"])
        if not 0 <= shard < len(self.files):
            raise ValueError(f"state names shard {shard}, but the loader has {len(self.files)} shards")
        name = state.get("shard_name")
        if name is not None and name != self.files[shard].name:
            raise ValueError(
                f"state was saved at shard {shard} = {name}, but here shard {shard} is {self.files[shard].name}"
            )
        if not 0 <= position <= self.counts[shard]:
            raise ValueError(
                f"state position {position} is outside shard {self.files[shard]} ({self.counts[shard]} tokens)"
            )
        self._set(shard, position, epoch)
        if position + self.window > self.counts[shard]:  # saved with a smaller window: move on as usual
            self._advance(position)



class RandomWindowLoader:
    """Endless (x, y) batches of windows drawn at random from all shards, as nanoGPT samples them.

    Batch k (counted from 0 over the whole run) is W*B windows of T+1 tokens whose starts are drawn
    uniformly, with replacement, from every position of every shard where a window fits, by a
    generator seeded with (seed, k); rank r takes windows r*B .. r*B+B-1. So one process with batch
    size W*B gets exactly the batches that W ranks get together, and the state is one counter:
    state_dict() on any rank resumes all of them exactly. A window may span two documents (they are
    separated by <|endoftext|>, as in a sequential read), never two shards.
    """

    def __init__(
        self,
        data_dir_or_files: Source,
        split: str = "train",
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        check_int("seed", seed, ">= 0", lambda v: v >= 0)
        self.files, self.counts = open_shards(type(self).__name__, data_dir_or_files, split, batch_size=batch_size,
                                              seq_len=seq_len, rank=rank, world_size=world_size)
        self.B, self.T, self.rank, self.world_size, self.seed = batch_size, seq_len, rank, world_size, seed
        starts = np.array([max(0, n - seq_len) for n in self.counts], dtype=np.int64)  # windows per shard
        if not starts.sum():
            raise ValueError(f"no shard in {[f.name for f in self.files]} holds the {seq_len + 1} tokens "
                             f"one window needs (seq_len {seq_len} + 1)")
        self._ends = np.cumsum(starts)  # (shards,): window index bounds
        self._tokens: dict[int, np.ndarray] = {}
        self.batches = 0

    def check_vocab(self, n_vocab: int) -> None:
        """Raise ValueError naming the shard and offset of the first token id >= n_vocab, if any."""
        check_vocab(self.files, n_vocab)

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._tokens:
            self._tokens[i] = read_shard(self.files[i])
        return self._tokens[i]

    def windows(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's windows of batch `batch`: (shard index (B,), start offset in it (B,))."""
        rng = np.random.default_rng([self.seed, batch])
        picks = rng.integers(0, int(self._ends[-1]), size=self.world_size * self.B)  # (W*B,)
        picks = picks[self.rank * self.B : (self.rank + 1) * self.B]  # (B,): this rank's windows
        shards = np.searchsorted(self._ends, picks, side="right")  # (B,)
        return shards, picks - np.concatenate(([0], self._ends))[shards]  # (B,), (B,)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x, y), int64 tensors of shape (B, T) on the CPU; y[b, t] == x[b, t + 1] in the stream."""
        import torch

        shards, offsets = self.windows(self.batches)
        buf = np.stack([self._shard(int(s))[o : o + self.T + 1] for s, o in zip(shards, offsets, strict=True)])
        buf = torch.from_numpy(buf.astype(np.int64))  # (B, T + 1)
        self.batches += 1
        return buf[:, :-1], buf[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sampling": "random", "batches": self.batches, "seed": self.seed,
                "shard_names": [f.name for f in self.files]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); with the same shards, seed and B, T, W the next batches are identical."""
        if state.get("sampling") != "random":
            raise ValueError("the saved data position is a sequential read, not random windows")
        names = [f.name for f in self.files]
        if state.get("shard_names", names) != names:
            raise ValueError(f"state was saved with shards {state['shard_names']}, but here they are {names}")
        self.seed = int(state.get("seed", self.seed))
        self.batches = int(state["batches"])
