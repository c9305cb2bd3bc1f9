"""The int8 checkpoint's header, read and checked without torch (checkpoint/quantized.py reads the data).

config.json records the scheme under ``"gpt2kit_quantization"``; model.int8.safetensors holds each
block matrix (and, with lm_head, wte) as ``<name>.weight`` int8 (out, in) plus ``<name>.scale``
(out,), and the other tensors as the float model has them. What the file must hold follows from
the config by arithmetic (keymap.expected_shapes), so a config.json claiming a million layers is
refused from the layer count alone, before any table is built or any tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpt2kit.checkpoint.contract import TensorInfo, is_float, some
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.hf import INT8_KEY as KEY
from gpt2kit.checkpoint.hf import INT8_WEIGHTS as WEIGHTS
from gpt2kit.checkpoint.hf import safetensors_header
from gpt2kit.checkpoint.keymap import expected_shapes, is_transposed, layer_count
from gpt2kit.config import QUANT_SCALE_DTYPES, GPT2Config, check_scheme

__all__ = ["KEY", "WEIGHTS", "expected_int8", "read_header", "read_scheme"]


def read_scheme(path: Path) -> dict | None:
    """The quantization config.json records for an HF-style directory, or None for a float one."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None  # the float reader reports unreadable configs, with the file and the byte
    q = raw.get(KEY) if isinstance(raw, dict) else None
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{path / 'config.json'}: {KEY} must be an object, got {q!r}")
    try:
        check_scheme(q.get("scheme"))
    except ValueError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    if not isinstance(q.get("lm_head"), bool) or q.get("scale_dtype") not in QUANT_SCALE_DTYPES:
        raise CheckpointError(f"{path / 'config.json'}: {KEY} needs lm_head (true/false) and scale_dtype "
                              f"({', '.join(QUANT_SCALE_DTYPES)}), got {q!r}")
    return q


def expected_int8(config: GPT2Config, scheme: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, "int8" | "scale" | "float")} of the quantized state dict, by arithmetic.

    The four block matrices are the ones keymap calls transposed (c_attn, attn.c_proj, c_fc,
    mlp.c_proj); tests prove the table equals a quantized skeleton's own state dict."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in expected_shapes(config).items():
        if is_transposed(name) or (name == "wte.weight" and scheme["lm_head"]):
            out[name] = (shape, "int8")
            out[name.removesuffix("weight") + "scale"] = ((shape[0],), "scale")
        else:
            out[name] = (shape, "float")
    return out


def read_header(path: Path) -> tuple[GPT2Config, dict, dict[str, TensorInfo]]:
    """(config, scheme, {name: TensorInfo}) of a quantized directory, checked against the config
    from the safetensors header alone: the layer count first, then names, shapes and dtypes."""
    scheme = read_scheme(path)
    if scheme is None:
        raise CheckpointError(f"{path / 'config.json'}: no {KEY} entry; not an int8 checkpoint")
    config = GPT2Config.from_hf(path / "config.json")
    file = path / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{path}: config.json records {scheme['scheme']} quantization but {WEIGHTS} is missing")
    infos = {k: TensorInfo(shape, dtype, WEIGHTS) for k, (shape, dtype) in safetensors_header(file).items()}
    found = layer_count(infos)
    if found != config.n_layer:  # before the expected table is built: n_layer=1000000 costs nothing
        raise CheckpointError(
            f"{path / 'config.json'} says n_layer={config.n_layer}, but {WEIGHTS} holds {found} layer(s)"
            f"{f' (h.0 .. h.{found - 1})' if found else ''}")
    expected = expected_int8(config, scheme)
    missing = [k for k in expected if k not in infos]
    if missing:
        raise CheckpointError(f"{file}: missing tensor(s): {some(missing)}")
    unexpected = sorted(set(infos) - set(expected))
    if unexpected:
        raise CheckpointError(f"{file}: unexpected tensor(s): {some(unexpected)}")
    for k, (shape, kind) in expected.items():
        info = infos[k]
        if info.shape != shape:
            raise CheckpointError(f"{file}: tensor {k} has shape {info.shape}, the config needs {shape}")
        if kind == "int8" and info.dtype != "int8":
            raise CheckpointError(f"{file}: tensor {k} has dtype torch.{info.dtype}, the int8 scheme needs int8")
        if kind != "int8" and not is_float(info.dtype):
            raise CheckpointError(f"{file}: tensor {k} has dtype torch.{info.dtype}, expected a floating-point tensor")
    return config, scheme, infos
