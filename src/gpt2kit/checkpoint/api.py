"""Loading and saving checkpoints: one entry point that recognises every published GPT-2 format.

`load_model(name_or_path)` accepts
1. an HF-format directory (config.json + safetensors / sharded safetensors / pytorch_model.bin),
2. a Hugging Face hub id (downloaded or taken from the local cache through huggingface_hub),
3. OpenAI's original release directory (hparams.json + model.ckpt.*), read without TensorFlow.

Loading is strict and all-or-nothing: the checkpoint's headers are checked against the config
before any tensor is read or any model built, then every tensor is read and checked again, so a
missing, unexpected or mis-shaped tensor raises CheckpointError naming the file and the tensor,
and no half-loaded model is ever returned.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

import gpt2kit.checkpoint.hf as hf
import gpt2kit.checkpoint.quantized as quantized
from gpt2kit._io import no_space_error, out_of_space, same_path
from gpt2kit.checkpoint.adapter import apply_adapter, read_adapter
from gpt2kit.checkpoint.contract import TensorInfo, check, check_finite
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.info import describe, holds_model, read_checked_header, reader
from gpt2kit.checkpoint.source import HUB_NAMES, resolve_source
from gpt2kit.config import GPT2Config
from gpt2kit.decode.layout import use_decode_layout
from gpt2kit.devices import resolve_device, resolve_dtype
from gpt2kit.model import GPT2
from gpt2kit.quant.modules import SCALE_DTYPES, check_scheme, is_quantized, quantize_model, weight_bytes
from gpt2kit.tokenizer import Tokenizer

__all__ = ["HUB_NAMES", "describe", "holds_model", "load_model", "load_state", "load_tokenizer",
           "merge_adapter", "quantize_checkpoint", "read_checked_header", "resolve_source", "save_model"]

# OpenAI's four released sizes under both hub names: one vocabulary, the one packaged in gpt2kit/vocab,
# so their tokenizer never needs the hub.
GPT2_TOKENIZER_NAMES = frozenset(n for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
                                  for n in (size, f"openai-community/{size}"))


def _refuse_int8(path: Path) -> None:
    # Float state dicts (training, load_state) cannot come from int8 codes: say so, in one line.
    raise CheckpointError(f"{path}: holds an int8-quantized model (gpt2kit quantize), which is for inference "
                          "only; training needs the float checkpoint it was made from")


def load_state(name_or_path: str | os.PathLike[str]) -> tuple[GPT2Config, dict[str, torch.Tensor], Path]:
    """The config and our full, checked state dict of any loadable float checkpoint (CPU tensors):
    names, shapes and dtypes checked against the config from the headers first, then the data,
    and every floating tensor finite."""
    kind, path = resolve_source(name_or_path)
    if kind == "hf" and quantized.read_scheme(path) is not None:
        _refuse_int8(path)
    kind, path, config, infos = read_checked_header(path)
    module, config_file = reader(kind)
    state = module.read_tensors(path)
    loaded = {k: TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), infos[k].file if k in infos
                            else "?") for k, t in state.items()}
    check(config, loaded, path, config_file)  # the data must say what its header said
    check_finite(state, {k: path / i.file for k, i in loaded.items()})
    return config, state, path


def load_model(name_or_path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None, allow_int8: bool = True,
               adapter: str | os.PathLike[str] | None = None) -> GPT2:
    """A GPT2 in eval mode from any published checkpoint (float32 unless dtype is given; "auto": the
    fastest within bfloat16's accuracy on this device, see devices.resolve_dtype).

    adapter: a LoRA adapter directory in peft's format (gpt2kit train --lora-rank, or peft's
    save_pretrained), merged into the weights (checkpoint/adapter.py); one made for a base of other
    shapes is refused naming the tensor.

    An int8 checkpoint (gpt2kit quantize) loads as the quantized model; with allow_int8=False
    (training) it is refused as load_state refuses it, before any tensor is read. A floating
    tensor holding NaN or infinity, as stored or once cast to dtype, is refused naming it."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device) or torch.float32
    kind, path = resolve_source(name_or_path)
    if kind == "hf" and quantized.read_scheme(path) is not None:
        if not allow_int8:
            _refuse_int8(path)
        if adapter is not None:
            raise CheckpointError(f"{path}: an adapter needs the float base, this is an int8 checkpoint; load the "
                                  "float model with the adapter (then --quantize int8 if wanted)")
        return quantized.load(path, dtype, device)  # int8 weights (gpt2kit quantize)
    config, state, _ = load_state(path)
    with torch.device("meta"):
        model = GPT2(config)
    cast = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    check_finite({k: v for k, v in cast.items() if v.dtype != state[k].dtype}, dict.fromkeys(cast, path),
                 f" once cast to {str(dtype).removeprefix('torch.')} (out of its range)")
    model.load_state_dict(cast, strict=True, assign=True)
    if adapter is not None:
        apply_adapter(model, adapter, merge=True)
    return use_decode_layout(model.eval())  # the layout CPU decode kernels read fastest (decode/layout.py)


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The checkpoint's own vocab files when it has them, else GPT-2's packaged ones.

    A published GPT-2 name (GPT2_TOKENIZER_NAMES) that is not a local path gets the packaged files
    without asking the hub: they are the files those repos publish, so this works offline."""
    if name_or_path is None:
        return Tokenizer.default()
    raw = os.fspath(name_or_path)
    if raw in GPT2_TOKENIZER_NAMES and not os.path.lexists(Path(raw).expanduser()):
        return Tokenizer.default()
    _, path = resolve_source(name_or_path)
    return Tokenizer.from_dir(path)


def save_model(model: GPT2, directory: str | os.PathLike[str], *, tokenizer: Tokenizer | None = None) -> Path:
    """Write an HF-format directory that transformers and the HF ecosystem load unchanged.

    The directory is replaced atomically (built beside it, then swapped in): an existing model
    there is replaced whole or, on any failure, left as it was. Other files in it are kept. An
    int8-quantized model is written in gpt2kit's own int8 format (checkpoint/quantized.py)."""
    if is_quantized(model):
        return quantized.save(model, directory, tokenizer=tokenizer)
    return hf.save_hf_dir(model, directory, tokenizer=tokenizer)


