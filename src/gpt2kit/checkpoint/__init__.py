"""Checkpoint loading and saving for every published GPT-2 format (see checkpoint/api.py).

This package's `__init__` only re-exports: api.py holds the entry points, hf.py / openai_tf.py /
hub.py the readers and the writer, contract.py the one reader contract and strict check,
keymap.py the one name table.
"""

from gpt2kit.checkpoint.api import (
    describe,
    holds_model,
    load_model,
    load_state,
    load_tokenizer,
    quantize_checkpoint,
    resolve_source,
    save_model,
)
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.devices import resolve_dtype

__all__ = ["CheckpointError", "describe", "holds_model", "load_model", "load_state", "load_tokenizer",
           "quantize_checkpoint", "resolve_dtype", "resolve_source", "save_model"]
