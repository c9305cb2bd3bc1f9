"""GPT2Config: the model's hyperparameters as a frozen dataclass, with the paper's presets.

Readers for the two published config formats live here too: Hugging Face's config.json
(n_embd, n_layer, n_head, n_positions, vocab_size) and OpenAI's hparams.json
(n_vocab, n_ctx, n_embd, n_head, n_layer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GPT2Config:
    n_vocab: int = 50257
    n_ctx: int = 1024
    n_embd: int = 768
    n_head: int = 12
    n_layer: int = 12
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    # Rows of the embedding table when it is padded for speed (e.g. 50304, as llm.c does);
    # None means exactly n_vocab. Logits are always cut back to n_vocab.
    n_vocab_padded: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"valid n_head values for n_embd={self.n_embd}: {_divisors(self.n_embd)}"
            )
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPT2Config.dropout must be in [0, 1), got {self.dropout!r}")
        if not (self.layer_norm_eps > 0 and math.isfinite(self.layer_norm_eps)):
            raise ValueError(f"GPT2Config.layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")
        if self.n_vocab_padded is not None and self.n_vocab_padded < self.n_vocab:
            raise ValueError(
                f"GPT2Config.n_vocab_padded ({self.n_vocab_padded}) must be >= n_vocab ({self.n_vocab})"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def embedding_rows(self) -> int:
        return self.n_vocab_padded or self.n_vocab

    @property
    def eot_id(self) -> int | None:
        """<|endoftext|>'s id, when the vocabulary is GPT-2's (random test models may be smaller)."""
        return 50256 if self.n_vocab > 50256 else None

    def replace(self, **changes: Any) -> GPT2Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPT2Config:
        """A preset by name (``gpt2``, ``gpt2-medium``, ...), with optional field overrides."""
        key = name.removeprefix("openai-community/")
        if key not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; valid choices: {', '.join(PRESETS)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown GPT2Config field(s) {sorted(unknown)}; valid fields: {_field_names()}")
        return dataclasses.replace(PRESETS[key], **overrides)

    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | os.PathLike[str]) -> GPT2Config:
        """From a Hugging Face GPT-2 config.json (a path, a directory holding it, or the parsed dict)."""
        d = _read_json(source, "config.json")
        model_type = d.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"config.json has model_type {model_type!r}; gpt2kit loads only 'gpt2'")
        act = d.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(
                f"config.json has activation_function {act!r}; GPT-2 uses the tanh GELU ('gelu_new')"
            )
        n_inner = d.get("n_inner")
        if n_inner is not None and n_inner != 4 * d.get("n_embd", 768):
            raise ValueError(f"config.json has n_inner={n_inner}; GPT-2 uses 4 * n_embd")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if d.get(flag):
                raise ValueError(f"config.json sets {flag}=true, which is not the GPT-2 graph")
        if d.get("scale_attn_weights") is False:
            raise ValueError("config.json sets scale_attn_weights=false, which is not the GPT-2 graph")
        try:
            return cls(
                n_vocab=d.get("vocab_size", 50257),
                n_ctx=d.get("n_positions", d.get("n_ctx", 1024)),
                n_embd=d.get("n_embd", 768),
                n_head=d.get("n_head", 12),
                n_layer=d.get("n_layer", 12),
                layer_norm_eps=d.get("layer_norm_epsilon", 1e-5),
            )
        except TypeError as e:
            raise ValueError(f"config.json is not a GPT-2 config: {e}") from None

    @classmethod
    def from_openai(cls, source: dict[str, Any] | str | os.PathLike[str]) -> GPT2Config:
        """From OpenAI's hparams.json (a path, a directory holding it, or the parsed dict)."""
        d = _read_json(source, "hparams.json")
        missing = [k for k in ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer") if k not in d]
        if missing:
            raise ValueError(f"hparams.json is missing {missing}")
        return cls(n_vocab=d["n_vocab"], n_ctx=d["n_ctx"], n_embd=d["n_embd"], n_head=d["n_head"],
                   n_layer=d["n_layer"])

    def to_hf(self) -> dict[str, Any]:
        """The config.json transformers writes for GPT2LMHeadModel with these sizes."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            "vocab_size": self.n_vocab,
            "n_positions": self.n_ctx,
            "n_ctx": self.n_ctx,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_layer": self.n_layer,
            "n_inner": None,
            "layer_norm_epsilon": self.layer_norm_eps,
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "attn_pdrop": self.dropout,
            "initializer_range": 0.02,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "summary_type": "cls_index",
            "summary_use_proj": True,
            "summary_activation": None,
            "summary_proj_to_labels": True,
            "summary_first_dropout": 0.1,
            "bos_token_id": self.eot_id,
            "eos_token_id": self.eot_id,
            "tie_word_embeddings": True,
            "use_cache": True,
        }

    def to_openai(self) -> dict[str, int]:
        return {"n_vocab": self.n_vocab, "n_ctx": self.n_ctx, "n_embd": self.n_embd,
                "n_head": self.n_head, "n_layer": self.n_layer}


PRESETS: dict[str, GPT2Config] = {
    # The four sizes of the paper (Table 2), as released.
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
    # Small models that train in minutes on a CPU (same vocab, shorter context).
    "gpt2-tiny": GPT2Config(n_layer=4, n_embd=128, n_head=4, n_ctx=256),
    "gpt2-mini": GPT2Config(n_layer=6, n_embd=384, n_head=6, n_ctx=512),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GPT2Config)]


def _read_json(source: dict[str, Any] | str | os.PathLike[str], default_name: str) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, default_name)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
