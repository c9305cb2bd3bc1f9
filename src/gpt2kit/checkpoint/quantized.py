"""int8-quantized checkpoints: an HF-style directory whose config.json records the scheme.

Layout: config.json (the HF GPT-2 config plus ``"gpt2kit_quantization": {"scheme": "int8",
"lm_head": bool, "scale_dtype": ...}``), model.int8.safetensors (our own tensor names: each
quantized matrix as ``<name>.weight`` int8 (out, in) and ``<name>.scale`` (out,); the float tensors
as in the model), generation_config.json and the tokenizer files. The weights file is not named
model.safetensors on purpose: transformers and other HF readers then report a missing weights file
instead of loading int8 codes as if they were float weights.

Loading is as strict as every other format: the safetensors header is checked against the config
by arithmetic first (int8_format.py: layer count, names, shapes, dtypes: int8 where the scheme puts
int8), then every tensor is read and checked (finite; scales positive, 127 x scale finite) before
the model is built, so nothing half-loaded is ever returned.
Saving then loading gives the same tensors bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from gpt2kit._io import atomic_directory, atomic_write, atomic_write_text
from gpt2kit.checkpoint.contract import check_finite
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.hf import is_model_file
from gpt2kit.checkpoint.int8_format import KEY, WEIGHTS, read_header, read_scheme
from gpt2kit.config import GPT2Config
from gpt2kit.decode.layout import use_huge_pages
from gpt2kit.model import GPT2
from gpt2kit.quant.modules import quantization, quantized_skeleton
from gpt2kit.tokenizer import Tokenizer

__all__ = ["KEY", "WEIGHTS", "load", "read_scheme", "read_state", "save"]


def _skeleton(config: GPT2Config, scheme: dict):
    with torch.device("meta"):
        return quantized_skeleton(GPT2(config), scheme["lm_head"], scheme["scale_dtype"])


def read_state(path: Path) -> tuple[GPT2Config, dict, dict[str, torch.Tensor]]:
    """(config, scheme, state dict) of a quantized directory: the header checked against the config
    first (int8_format.read_header), then every tensor read and checked to be finite, and every
    scale positive with 127 x scale finite in float32 (the weights it stands for)."""
    config, scheme, infos = read_header(path)
    file = path / WEIGHTS
    try:
        state = load_file(file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None
    if set(state) != set(infos):  # the data must say what its header said
        raise CheckpointError(f"{file}: the tensors read differ from those its header lists")
    check_finite(state, dict.fromkeys(state, file))
    for k, t in state.items():
        if k.endswith(".scale") and not bool(((t > 0) & (t.float() * 127).isfinite()).all()):
            raise CheckpointError(f"{file}: tensor {k} has scales that are not finite and positive "
                                  "(or so large that 127 x scale, the largest weight, overflows float32)")
    return config, scheme, state


def _own(t: torch.Tensor) -> torch.Tensor:
    """t, in memory of its own on 64 bytes where it is not: safetensors packs tensors back to back (an
    int8 matrix can start on 8 mod 16), and ATen's AVX-512 int8 kernel needs 16-byte weight rows, so a
    weight read as it lies in the file would take gpt2kit.decode.int8's slow dequant path."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def load(path: Path, dtype: torch.dtype, device: torch.device):
    """The quantized GPT2 in eval mode: int8 weights as stored, scales in their stored dtype, the
    float tensors (biases, LayerNorms, wpe, an unquantized wte) in dtype, all on device."""
    config, scheme, state = read_state(path)
    model = _skeleton(config, scheme)
    state = {k: _own(v.to(device)) if v.dtype == torch.int8 or k.endswith(".scale")
             else v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if scheme["lm_head"]:
        model.wte.dtype = dtype
    return use_huge_pages(model.eval())  # the int8 matrices on huge pages where the system has them


def save(model, directory: str | os.PathLike[str], tokenizer=None) -> Path:
    """Write a quantized model (gpt2kit.quant.modules) as described in the module doc.

    As every directory save (`_io.atomic_directory`): the files are written into a sibling directory
    that replaces `directory` in one step, so an existing model there (float or int8) is replaced
    whole or, on any failure, left as it was; files that are not part of a model are carried over."""
    scheme = quantization(model)
    assert scheme is not None, "save() is for quantized models"
    cfg: GPT2Config = model.config
    state = {}
    for k, v in model.state_dict().items():
        if k in ("wte.weight", "wte.scale"):
            v = v[: cfg.n_vocab]  # drop rows padded for speed (config.json has no padded size)
        state[k] = v.detach().to("cpu").contiguous()
    floats = sorted({str(v.dtype).removeprefix("torch.") for k, v in state.items()
                     if v.dtype.is_floating_point and not k.endswith(".scale")})
    blob = safetensors_bytes(state, metadata={"format": "pt", KEY: scheme["scheme"]})
    hf_config = cfg.to_hf() | {"torch_dtype": floats[0] if len(floats) == 1 else "float32", KEY: scheme}
    generation = {"bos_token_id": cfg.eot_id, "eos_token_id": cfg.eot_id}
    d = Path(directory)
    # a float model's files left beside the int8 one would contradict it: they are not carried over
    with atomic_directory(d, keep=lambda name: not is_model_file(name)) as stage:
        atomic_write(stage / WEIGHTS, lambda f: f.write(blob))
        atomic_write_text(stage / "generation_config.json", json.dumps(generation, indent=2) + "\n")
        (tokenizer or Tokenizer.default()).save(stage)
        atomic_write_text(stage / "config.json", json.dumps(hf_config, indent=2) + "\n")
    return d
