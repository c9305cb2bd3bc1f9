"""gpt2kit: GPT-2, complete, exact and fast.

    from gpt2kit import GPT2, load_model, load_tokenizer
    model = load_model("gpt2")                  # hub id, HF directory or OpenAI TF release directory
    tok = load_tokenizer("gpt2")
    logits = model(torch.tensor([tok.encode("Hello world")])).logits
"""

from gpt2kit.checkpoint import CheckpointError, load_model, load_tokenizer, save_model
from gpt2kit.config import PRESETS, GPT2Config
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2, GPT2Output
from gpt2kit.score import ScoreResult, score_text, score_tokens
from gpt2kit.tokenizer import IncrementalDecoder, Tokenizer

__version__ = "0.1.0"

__all__ = [
    "GPT2", "PRESETS", "CheckpointError", "GPT2Config", "GPT2Output", "IncrementalDecoder", "KVCache",
    "ScoreResult", "Tokenizer", "load_model", "load_tokenizer", "save_model", "score_text", "score_tokens",
]
