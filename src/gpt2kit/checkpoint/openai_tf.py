"""OpenAI's original release directory: hparams.json + model.ckpt.{index,data-00000-of-00001}.

Read without TensorFlow through tf_bundle. Variables are model/wte, model/wpe, model/ln_f/{g,b} and
model/h{i}/{ln_1,attn/c_attn,attn/c_proj,ln_2,mlp/c_fc,mlp/c_proj}/{g,b,w}; the conv1d weights are
stored [1, in, out].
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.keymap import is_transposed, tf_to_ours
from gpt2kit.checkpoint.tf_bundle import read_tf_checkpoint
from gpt2kit.config import GPT2Config


def is_openai_dir(path: Path) -> bool:
    return (path / "hparams.json").is_file()


def checkpoint_prefix(path: Path) -> Path:
    """The checkpoint prefix named by the `checkpoint` file, else model.ckpt."""
    marker = path / "checkpoint"
    if marker.is_file():
        for line in marker.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model_checkpoint_path":
                name = value.strip().strip('"')
                return Path(name) if Path(name).is_absolute() else path / name
    return path / "model.ckpt"


def read_openai_dir(path: Path) -> tuple[GPT2Config, dict[str, tuple[torch.Tensor, str]]]:
    """The config and every tensor, renamed to our names and laid out as nn.Linear holds them."""
    config = GPT2Config.from_openai(path / "hparams.json")
    prefix = checkpoint_prefix(path)
    if not Path(str(prefix) + ".index").is_file():
        raise CheckpointError(f"{prefix}.index: no such file (the TF checkpoint index of {path})")
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for tf_name, array in read_tf_checkpoint(prefix).items():
        name = tf_to_ours(tf_name)
        if name is None:
            raise CheckpointError(f"{prefix}.index: unexpected variable {tf_name} in the checkpoint")
        t = torch.from_numpy(array)
        if is_transposed(name):
            if t.dim() != 3 or t.shape[0] != 1:
                raise CheckpointError(f"{prefix}: variable {tf_name} has shape {tuple(t.shape)}, expected [1, in, out]")
            t = t[0].t()  # [1, in, out] -> (out, in)
        out[name] = (t, f"{prefix.name}.data")
    return config, out
