"""Checkpoint loading and saving for every published GPT-2 format (see checkpoint/api.py).

This package's `__init__` only re-exports, lazily: api.py holds the entry points (torch), info.py
what the headers say (torch-free: `describe`, `holds_model`), source.py where a name points,
hf.py / openai_tf.py / hub.py / quantized.py the readers and writers, contract.py the one reader
contract and strict check, keymap.py the one name table. `from gpt2kit.checkpoint import describe`
therefore imports no torch (`gpt2kit info` reads headers in a fraction of a second).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {"CheckpointError": "gpt2kit.checkpoint.errors", "describe": "gpt2kit.checkpoint.info",
          "holds_model": "gpt2kit.checkpoint.info", "resolve_source": "gpt2kit.checkpoint.source",
          "resolve_dtype": "gpt2kit.devices", "load_model": "gpt2kit.checkpoint.api",
          "load_state": "gpt2kit.checkpoint.api", "load_tokenizer": "gpt2kit.checkpoint.api",
          "quantize_checkpoint": "gpt2kit.checkpoint.api", "save_model": "gpt2kit.checkpoint.api",
          "apply_adapter": "gpt2kit.checkpoint.adapter", "merge_adapter": "gpt2kit.checkpoint.api",
          "read_adapter": "gpt2kit.checkpoint.adapter", "save_adapter": "gpt2kit.checkpoint.adapter"}

__all__ = ["CheckpointError", "apply_adapter", "describe", "holds_model", "load_model", "load_state", "load_tokenizer",
           "merge_adapter", "quantize_checkpoint", "read_adapter", "resolve_dtype", "resolve_source", "save_adapter",
           "save_model"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'gpt2kit.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:
    from gpt2kit.checkpoint.adapter import apply_adapter, read_adapter, save_adapter
    from gpt2kit.checkpoint.api import (
        load_model,
        load_state,
        load_tokenizer,
        merge_adapter,
        quantize_checkpoint,
        save_model,
    )
    from gpt2kit.checkpoint.errors import CheckpointError
    from gpt2kit.checkpoint.info import describe, holds_model
    from gpt2kit.checkpoint.source import resolve_source
    from gpt2kit.devices import resolve_dtype
