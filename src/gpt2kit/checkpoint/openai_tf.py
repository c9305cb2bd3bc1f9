"""OpenAI's original release directory: hparams.json + model.ckpt.{index,data-00000-of-00001}.

Read without TensorFlow through tf_bundle. Variables are model/wte, model/wpe, model/ln_f/{g,b} and
model/h{i}/{ln_1,attn/c_attn,attn/c_proj,ln_2,mlp/c_fc,mlp/c_proj}/{g,b,w}; the conv1d weights are
stored [1, in, out]. Keeps the reader contract of checkpoint/contract.py: `read_header` (from the
index only) and `read_tensors`, keyed by our names in our layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpt2kit.checkpoint.contract import TensorInfo
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.keymap import is_transposed, tf_to_ours
from gpt2kit.checkpoint.tf_bundle import checkpoint_prefix, list_tf_checkpoint, read_tf_checkpoint
from gpt2kit.config import GPT2Config

if TYPE_CHECKING:
    import torch  # imported where tensors are read: the header (gpt2kit info) needs none

__all__ = ["checkpoint_prefix", "is_openai_dir", "read_header", "read_tensors"]


def is_openai_dir(path: Path) -> bool:
    return (path / "hparams.json").is_file()


def _prefix(path: Path) -> Path:
    prefix = checkpoint_prefix(path)
    if not Path(f"{prefix}.index").is_file():
        raise CheckpointError(f"{prefix}.index: no such file (the TF checkpoint index of {path})")
    return prefix


def _our_name(prefix: Path, tf_name: str, shape: tuple[int, ...]) -> str:
    name = tf_to_ours(tf_name)
    if name is None:
        raise CheckpointError(f"{prefix}.index: unexpected variable {tf_name} in the checkpoint")
    if is_transposed(name) and (len(shape) != 3 or shape[0] != 1):
        raise CheckpointError(f"{prefix}: variable {tf_name} has shape {tuple(shape)}, expected [1, in, out]")
    return name


def read_header(path: Path) -> tuple[GPT2Config, dict[str, TensorInfo]]:
    """The config and every tensor's shape (our layout) and dtype, from the index alone."""
    config = GPT2Config.from_openai(path / "hparams.json")
    prefix = _prefix(path)
    out = {}
    for tf_name, (shape, dtype) in list_tf_checkpoint(prefix).items():
        name = _our_name(prefix, tf_name, shape)
        ours = (shape[2], shape[1]) if is_transposed(name) else tuple(shape)  # [1, in, out] -> (out, in)
        out[name] = TensorInfo(ours, dtype, f"{prefix.name}.data")
    return config, out


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor, renamed to our names and laid out as nn.Linear holds them."""
    import torch

    prefix = _prefix(path)
    out: dict[str, torch.Tensor] = {}
    for tf_name, array in read_tf_checkpoint(prefix).items():
        t = torch.from_numpy(array)
        name = _our_name(prefix, tf_name, tuple(t.shape))
        out[name] = t[0].t() if is_transposed(name) else t  # [1, in, out] -> (out, in)
    return out
