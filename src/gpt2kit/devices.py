"""Dtype and device names (from flags, configs, users) -> torch objects: the one table of each.

Every module that takes a dtype or device from a user resolves it here, so the same names are
accepted everywhere and a device that is not there fails with one clear line before any work.
"""

from __future__ import annotations

import torch

from gpt2kit.config import DTYPE_NAMES
from gpt2kit.decode.plain import bfloat16_decodes_faster

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str | None = None) -> torch.dtype | None:
    """A floating torch.dtype for a name ("bf16", "torch.float32", ...) or dtype; None stays None.

    "auto" is the fastest dtype for decoding on `device` within bfloat16's accuracy: bfloat16 on a GPU
    that supports it, else float32; on CPU bfloat16 where a measurement of decode-sized products on
    this machine finds it faster than float32 for one row and for 8 rows alike
    (decode.plain.bfloat16_decodes_faster), else float32."""
    if isinstance(dtype, str) and dtype.lower() == "auto":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        if dev.type != "cpu":
            return torch.float32
        return torch.bfloat16 if bfloat16_decodes_faster() else torch.float32
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid choices: auto, float32, bfloat16, float16")
    return DTYPES[key]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """A torch.device that exists on this machine (default cpu); ValueError naming what is missing."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; expected cpu, cuda, cuda:N or mps ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(device)!r} asked for, but {why}; use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist; this machine has {count} CUDA "
                             f"device(s): cuda:0..cuda:{count - 1}")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device {str(device)!r} asked for, but MPS is not available here; use --device cpu")
    return dev
