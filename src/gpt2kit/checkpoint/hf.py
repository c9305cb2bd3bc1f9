"""Hugging Face layout: read a directory's config.json + weights, and write one that everyone reads.

Weights come as model.safetensors, sharded safetensors with model.safetensors.index.json, or
pytorch_model.bin (read with weights_only=True), keys with or without the `transformer.` prefix.
Readers keep the contract of checkpoint/contract.py: `read_header` (shapes from the safetensors
headers, no tensor data) and `read_tensors`, both keyed by our names in our layout.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, TypeVar

import torch

from gpt2kit._io import atomic_directory, atomic_write_path, atomic_write_text
from gpt2kit.checkpoint.contract import TensorInfo
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.keymap import HF_SKIPPED, HF_TIED, hf_to_ours, is_transposed, to_hf_state
from gpt2kit.config import GPT2Config
from gpt2kit.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gpt2kit.model import GPT2

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)

# What makes up a model in a directory: replaced as a whole by a save; anything else in the
# directory (a training run's checkpoint.pt, metrics, notes) is carried over untouched.
_MODEL_FILE = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|model\.int8\.safetensors"  # gpt2kit's int8 format (checkpoint/quantized.py)
    r"|pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json|vocab\.json|merges\.txt"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json)$")

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}

T = TypeVar("T")


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def is_model_file(name: str) -> bool:
    """A file name that belongs to an HF model directory (weights, config, tokenizer)."""
    return bool(_MODEL_FILE.match(name))


def read_header(path: Path) -> tuple[GPT2Config, dict[str, TensorInfo]]:
    """The config and every tensor's shape (our layout) and dtype, from the files' headers only."""
    config = GPT2Config.from_hf(path / "config.json")
    infos, tied = _collect(path, _file_header)
    ours = {name: TensorInfo(_our_shape(name, shape), dtype, file) for name, ((shape, dtype), file) in infos.items()}
    for key, ((shape, _), file) in tied.items():
        wte = ours.get("wte.weight")
        if wte is not None and tuple(shape) != wte.shape:
            raise CheckpointError(f"{path / file}: {key} has shape {tuple(shape)}, the token embedding "
                                  f"{wte.shape}; GPT-2 ties the LM head to wte")
    return config, ours


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor, renamed to our names and laid out as nn.Linear holds them."""
    tensors, tied = _collect(path, _read_weight_file)
    out = {name: (t.t() if is_transposed(name) and t.dim() == 2 else t) for name, (t, _) in tensors.items()}
    for key, (head, file) in tied.items():
        wte = out.get("wte.weight")
        if wte is not None and (head.shape != wte.shape or not torch.equal(head, wte)):
            raise CheckpointError(
                f"{path / file}: {key} differs from the token embedding; GPT-2 ties the LM head to wte "
                "and gpt2kit cannot load an untied head")
    return out


def _our_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(shape)) if is_transposed(name) and len(shape) == 2 else tuple(shape)


def _collect(path: Path, read_one: Callable[[Path], dict[str, T]]
             ) -> tuple[dict[str, tuple[T, str]], dict[str, tuple[T, str]]]:
    """({our name: (value, file)}, {tied head key: (value, file)}) over every weight file."""
    ours: dict[str, tuple[T, str]] = {}
    tied: dict[str, tuple[T, str]] = {}
    for file in _weight_files(path):
        rel = file.relative_to(path).as_posix()
        for key, value in read_one(file).items():
            if HF_SKIPPED.match(key):
                continue
            if key in HF_TIED:
                tied[key] = (value, rel)
                continue
            name = hf_to_ours(key)
            if name in ours:
                raise CheckpointError(f"{file}: tensor {name} appears twice (with and without the transformer. "
                                      f"prefix, or in two shards: {ours[name][1]} and {rel})")
            ours[name] = (value, rel)
    return ours, tied


def _weight_files(path: Path) -> list[Path]:
    for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        index = path / index_name
        if index.is_file():
            return _shards(path, index)
    for name in (SAFETENSORS, TORCH_BIN):
        if (path / name).is_file():
            return [path / name]
    raise CheckpointError(
        f"{path}: no weights found; expected one of {', '.join(WEIGHT_FILES)} next to config.json")


def _shards(path: Path, index: Path) -> list[Path]:
    """The shard files an index names, each checked to lie inside the checkpoint directory."""
    require_readable(index)
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid shard index ({type(e).__name__}: {e})") from None
    files = []
    for name in dict.fromkeys(weight_map.values()):
        rel = PurePosixPath(name)
        # Lexical, not resolved: the hub cache's snapshot files are symlinks into ../../blobs.
        if rel.is_absolute() or ".." in rel.parts or "\\" in name or not rel.parts or Path(name).is_absolute():
            raise CheckpointError(f"{index}: shard {name!r} lies outside the checkpoint directory; refusing it")
        files.append(path.joinpath(*rel.parts))
    missing = [f.relative_to(path).as_posix() for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
    return files


def require_readable(file: Path) -> None:
    """CheckpointError for a file that cannot be read or is empty, saying which of the two."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    if not os.access(file, os.R_OK):
        raise CheckpointError(f"{file}: exists but cannot be read (permission denied)")
    if size == 0:
        raise CheckpointError(f"{file}: empty file (0 bytes); the checkpoint was not written completely")


def _file_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    require_readable(file)
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(file, framework="pt") as f:
                out = {}
                for key in f.keys():  # safe_open is not a dict
                    s = f.get_slice(key)
                    out[key] = (tuple(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype().lower()))
                return out
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None
    # A .bin has no header: map it (tensor data is paged in only if touched) and read the shapes.
    data = _torch_load(file, mmap=True)
    return {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in data.items()}


def _read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    require_readable(file)
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None
    return _torch_load(file, mmap=False)


def _torch_load(file: Path, *, mmap: bool) -> dict[str, torch.Tensor]:
    try:
        try:
            data = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            data = torch.load(file, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped
    except Exception as e:  # torch.load raises many types for bad pickles and zip archives
        raise CheckpointError(f"{file}: cannot read PyTorch weights ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError(f"{file}: expected a state dict of tensors")
    return data


def save_hf_dir(model: GPT2, directory: str | os.PathLike[str], tokenizer: Tokenizer | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files.

    Keys and layouts are the ones transformers' GPT2LMHeadModel.save_pretrained writes, so
    transformers, vLLM, TGI and llama.cpp's converter read the directory unchanged. The files are
    written into a sibling directory that then replaces `directory` in one step (see
    `_io.atomic_directory`): an existing model there is replaced whole or, if anything fails, not
    at all. Files in `directory` that are not part of a model are kept."""
    from safetensors.torch import save_file

    cfg: GPT2Config = model.config
    state = to_hf_state(model.state_dict(), cfg)
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    hf_config = cfg.to_hf() | {"torch_dtype": dtype}
    d = Path(directory)
    with atomic_directory(d, keep=lambda name: not is_model_file(name)) as stage:
        atomic_write_path(stage / SAFETENSORS, lambda p: save_file(state, p, metadata={"format": "pt"}))
        atomic_write_text(stage / "generation_config.json",
                          json.dumps({"bos_token_id": cfg.eot_id, "eos_token_id": cfg.eot_id}, indent=2) + "\n")
        (tokenizer or Tokenizer.default()).save(stage)
        atomic_write_text(stage / "config.json", json.dumps(hf_config, indent=2) + "\n")
    return d
