"""adapter_config.json, peft's LoRA settings: read and checked as data (torch-free).

Every field gpt2kit reads is checked for the type and range peft gives it, and refused naming the
file and the field otherwise. rank_pattern / alpha_pattern keys are module names or their ends
(`h.1.attn.c_attn`, `c_fc`), compared as text: peft runs them as regular expressions, gpt2kit never
does, so no file can make reading slow. What gpt2kit cannot represent (DoRA, lora_bias,
modules_to_save, adapters on other embeddings) is refused by name.

A directory holding this file is an adapter, not a model: `not_a_model` says whose base it belongs
to and how to load it, for the model loader.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.config import LORA_BIASES
from gpt2kit.validate import check_int, check_number

ADAPTER_CONFIG = "adapter_config.json"
# What a rank_pattern / alpha_pattern key may be: a module name or its end (checked in one linear scan).
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class AdapterSettings:
    """What gpt2kit reads of adapter_config.json, checked."""

    base: str | None  # base_model_name_or_path, as recorded
    alpha: float
    alpha_pattern: dict[str, float]
    rslora: bool
    dropout: float
    bias: str
    tokens: list[int] | None  # trainable_token_indices


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def usage(base: str | None, directory: str | os.PathLike[str]) -> str:
    """How an adapter is used: on its base (BASE when not known), or merged into it."""
    return f"--model {base or 'BASE'} --adapter {directory}, or gpt2kit merge"


def not_a_model(raw: str, path: Path) -> CheckpointError:
    """The error for an adapter directory given where a model belongs: whose adapter it is, and how to use it."""
    try:
        base = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, RecursionError, AttributeError):  # a broken file: the base is just not known
        base = None
    base = base if isinstance(base, str) and base else None
    whose = f"made for the base {shown(base, 300)}" if base else "its base is not recorded (base_model_name_or_path)"
    return CheckpointError(f"{raw}: a LoRA adapter (peft's format), not a model; {whose}: use {usage(base, raw)}")


def read_settings(directory: Path) -> AdapterSettings:
    """adapter_config.json in `directory`, checked (CheckpointError naming the file and the field)."""
    cfg_file = directory / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_CONFIG}: not a LoRA adapter directory (peft's format)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested beyond Python's stack
        raise CheckpointError(f"{cfg_file}: cannot read it as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: must hold a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type must be \"LORA\", got {shown(cfg.get('peft_type'))}")
    _refuse_unsupported(cfg_file, cfg)
    rslora, base = cfg.get("use_rslora", False), cfg.get("base_model_name_or_path")
    if rslora is not None and not isinstance(rslora, bool):
        raise CheckpointError(f"{cfg_file}: use_rslora must be true or false, got {shown(rslora)}")
    if base is not None and not isinstance(base, str):
        raise CheckpointError(f"{cfg_file}: base_model_name_or_path must be a string, got {shown(base)}")
    if cfg.get("r") is not None:
        _field(cfg_file, check_int, "r", cfg["r"], ">= 1", lambda v: v >= 1)
    alpha, dropout = cfg.get("lora_alpha", 8), cfg.get("lora_dropout", 0.0)
    _field(cfg_file, check_number, "lora_alpha", alpha, "> 0", lambda v: v > 0)
    _field(cfg_file, check_number, "lora_dropout", dropout, "in [0, 1)", lambda v: 0 <= v < 1)
    _check_pattern(cfg_file, "rank_pattern", cfg.get("rank_pattern"), check_int, ">= 1")
    alphas = _check_pattern(cfg_file, "alpha_pattern", cfg.get("alpha_pattern"), check_number, "> 0")
    return AdapterSettings(base, alpha, alphas, bool(rslora), float(dropout), cfg.get("bias", "none"),
                           _token_indices(cfg_file, cfg.get("trainable_token_indices")))


def _refuse_unsupported(cfg_file: Path, cfg: dict) -> None:
    bias = cfg.get("bias", "none")
    if bias not in LORA_BIASES:
        raise CheckpointError(f"{cfg_file}: unknown bias {shown(bias)}; valid choices: {', '.join(LORA_BIASES)}")
    for key, ok in (("use_dora", False), ("lora_bias", False)):
        if cfg.get(key, ok) not in (ok, None):
            raise CheckpointError(f"{cfg_file}: {key}={shown(cfg[key])} is not supported (only {key}={ok!r})")
    if cfg.get("modules_to_save"):
        raise CheckpointError(f"{cfg_file}: modules_to_save {shown(cfg['modules_to_save'])} is not supported "
                              "(only LoRA on the block matrices)")


def shown(value: object, limit: int = 80) -> str:
    """A value from a file, quoted and cut short: one readable line however long it is."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _field(cfg_file: Path, check, name: str, value: object, limit: str, ok) -> None:
    """A validate check (check_int / check_number) on a field of the file, said as CheckpointError."""
    try:
        check(name, value, limit, ok)
    except (ValueError, OverflowError):  # OverflowError: an integer beyond float's range
        kind = "an integer" if check is check_int else "a number"
        raise CheckpointError(f"{cfg_file}: {name} must be {kind} {limit}, got {shown(value)}") from None


def _check_pattern(cfg_file: Path, name: str, pattern: object, check, limit: str) -> dict:
    """rank_pattern / alpha_pattern: {module name or the end of one: a positive rank or alpha}."""
    if pattern is None:
        return {}
    if not isinstance(pattern, dict):
        raise CheckpointError(f"{cfg_file}: {name} must be an object of module name: value, got {shown(pattern)}")
    for key, value in pattern.items():
        if _MODULE_NAME.fullmatch(key) is None:
            raise CheckpointError(f"{cfg_file}: {name} key {shown(key)} is not a module name; gpt2kit reads a key "
                                  "as a module's name or its end (letters, digits, '_' and '.', as in "
                                  "h.0.attn.c_attn or c_fc), not as a regular expression")
        _field(cfg_file, check, f"{name}[{shown(key)}]", value, limit, lambda v: v > 0)
    return pattern


def pattern_value(pattern: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup for our module name (h.0.attn.c_attn): the first key that
    is its peft name (transformer.h.0.attn.c_attn) or the end of it after a "."."""
    full = f"transformer.{module}"
    return next((v for k, v in pattern.items() if full == k or full.endswith(f".{k}")), default)


def _token_indices(cfg_file: Path, indices: object) -> list[int] | None:
    """peft's trainable_token_indices (a list, or {"wte": list}): a non-empty list of distinct token ids."""
    if isinstance(indices, dict):  # {embedding module name: ids}: only the token embedding is read
        if set(indices) - {"wte", "transformer.wte"}:
            raise CheckpointError(f"{cfg_file}: trainable_token_indices for {shown(sorted(indices))} is not "
                                  "supported (only the token embedding, wte)")
        indices = next(iter(indices.values()), None)
    if indices is None:
        return None
    if (not isinstance(indices, list) or not indices
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in indices)
            or len(set(indices)) != len(indices)):
        raise CheckpointError(f"{cfg_file}: trainable_token_indices must be a non-empty list of distinct token "
                              f"ids, got {shown(indices)}")
    return indices
