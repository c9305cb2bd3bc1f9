"""gpt2kit: GPT-2, complete, exact and fast.

    from gpt2kit import GPT2, load_model, load_tokenizer
    model = load_model("gpt2")                  # hub id, HF directory or OpenAI TF release directory
    tok = load_tokenizer("gpt2")
    logits = model(torch.tensor([tok.encode("Hello world")])).logits

The names below are imported on first use (PEP 562), so `import gpt2kit` and the CLI's --help stay
fast and do not load torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "check": "gpt2kit.checker", "CheckpointError": "gpt2kit.checkpoint", "load_model": "gpt2kit.checkpoint",
    "load_tokenizer": "gpt2kit.checkpoint", "save_model": "gpt2kit.checkpoint",
    "PRESETS": "gpt2kit.config", "GPT2Config": "gpt2kit.config",
    "KVCache": "gpt2kit.kv_cache",
    "GPT2": "gpt2kit.model", "GPT2Output": "gpt2kit.model",
    "Completion": "gpt2kit.generation", "Step": "gpt2kit.generation", "generate": "gpt2kit.generation",
    "generate_stream": "gpt2kit.generation", "stream_text": "gpt2kit.generation",
    "SamplingSettings": "gpt2kit.sampling",
    "ScoreResult": "gpt2kit.score", "score_text": "gpt2kit.score", "score_tokens": "gpt2kit.score",
    "IncrementalDecoder": "gpt2kit.tokenizer", "Tokenizer": "gpt2kit.tokenizer",
}

__all__ = [
    "GPT2", "PRESETS", "CheckpointError", "Completion", "GPT2Config", "GPT2Output", "IncrementalDecoder", "KVCache",
    "SamplingSettings", "ScoreResult", "Step", "Tokenizer", "check", "generate", "generate_stream", "load_model",
    "load_tokenizer", "save_model", "score_text", "score_tokens", "stream_text",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gpt2kit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from gpt2kit.checker import check
    from gpt2kit.checkpoint import CheckpointError, load_model, load_tokenizer, save_model
    from gpt2kit.config import PRESETS, GPT2Config
    from gpt2kit.generation import Completion, Step, generate, generate_stream, stream_text
    from gpt2kit.kv_cache import KVCache
    from gpt2kit.model import GPT2, GPT2Output
    from gpt2kit.sampling import SamplingSettings
    from gpt2kit.score import ScoreResult, score_text, score_tokens
    from gpt2kit.tokenizer import IncrementalDecoder, Tokenizer
