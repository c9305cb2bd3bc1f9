"""The learner's side: their file imported, NAME found, their config filled from ours, the model
built, and its forward called the way its signature says.

The learner's file is their own code, written to be run: it is imported as a module (its
`if __name__ == "__main__":` block does not run). Every failure here is the user's input, not a
difference from GPT-2, so each raises LearnerError with one line naming what was wrong.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpt2kit.config import GPT2Config

# GPT-2's dropout during training. The learner's model is built with it and run in eval mode, so a
# dropout that stays on in eval shows as two runs that differ.
DROPOUT = 0.1

# The learner's config field names (as written, then lower-cased) -> what it holds in GPT-2's terms.
CONFIG_ALIASES: dict[str, tuple[str, ...]] = {
    "n_vocab": ("n_vocab", "vocab_size", "vocabsize", "vocab", "n_vocab_size", "num_tokens", "vocab_len", "V"),
    "n_ctx": ("n_ctx", "block_size", "context_length", "max_seq_len", "n_positions", "max_len", "seq_len",
              "max_position_embeddings", "context_size", "ctx_len", "max_seq_length", "max_length", "T"),
    "n_embd": ("n_embd", "d_model", "dmodel", "emb_dim", "hidden_size", "embed_dim", "n_embed", "dim",
               "embedding_dim", "d_emb", "n_embedding", "width", "C", "D"),
    "n_head": ("n_head", "n_heads", "H", "num_heads", "num_attention_heads", "nhead", "heads", "n_attn_heads"),
    "n_layer": ("n_layer", "n_layers", "N", "L", "num_layers", "num_hidden_layers", "depth", "nlayers",
                "num_blocks", "n_blocks"),
    "head_dim": ("head_dim", "head_size", "d_head", "dk", "d_k", "hs"),
    "d_ff": ("d_ff", "dff", "n_inner", "ffn_dim", "d_mlp", "mlp_dim", "intermediate_size", "hidden_dim",
             "ff_dim", "d_hidden"),
    "dropout": ("dropout", "drop_rate", "p_drop", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout_rate",
                "drop", "attn_dropout", "resid_dropout", "emb_dropout", "drop_prob"),
    "bias": ("bias", "qkv_bias", "use_bias"),
    "eps": ("layer_norm_eps", "layer_norm_epsilon", "ln_eps", "eps", "norm_eps", "epsilon"),
}
_BY_NAME = {name: key for key, names in CONFIG_ALIASES.items() for name in names}
_BY_LOWER = {name.lower(): key for key, names in CONFIG_ALIASES.items() for name in names if len(name) > 1}


class LearnerError(ValueError):
    """The learner's file, NAME, config or forward could not be used (bad input: the CLI exits 2)."""


_SEQ = itertools.count()


def parse_target(spec: str) -> tuple[Path, str]:
    """"path/to/file.py:NAME" -> (path, NAME)."""
    path, sep, name = str(spec).rpartition(":")
    if not sep or not path or not name:
        raise LearnerError(f"{spec!r}: give the learner as PATH.py:NAME, e.g. my_gpt2.py:GPT")
    return Path(path), name.strip()


def import_file(path: Path) -> Any:
    """The learner's file run as a fresh module (its folder on sys.path while it imports, for its
    own sibling modules); a new module each call, so an edited file is read again."""
    if not path.is_file():
        raise LearnerError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    if path.suffix != ".py":
        raise LearnerError(f"{path}: not a Python file (.py)")
    module_name = f"_gpt2kit_learner_{next(_SEQ)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up there
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise LearnerError(f"{path}: importing it raised {_one_line(e)}") from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def resolve_learner(learner: str | os.PathLike[str] | Callable) -> tuple[Callable, Any, str]:
    """(the class or function to call, the module it came from or None, how to name it)."""
    if callable(learner) and not isinstance(learner, (str, os.PathLike)):
        return learner, inspect.getmodule(learner), getattr(learner, "__qualname__", repr(learner))
    path, name = parse_target(os.fspath(learner))
    module = import_file(path)
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items()
                       if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
                       and getattr(v, "__module__", None) == module.__name__)
        hint = f"; it defines {', '.join(found)}" if found else ""
        raise LearnerError(f"{path} has no {name}{hint}")
    target = getattr(module, name)
    if not (inspect.isclass(target) and issubclass(target, nn.Module)) and not inspect.isfunction(target):
        what = "a class that is not an nn.Module" if inspect.isclass(target) else f"a {type(target).__name__}"
        raise LearnerError(f"{path}:{name} is {what}; give an nn.Module class or a function that builds one")
    return target, module, f"{path}:{name}"


def _gpt2_value(key: str, cfg: GPT2Config) -> Any:
    return {"n_vocab": cfg.n_vocab, "n_ctx": cfg.n_ctx, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
            "n_layer": cfg.n_layer, "head_dim": cfg.head_dim, "d_ff": 4 * cfg.n_embd, "dropout": DROPOUT,
            "bias": True, "eps": cfg.layer_norm_eps}[key]


def _meaning(field: str) -> str | None:
    return _BY_NAME.get(field) or _BY_LOWER.get(field.lower())


def _filled(names: list[str], cfg: GPT2Config) -> dict[str, Any]:
    return {n: _gpt2_value(key, cfg) for n in names if (key := _meaning(n)) is not None}


