"""Checkpoint loading and saving: one entry point that recognises every published GPT-2 format.

`load_model(name_or_path)` accepts
1. an HF-format directory (config.json + safetensors / sharded safetensors / pytorch_model.bin),
2. a Hugging Face hub id (downloaded or taken from the local cache through huggingface_hub),
3. OpenAI's original release directory (hparams.json + model.ckpt.*), read without TensorFlow.

Loading is strict and all-or-nothing: every tensor is read and checked (names and shapes) before
the model is built, so a missing, unexpected or mis-shaped tensor raises CheckpointError naming the
file and the tensor, and no half-loaded model is ever returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.config import GPT2Config

__all__ = ["CheckpointError", "describe", "load_model", "load_state", "load_tokenizer", "resolve_dtype",
           "resolve_source", "save_model"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid choices: float32, bfloat16, float16")
    return _DTYPES[key]


def resolve_source(name_or_path: str | os.PathLike[str]) -> tuple[str, Path]:
    """('hf' | 'openai', local directory) for a path or hub id; downloads hub ids."""
    from gpt2kit.checkpoint import hub
    from gpt2kit.checkpoint.hf import is_hf_dir
    from gpt2kit.checkpoint.openai_tf import is_openai_dir

    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: expected a checkpoint directory, got a file")
        if is_hf_dir(path):
            return "hf", path
        if is_openai_dir(path):
            return "openai", path
        raise CheckpointError(
            f"{path}: not a GPT-2 checkpoint directory (no config.json for the HF layout, "
            "no hparams.json for OpenAI's release)")
    name = str(name_or_path)
    if not hub.looks_like_hub_id(name) or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name}: no such directory")
    return "hf", hub.download(name)


def load_state(name_or_path: str | os.PathLike[str]) -> tuple[GPT2Config, dict[str, torch.Tensor], Path]:
    """The config and our full, checked state dict of any loadable checkpoint (CPU tensors)."""
    from gpt2kit.checkpoint import hf, openai_tf
    from gpt2kit.model import GPT2

    kind, path = resolve_source(name_or_path)
    if kind == "hf":
        config, raw = hf.read_hf_dir(path)
    else:
        config, raw = openai_tf.read_openai_dir(path)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in GPT2(config).state_dict().items()}
    if kind == "hf":
        state = hf.to_ours(config, raw, expected)
        files = {hf.hf_to_ours(k): f for k, (_, f) in raw.items()}
    else:
        state = {k: t for k, (t, _) in raw.items()}
        files = {k: f for k, (_, f) in raw.items()}
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            raise CheckpointError(f"{path}: unexpected tensor(s): {', '.join(unexpected)}")
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s): {', '.join(missing)}")
    for k, shape in expected.items():
        if state[k].shape != shape:
            raise CheckpointError(
                f"{path / files.get(k, '')}: tensor {k} has shape {tuple(state[k].shape)}, "
                f"the config needs {tuple(shape)}")
        if not state[k].dtype.is_floating_point:
            raise CheckpointError(f"{path / files.get(k, '')}: tensor {k} has dtype {state[k].dtype}")
    return config, state, path


def load_model(name_or_path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None):
    """A GPT2 in eval mode from any published checkpoint (float32 unless dtype is given)."""
    from gpt2kit.decode.layout import use_decode_layout
    from gpt2kit.model import GPT2

    dtype = resolve_dtype(dtype) or torch.float32
    device = torch.device(device) if device is not None else torch.device("cpu")
    config, state, _ = load_state(name_or_path)
    with torch.device("meta"):
        model = GPT2(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return use_decode_layout(model.eval())  # the layout CPU decode kernels read fastest (decode/layout.py)


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None):
    """The checkpoint's own vocab files when it has them, else GPT-2's packaged ones."""
    from gpt2kit.tokenizer import Tokenizer

    if name_or_path is None:
        return Tokenizer.default()
    _, path = resolve_source(name_or_path)
    return Tokenizer.from_dir(path)


def save_model(model, directory: str | os.PathLike[str], *, tokenizer=None) -> Path:
    """Write an HF-format directory that transformers and the HF ecosystem load unchanged."""
    from gpt2kit.checkpoint.hf import save_hf_dir

    return save_hf_dir(model, directory, tokenizer=tokenizer)


def describe(name_or_path: str | os.PathLike[str]) -> dict:
    """What `gpt2kit info` prints: source kind, directory, config, parameter count, dtypes, files."""
    kind, path = resolve_source(name_or_path)
    config, state, _ = load_state(path)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    files = sorted(f.name for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    return {
        "source": "huggingface" if kind == "hf" else "openai-tf",
        "path": str(path),
        "config": {k: v for k, v in config.__dict__.items()},
        "parameters": sum(t.numel() for t in state.values()),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "files": {f: (path / f).stat().st_size for f in files},
    }
