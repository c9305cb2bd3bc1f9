"""The one contract every checkpoint reader keeps, and the one strict check.

A reader gives, for a checkpoint directory, first its header — `{our name: TensorInfo}` with
shapes already in our layout, read without loading any tensor data — and then its tensors,
`{our name: tensor in our layout}`. `check` runs on the header before anything big is read or
built, and again on the loaded tensors: any missing, unexpected, mis-shaped or non-float tensor,
or a config that does not describe the checkpoint, raises CheckpointError naming file and tensor;
`check_finite` then refuses a floating tensor holding NaN or infinity (every reader's data).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.keymap import expected_shapes, layer_count
from gpt2kit.config import GPT2Config

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # in our layout (nn.Linear's (out, in))
    dtype: str  # torch's name without "torch.": float32, bfloat16, int64, ...
    file: str  # the file holding it, relative to the checkpoint directory

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def check(config: GPT2Config, infos: dict[str, TensorInfo], path: Path, config_file: str) -> None:
    """Raise CheckpointError unless `infos` are exactly the tensors `config` implies."""
    found_layers = layer_count(infos)
    if found_layers != config.n_layer:
        # Compared before the expected table is built: a config saying n_layer=1000000 costs nothing.
        raise CheckpointError(
            f"{path / config_file} says n_layer={config.n_layer}, but the weights hold {found_layers} "
            f"layer(s){f' (h.0 .. h.{found_layers - 1})' if found_layers else ''}")
    expected = expected_shapes(config)
    unexpected = sorted(f"{k} ({infos[k].file})" for k in set(infos) - set(expected))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s): {some(unexpected)}")
    missing = [k for k in expected if k not in infos]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s): {some(missing)}")
    for k, shape in expected.items():
        info = infos[k]
        if info.shape != shape:
            raise CheckpointError(
                f"{path / info.file}: tensor {k} has shape {info.shape}, {config_file} implies {shape}")
        if not is_float(info.dtype):
            raise CheckpointError(f"{path / info.file}: tensor {k} has dtype {info.dtype}, expected a float type")


def some(names: list[str], shown: int = 12) -> str:
    """The first names and a count of the rest: one readable line however many there are."""
    more = f" ... and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_finite(state: dict[str, torch.Tensor], where: dict[str, Path], what: str = "") -> None:
    """CheckpointError naming the file and the tensor for a floating tensor that holds NaN or
    infinity (a model built from it computes nan: refused at load, as a wrong shape is)."""
    for k, t in state.items():
        if t.is_floating_point() and not bool(t.isfinite().all()):
            bad = t[~t.isfinite()]
            kinds = "NaN" if bool(bad.isnan().all()) else "infinite" if not bool(bad.isnan().any()) else "NaN/infinite"
            raise CheckpointError(f"{where[k]}: tensor {k} holds {bad.numel():,} {kinds} value(s){what}; "
                                  "a model built from it computes nan")
