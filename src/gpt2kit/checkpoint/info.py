"""What a checkpoint holds, from its headers alone (torch-free): the strict header check every
loader runs first, and `describe`, what `gpt2kit info` prints.

Every answer here is arithmetic on headers (safetensors' JSON header, the TF index, config.json):
no tensor data is read and torch is not imported (a .bin, which has no header, is the exception),
so describing any checkpoint takes a fraction of a second whatever its config claims.
"""

from __future__ import annotations

import os
from pathlib import Path

import gpt2kit.checkpoint.hf as hf
import gpt2kit.checkpoint.int8_format as int8_format
import gpt2kit.checkpoint.openai_tf as openai_tf
from gpt2kit.checkpoint.contract import TensorInfo, check
from gpt2kit.checkpoint.hf import DTYPE_BYTES
from gpt2kit.checkpoint.source import resolve_source
from gpt2kit.config import GPT2Config

__all__ = ["describe", "holds_model", "read_checked_header", "reader"]


def reader(kind: str):
    """(the reader module, its config file's name) for a source kind from resolve_source."""
    return (hf, "config.json") if kind == "hf" else (openai_tf, "hparams.json")


def read_checked_header(name_or_path: str | os.PathLike[str]
                        ) -> tuple[str, Path, GPT2Config, dict[str, TensorInfo]]:
    """(kind, directory, config, {our name: TensorInfo}) of a float checkpoint, checked strictly;
    no tensor data is read."""
    kind, path = resolve_source(name_or_path)
    module, config_file = reader(kind)
    config, infos = module.read_header(path)
    check(config, infos, path, config_file)
    return kind, path, config, infos


def holds_model(path: str | os.PathLike[str]) -> bool:
    """Whether a directory holds a model (config, weights or an OpenAI release) a save would replace."""
    p = Path(path)
    return p.is_dir() and any(hf.is_model_file(f.name) or f.name in ("hparams.json", "checkpoint")
                              or f.name.startswith("model.ckpt") for f in p.iterdir())


def describe(name_or_path: str | os.PathLike[str]) -> dict:
    """What `gpt2kit info` prints: source kind, directory, config, parameter count, dtype, the
    weights' bytes as stored, files and quantization.

    `parameters` is the float model's count for an int8 checkpoint too (an int8 code is the weight
    it stands for; a scale is not a parameter); `weight_bytes` is what the tensors take as stored
    (int8 codes, scales and float tensors), `dtype` the float tensors' dtype, `parameters_by_dtype`
    the parameters held in each dtype (an int8 checkpoint's matrices under "int8")."""
    kind, path = resolve_source(name_or_path)
    scheme = int8_format.read_scheme(path) if kind == "hf" else None
    if scheme is not None:
        config, _, infos = int8_format.read_header(path)
    else:
        kind, path, config, infos = read_checked_header(path)
    weights = {k: i for k, i in infos.items() if not (scheme and k.endswith(".scale"))}
    dtypes = sorted({i.dtype for i in weights.values() if i.dtype != "int8"})
    by_dtype: dict[str, int] = {}
    for i in weights.values():
        by_dtype[i.dtype] = by_dtype.get(i.dtype, 0) + i.numel
    files = sorted(f.name for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    return {
        "source": "huggingface" if kind == "hf" else "openai-tf",
        "path": str(path),
        "config": dict(config.__dict__),
        "parameters": sum(i.numel for i in weights.values()),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "parameters_by_dtype": dict(sorted(by_dtype.items())),
        "weight_bytes": sum(i.numel * DTYPE_BYTES.get(i.dtype, 4) for i in infos.values()),
        "files": {f: (path / f).stat().st_size for f in files},
        "quantization": scheme,
    }
