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

from gpt2kit._io import read_bytes

EOT_ID = 50256  # <|endoftext|> in GPT-2's vocabulary: the document separator, stop token and scoring context

# Every dtype name a flag, a config or a caller may use -> its canonical name (torch's). The one table:
# gpt2kit.devices maps these to torch dtypes; TrainConfig accepts the float32/bfloat16 ones.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}

# The int8 weight-only scheme's names (gpt2kit.quant.modules has the scheme; torch-free here so that reading a
# quantized checkpoint's header, as `gpt2kit info` does, needs no torch).
QUANT_SCHEMES = ("int8",)
QUANT_SCALE_DTYPES = ("float32", "bfloat16")
# peft's LoraConfig.bias: which biases train (and are saved) beside the adapters (gpt2kit.lora; torch-free
# here for the training flags and the adapter reader).
LORA_BIASES = ("none", "all", "lora_only")


def check_scheme(scheme: str) -> str:
    if scheme not in QUANT_SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; valid choices: {', '.join(QUANT_SCHEMES)}")
    return scheme


# Beyond these a config is a typo or an attack, not a model (GPT-2 XL: 48 layers, 1600 wide, 25 heads).
# Checked before anything is allocated. A loader compares the layer count with the checkpoint before
# it builds anything, and train sizes a new model against memory, so n_layer's own bound can stay loose.
LIMITS = {"n_vocab": 1 << 24, "n_ctx": 1 << 20, "n_embd": 1 << 16, "n_head": 1 << 10, "n_layer": 1 << 20}
MAX_PARAMETERS = 10**12


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
            if value > LIMITS[name]:
                raise ValueError(f"GPT2Config.{name}={value} is beyond the limit {LIMITS[name]:,} "
                                 f"(GPT-2 XL has {getattr(_XL, name)})")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"valid n_head values for n_embd={self.n_embd}: {_divisors(self.n_embd)}"
            )
        if (self.n_vocab_padded is not None
                and (isinstance(self.n_vocab_padded, bool) or not isinstance(self.n_vocab_padded, int))):
            raise ValueError(f"GPT2Config.n_vocab_padded must be an integer or None, got {self.n_vocab_padded!r}")
        for name in ("dropout", "layer_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"GPT2Config.{name} must be a number, got {value!r}")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPT2Config.dropout must be in [0, 1), got {self.dropout!r}")
        if not (self.layer_norm_eps > 0 and math.isfinite(self.layer_norm_eps)):
            raise ValueError(f"GPT2Config.layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")
        if self.n_vocab_padded is not None and self.n_vocab_padded < self.n_vocab:
            raise ValueError(
                f"GPT2Config.n_vocab_padded ({self.n_vocab_padded}) must be >= n_vocab ({self.n_vocab})"
            )
        if self.n_vocab_padded is not None and self.n_vocab_padded > LIMITS["n_vocab"]:
            raise ValueError(f"GPT2Config.n_vocab_padded={self.n_vocab_padded} is beyond the limit "
                             f"{LIMITS['n_vocab']:,}")
        if self.n_params > MAX_PARAMETERS:
            raise ValueError(f"GPT2Config has {self.n_params:,} parameters, beyond the limit {MAX_PARAMETERS:,} "
                             f"(n_layer={self.n_layer}, n_embd={self.n_embd}); GPT-2 XL has 1.56e9")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def embedding_rows(self) -> int:
        return self.n_vocab_padded or self.n_vocab

    @property
    def n_params(self) -> int:
        """Parameters of the model this config builds (padded embedding rows included), from arithmetic.

        Lets callers size a model (memory estimates, `gpt2kit info`) without building it."""
        C = self.n_embd
        per_block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
        return self.embedding_rows * C + self.n_ctx * C + self.n_layer * per_block + 2 * C

    @property
    def eot_id(self) -> int | None:
        """<|endoftext|>'s id, when the vocabulary is GPT-2's (random test models may be smaller)."""
        return EOT_ID if self.n_vocab > EOT_ID else None

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
        d, where = _read_json(source, "config.json")
        model_type = d.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"{where} has model_type {model_type!r}; gpt2kit loads only 'gpt2'")
        act = d.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{where} has activation_function {act!r}; GPT-2 uses the tanh GELU ('gelu_new')")
        n_embd = _number(d, "n_embd", 768, where, int)
        n_inner = _number(d, "n_inner", None, where, int)
        if n_inner is not None and n_inner != 4 * n_embd:
            raise ValueError(f"{where} has n_inner={n_inner}; GPT-2 uses 4 * n_embd = {4 * n_embd}")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if d.get(flag):
                raise ValueError(f"{where} sets {flag}=true, which is not the GPT-2 graph")
        if d.get("scale_attn_weights") is False:
            raise ValueError(f"{where} sets scale_attn_weights=false, which is not the GPT-2 graph")
        ctx_key = "n_positions" if "n_positions" in d else "n_ctx"
        fields = {"n_vocab": ("vocab_size", 50257), "n_ctx": (ctx_key, 1024), "n_embd": ("n_embd", 768),
                  "n_head": ("n_head", 12), "n_layer": ("n_layer", 12)}
        values: dict[str, Any] = {ours: _number(d, key, default, where, int) for ours, (key, default) in fields.items()}
        values["layer_norm_eps"] = _number(d, "layer_norm_epsilon", 1e-5, where, float)
        try:
            return cls(**values)
        except ValueError as e:
            # Name the file and its own key, not our field: "config.json: n_layer=1000000 is beyond ..."
            message = str(e)
            for ours, (key, _) in fields.items():
                message = message.replace(f"GPT2Config.{ours}", key)
            raise ValueError(f"{where}: {message.replace('GPT2Config.layer_norm_eps', 'layer_norm_epsilon')}") \
                from None

    @classmethod
    def from_openai(cls, source: dict[str, Any] | str | os.PathLike[str]) -> GPT2Config:
        """From OpenAI's hparams.json (a path, a directory holding it, or the parsed dict)."""
        d, where = _read_json(source, "hparams.json")
        keys = ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"{where} is missing {missing}")
        try:
            return cls(**{k: _number(d, k, None, where, int) for k in keys})
        except ValueError as e:
            raise ValueError(f"{where}: {str(e).replace('GPT2Config.', '')}") from None

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


_XL = PRESETS["gpt2-xl"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GPT2Config)]


def _number(d: dict[str, Any], key: str, default: Any, where: str, kind: type) -> Any:
    """d[key] (or default) checked to be a JSON number of the right kind, naming file and key if not."""
    value = d.get(key, default)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                         and (kind is float or isinstance(value, int))):
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 12.0 is a fine way to write 12
    want = "an integer" if kind is int else "a number"
    raise ValueError(f"{where}: {key} must be {want}, got {value!r} ({type(value).__name__})")


def _read_json(source: dict[str, Any] | str | os.PathLike[str], default_name: str) -> tuple[dict[str, Any], str]:
    """The parsed object and how to name it in messages (the path, or the default file name for a dict)."""
    if isinstance(source, dict):
        return source, default_name
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, default_name)
    raw = read_bytes(path)
    if not raw.strip():
        raise ValueError(f"{path}: empty file (0 bytes of JSON)" if not raw else f"{path}: contains only whitespace")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "a JSON config must be UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data, path
