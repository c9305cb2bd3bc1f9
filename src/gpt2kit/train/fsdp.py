"""Sharded data parallel (`train --fsdp`): PyTorch's FSDP2, started by torchrun like DDP.

    torchrun --nproc_per_node=N -m gpt2kit train --fsdp --optimizer adamw ...

`shard(loss_model)` applies torch.distributed.fsdp.fully_shard to every block and then to the
TrainingLoss around the model (so the embeddings, which are also the tied head the fused loss
multiplies, stay gathered for the whole forward): each rank holds 1/N of every parameter, its
gradient and its AdamW moments, all-gathered block by block for the forward and backward, and
gradients are reduce-scattered (averaged), so the loss curve is DDP's. AdamW only: Muon
orthogonalises whole matrices, which no rank holds. LoRA is not combined with it.

Checkpoints are sharded with torch.distributed.checkpoint: every rank writes its shards of the
model and the optimizer into OUT/checkpoint.step<N>.dcp/ (a new directory per save), then rank 0
writes checkpoint.pt (step, RNG states, data position, config, and the name of that directory) and
removes the older directories. checkpoint.pt is written last, atomically, so a kill at any point
leaves it naming a complete directory. The final model is gathered to rank 0 and written as one
HF directory, like any run's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpt2kit._io import kill_point
from gpt2kit.model import GPT2
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.distributed import Dist

DCP_PREFIX = "checkpoint.step"
DCP_SUFFIX = ".dcp"


def check(cfg: TrainConfig, d: Dist) -> None:
    """Refuse what --fsdp cannot do, in one line, before anything is built."""
    if cfg.optimizer == "muon":
        raise ValueError("--fsdp needs --optimizer adamw: Muon orthogonalises whole matrices, and under FSDP no "
                         "rank holds a whole matrix")
    if cfg.lora_rank is not None:
        raise ValueError("--lora-rank cannot be combined with --fsdp (a LoRA run keeps only frozen weights and a "
                         "small adapter per rank: use DDP, plain torchrun without --fsdp)")
    if "WORLD_SIZE" not in os.environ:
        raise ValueError("--fsdp shards the model across processes started by torchrun "
                         "(torchrun --nproc_per_node=N -m gpt2kit train --fsdp ...); this process has no "
                         "torchrun environment (WORLD_SIZE, RANK)")
    if d.world_size < 2:
        raise ValueError(f"--fsdp with WORLD_SIZE={d.world_size} shards nothing: start 2 or more processes "
                         "(torchrun --nproc_per_node=2), or drop --fsdp")


def shard(loss_model: nn.Module) -> None:
    """fully_shard every block, then the TrainingLoss (the root: embeddings, ln_f), in place."""
    from torch.distributed.fsdp import fully_shard

    for block in loss_model.model.h:
        fully_shard(block)
    fully_shard(loss_model)


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    return list(optimizer.optimizers.values())


def save_sharded(model: nn.Module, optimizer: Any, out: Path, step: int) -> str:
    """Every rank writes its shards to OUT/checkpoint.step<N>.dcp; returns that directory's name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"{DCP_PREFIX}{step:08d}{DCP_SUFFIX}"
    path = out / name
    if path.exists() and torch.distributed.get_rank() == 0:
        shutil.rmtree(path)  # a save of this step that was killed before checkpoint.pt named it
    torch.distributed.barrier()
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer))
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_writer(path))
    return name


def _writer(path: Path):
    """torch's FileSystemWriter, with GPT2KIT_KILL_AT=sharded-save's point (gpt2kit._io.kill_point)
    between the ranks' shards and the coordinator's .metadata: what a kill mid-save leaves."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def finish(self, metadata, results) -> None:
            kill_point("sharded-save")
            super().finish(metadata, results)

    return Writer(str(path))


def load_sharded(model: nn.Module, optimizer: Any, out: Path, name: str) -> None:
    """Restore save_sharded's model and optimizer shards into the sharded model (all ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = out / name
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: the sharded checkpoint checkpoint.pt names is missing")
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, _optimizers(optimizer), model_state_dict=state["model"], optim_state_dict=state["optim"])


def remove_older(out: Path, keep: str) -> None:
    """Rank 0, after checkpoint.pt names `keep`: the other sharded checkpoints go."""
    for p in out.glob(f"{DCP_PREFIX}*{DCP_SUFFIX}"):
        if p.name != keep and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def full_model(loss_model: nn.Module, raw: nn.Module) -> nn.Module | None:
    """The whole model, gathered to rank 0 (a plain GPT2 there, None elsewhere); all ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(loss_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return None
    with torch.device("meta"):
        model = GPT2(raw.config)
    model.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()}, strict=True, assign=True)
    return model