def quantize_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str], scheme: str = "int8", *,
                        lm_head: bool = True, scale_dtype: str = "float32", overwrite: bool = False,
                        progress: Callable[[str], object] | None = None) -> dict:
    """Write an int8 weight-only copy of the float checkpoint `src` into `dst` (docs/quantization.md).

    Refused before anything is loaded: `dst` holding a model unless `overwrite`, and `dst` being
    `src` (through a symlink or another spelling too) even with `overwrite`, since the float
    weights would be lost. `progress`, if given, is called with each stage's name (the CLI's
    status line). Returns {"path", "float_bytes", "int8_bytes"}."""
    check_scheme(scheme)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale dtype {scale_dtype!r}; valid choices: {', '.join(SCALE_DTYPES)}")
    out = Path(dst).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{dst}: exists and is not a directory")
    local = Path(src).expanduser()
    if local.exists():
        _refuse_same(local, out, dst)
    if holds_model(out) and not overwrite:
        raise FileExistsError(f"{dst} already holds a model; pass --overwrite (overwrite=True) to replace it")
    _, path = resolve_source(src)
    _refuse_same(path, out, dst)  # a hub id resolves to its cache directory
    stage = progress or (lambda _: None)
    stage(f"loading {src}")
    model = load_model(path)
    float_bytes = weight_bytes(model)
    stage(f"quantizing to {scheme}")
    quantize_model(model, scheme, lm_head=lm_head, scale_dtype=scale_dtype)
    stage(f"writing {dst}")
    written = save_model(model, out, tokenizer=load_tokenizer(path))
    return {"path": written, "float_bytes": float_bytes, "int8_bytes": weight_bytes(model)}


def merge_adapter(base: str | os.PathLike[str], adapter: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                  dtype: str | None = None, overwrite: bool = False) -> Path:
    """`gpt2kit merge`: write base + adapter, merged, as a plain HF model directory (atomically).

    Refused before anything is loaded: dst holding a model unless overwrite, and dst being the base
    or the adapter directory (whose files would be replaced). A full disk is said about dst, which
    is left as it was (atomic_directory)."""
    out = Path(dst).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{dst}: exists and is not a directory")
    if holds_model(out) and not overwrite:
        raise FileExistsError(f"{dst} already holds a model; pass --overwrite (overwrite=True) to replace it")
    read_adapter(adapter)  # a bad adapter fails before the base loads
    _, src = resolve_source(base)
    for what, path in (("base model", src), ("adapter", Path(adapter).expanduser())):
        if same_path(path, out):
            raise ValueError(f"{dst} is the {what}; write the merged model to another directory")
    model = load_model(src, dtype=dtype, adapter=adapter, allow_int8=False)
    try:
        return save_model(model, out, tokenizer=load_tokenizer(src))
    except Exception as e:
        if out_of_space(e, out.parent):  # said about OUT, not the staging directory beside it
            raise no_space_error(out, "writing the merged model", f"nothing was written to {dst}") from None
        raise


def _refuse_same(src: Path, out: Path, dst: str | os.PathLike[str]) -> None:
    if same_path(src, out):
        raise ValueError(f"{dst} is the source being quantized; its float weights would be lost: "
                         "write to another directory")