def learner_config(config_class: Any, module: Any, cfg: GPT2Config) -> Any:
    """What NAME is called with: GPT2Config (dropout DROPOUT) without config_class; else the learner's
    config class (a dataclass or a class taking keywords), a config dict or a config instance from
    their file (or given as an object), with every field whose name means a GPT-2 size filled."""
    if config_class is None:
        return cfg.replace(dropout=DROPOUT)
    target = config_class
    if isinstance(config_class, str):
        if module is None or not hasattr(module, config_class):
            where = getattr(module, "__file__", "the learner's module")
            raise LearnerError(f"--config-class {config_class}: {where} defines no {config_class}")
        target = getattr(module, config_class)
    if isinstance(target, dict):
        return {**target, **_filled(list(target), cfg)}
    if dataclasses.is_dataclass(target) and not inspect.isclass(target):
        return dataclasses.replace(target, **_filled([f.name for f in dataclasses.fields(target) if f.init], cfg))
    if inspect.isclass(target):
        return _construct(target, cfg)
    raise LearnerError(f"--config-class: {type(target).__name__} is not a class, a dict or a dataclass instance")


def _construct(cls: type, cfg: GPT2Config) -> Any:
    if dataclasses.is_dataclass(cls):
        fields = [f for f in dataclasses.fields(cls) if f.init]
        names = [f.name for f in fields]
        required = [f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
    else:
        params = [p for p in list(inspect.signature(cls).parameters.values())
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        names = [p.name for p in params]
        required = [p.name for p in params if p.default is p.empty]
    values = _filled(names, cfg)
    unknown = [n for n in required if n not in values]
    if unknown:
        raise LearnerError(f"--config-class {cls.__name__}: field(s) {', '.join(unknown)} have no default and no "
                           f"known meaning; known names: {', '.join(sorted(_BY_NAME))}")
    try:
        return cls(**values)
    except Exception as e:
        raise LearnerError(f"--config-class {cls.__name__}({_args(values)}) raised {_one_line(e)}") from e


def build(factory: Callable, config: Any, label: str) -> nn.Module:
    """factory(config) as a float32 model in eval mode."""
    try:
        model = factory(config)
    except Exception as e:
        hint = ""
        if isinstance(e, (AttributeError, KeyError, TypeError)) and isinstance(config, GPT2Config):
            hint = ("; it was given gpt2kit's GPT2Config (n_vocab, n_ctx, n_embd, n_head, n_layer): pass "
                    "--config-class with your own config class or dict")
        raise LearnerError(f"{label}({type(config).__name__}) raised {_one_line(e)}{hint}") from e
    if not isinstance(model, nn.Module):
        raise LearnerError(f"{label}(config) returned a {type(model).__name__}, not an nn.Module")
    if next(model.parameters(), None) is None:
        raise LearnerError(f"{label}(config) built a module without parameters")
    return model.float().eval()


CACHE_PARAMS = ("past", "past_key_values", "kv_cache", "cache", "layer_past", "past_kv", "kv", "kv_caches",
                "caches", "present")
TARGET_PARAMS = ("targets", "labels", "target", "y")
RESET_METHODS = ("reset_kv_cache", "reset_cache", "clear_cache", "clear_kv_cache", "reset_caches")


def forward_params(model: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def first_named(params: list[str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in params), None)


def split_output(out: Any) -> tuple[Any, Any]:
    """(logits, the cache it returned or None) from a tensor, a tuple/list, a dict or a ModelOutput."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, dict):
        logits = out.get("logits")
        cache = next((out[k] for k in ("present", "past_key_values", "past", "kv_cache", "cache")
                      if out.get(k) is not None), None)
        return logits, cache
    if isinstance(out, (tuple, list)) and out:
        if isinstance(out, tuple) and hasattr(out, "_fields"):  # a NamedTuple: by field when named so
            fields = dict(zip(out._fields, out, strict=True))
            if "logits" in fields:
                return split_output(fields)
        rest = [x for x in out[1:] if x is not None and not (isinstance(x, torch.Tensor) and x.dim() == 0)]
        return out[0], rest[0] if rest else None
    return out, None


def call(model: nn.Module, ids: torch.Tensor, label: str, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The learner's (logits, cache) for ids; LearnerError when its forward raises or returns no logits."""
    try:
        with torch.no_grad():
            out = model(ids, **kwargs)
    except Exception as e:
        shown = ", ".join([f"ids {tuple(ids.shape)}"] + [f"{k}={_short(v)}" for k, v in kwargs.items()])
        raise LearnerError(f"{label}: forward({shown}) raised {_one_line(e)}") from e
    logits, cache = split_output(out)
    if not isinstance(logits, torch.Tensor):
        raise LearnerError(f"{label}: forward returned a {type(out).__name__}; it must return the logits "
                           "(B, T, V) or a tuple whose first element they are")
    return logits, cache


def reset_cache(model: nn.Module) -> None:
    """Clear a cache the model keeps inside itself (reset_kv_cache() and the like), when it has one."""
    for name in RESET_METHODS:
        fn = getattr(model, name, None)
        if callable(fn):
            fn()
            return


def _short(v: Any) -> str:
    """An argument as a message shows it: a tensor by its shape, a plain value by itself, else its type."""
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    return repr(v) if v is None or isinstance(v, (bool, int, float)) else type(v).__name__


def _args(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
