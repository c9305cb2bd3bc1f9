"""Data-parallel set-up for training: the one module that knows about torch.distributed.

torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; `setup` joins the process group (NCCL on CUDA, gloo
otherwise) and picks this rank's device; `Dist` carries the few collectives the training loop needs
and `print0` prints on rank 0 only (llm.c's name). With one process everything here is a no-op.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # we initialised the process group, so we destroy it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def print0(self, text: str) -> None:
        """One line on stderr, from rank 0 only, flushed (so logs interleave in order)."""
        if self.master:
            print(text, file=sys.stderr, flush=True)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce a tensor by summing over ranks (in place; a no-op with one process)."""
        if self.enabled:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t

    def gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()


def setup(device_arg: str | None) -> Dist:
    """This process's rank and device; joins the process group when torchrun started several."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg is None:
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_arg)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if world_size > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        owns = True
    return Dist(rank, local_rank, world_size, device, owns)


def teardown(d: Dist) -> None:
    if d.owns_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
