"""Hugging Face layout: read a directory's config.json + weights, and write one that everyone reads.

Weights come as model.safetensors, sharded safetensors with model.safetensors.index.json, or
pytorch_model.bin (read with weights_only=True), keys with or without the `transformer.` prefix.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from gpt2kit._io import file_mode
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.keymap import HF_SKIPPED, HF_TIED, hf_to_ours, is_transposed, ours_to_hf
from gpt2kit.config import GPT2Config

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def read_hf_dir(path: Path) -> tuple[GPT2Config, dict[str, tuple[torch.Tensor, str]]]:
    """The config and every tensor of an HF directory, as {our name: (tensor, source file)}.

    Tensors keep the checkpoint's layout (the Conv1D matrices are still (in, out)); convert with
    `to_ours`."""
    config = GPT2Config.from_hf(path / "config.json")
    tensors: dict[str, tuple[torch.Tensor, str]] = {}
    for file in _weight_files(path):
        for key, t in _read_weight_file(file).items():
            if HF_SKIPPED.match(key):
                continue
            tensors[key] = (t, file.name)
    return config, tensors


def to_ours(config: GPT2Config, tensors: dict[str, tuple[torch.Tensor, str]],
            expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Rename and transpose HF tensors into our state dict, failing loudly on any mismatch."""
    out: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, (t, file) in tensors.items():
        if key in HF_TIED:
            continue
        name = hf_to_ours(key)
        if name not in expected:
            unexpected.append(f"{key} ({file})")
            continue
        if name in out:
            raise CheckpointError(f"{file}: tensor {key} appears twice (with and without the transformer. prefix)")
        out[name] = t.t() if is_transposed(name) and t.dim() == 2 else t
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in the checkpoint: {', '.join(unexpected)}")
    for key in HF_TIED:
        if key in tensors and "wte.weight" in out:
            head, file = tensors[key]
            wte = out["wte.weight"]
            if head.shape != wte.shape or not torch.equal(head, wte):
                raise CheckpointError(
                    f"{file}: {key} differs from the token embedding; GPT-2 ties the LM head to wte "
                    "and gpt2kit cannot load an untied head")
    return out


def save_hf_dir(model: torch.nn.Module, directory: str | os.PathLike[str], tokenizer=None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files.

    Keys and layouts are the ones transformers' GPT2LMHeadModel.save_pretrained writes, so
    transformers, vLLM, TGI and llama.cpp's converter read the directory unchanged. Every file is
    written to a temporary name first and renamed into place."""
    from safetensors.torch import save_file

    from gpt2kit.tokenizer import Tokenizer

    cfg: GPT2Config = model.config
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {}
    dtype = None
    for name, t in model.state_dict().items():
        if name == "wte.weight":
            t = t[: cfg.n_vocab]  # drop rows padded for speed
        if is_transposed(name):
            t = t.t()
        state[ours_to_hf(name)] = t.detach().to("cpu").contiguous()
        dtype = t.dtype
    _atomic_write(d / SAFETENSORS, lambda p: save_file(state, p, metadata={"format": "pt"}))
    for stale in (SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX):
        (d / stale).unlink(missing_ok=True)  # a leftover would shadow or contradict the new weights
    hf_config = cfg.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    _atomic_write_text(d / "generation_config.json",
                       json.dumps({"bos_token_id": cfg.eot_id, "eos_token_id": cfg.eot_id}, indent=2) + "\n")
    (tokenizer or Tokenizer.default()).save(d)
    # config.json last: it is what marks the directory as a model.
    _atomic_write_text(d / "config.json", json.dumps(hf_config, indent=2) + "\n")
    return d


def _weight_files(path: Path) -> list[Path]:
    for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid shard index ({e})") from None
            files = [path / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
            return files
    for name in (SAFETENSORS, TORCH_BIN):
        if (path / name).is_file():
            return [path / name]
    raise CheckpointError(
        f"{path}: no weights found; expected one of {', '.join(WEIGHT_FILES)} next to config.json")


def _read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for bad pickles and zip archives
        raise CheckpointError(f"{file}: cannot read PyTorch weights ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError(f"{file}: expected a state dict of tensors")
    return data


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())  # mkstemp makes 0600; give the file the mode open() would
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))
