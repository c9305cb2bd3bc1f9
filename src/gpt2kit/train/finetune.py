"""What a training run trains, and what it keeps: LoRA, freezing by name, activation checkpointing.

train.py builds the model, then `prepare(model, cfg)` makes it what the run trains:
    --lora-rank R        the block matrices swapped for LoRALinear (gpt2kit.lora), everything else frozen
                         but the biases --lora-bias names (peft's bias option: none, all, lora_only);
                         checkpoint.pt holds only the adapter (the base is rebuilt from --model on
                         resume), and OUT gets a peft-format adapter directory instead of a model
    --freeze / --train-only GLOBS    parameters frozen by name (fnmatch globs, comma lists)
    --activation-checkpointing       each block's activations recomputed in the backward pass
                         (torch's non-reentrant checkpoint, applied by hooks: names, state dict and
                         forward hooks stay as they are)

Frozen parameters get no gradient, no optimizer state and no clipping share; the optimizers
(gpt2kit.train.optim) take only what requires a gradient.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import torch
from torch import nn

from gpt2kit.checkpoint import load_tokenizer, save_adapter, save_model
from gpt2kit.checkpoint.adapter import ADAPTER_CONFIG
from gpt2kit.checkpoint.adapter_config import usage
from gpt2kit.data.shard import find_shards, most_used_tokens
from gpt2kit.lora import apply_lora, lora_state
from gpt2kit.train.config import TrainConfig

# float32 weights, gradients and AdamW's two moments: what full training needs per parameter;
# a LoRA run keeps only the frozen float32 weights (the adapter's share is below 1%).
FULL_BYTES_PER_PARAMETER = 16
FROZEN_BYTES_PER_PARAMETER = 4
LORA_SEED_OFFSET = 0x10AA  # the adapter's initial A is drawn by its own generator, from the run's seed


def bytes_per_parameter(cfg: TrainConfig) -> int:
    """What check_memory assumes per parameter before the model is built."""
    return FROZEN_BYTES_PER_PARAMETER if cfg.lora_rank is not None else FULL_BYTES_PER_PARAMETER


def lora_alpha(cfg: TrainConfig) -> float:
    return cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank


def prepare(model: nn.Module, cfg: TrainConfig) -> str | None:
    """Apply the run's LoRA / freezing / checkpointing to `model` in place; returns a line saying what
    trains (None when everything does)."""
    line = None
    if cfg.lora_rank is not None:
        g = torch.Generator(device=next(model.parameters()).device).manual_seed(cfg.seed + LORA_SEED_OFFSET)
        apply_lora(model, cfg.lora_rank, lora_alpha(cfg), dropout=cfg.lora_dropout, targets=cfg.lora_targets,
                   generator=g, bias=cfg.lora_bias, tokens=trained_tokens(cfg, model.config.n_vocab))
        line = "LoRA"
    elif cfg.freeze is not None or cfg.train_only is not None:
        freeze(model, freeze=cfg.freeze, train_only=cfg.train_only)
        line = "partial fine-tune"
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    if line is None:
        return None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"{line}: training {trained:,} of {total:,} parameters ({trained / total:.2%})"


def trained_tokens(cfg: TrainConfig, n_vocab: int) -> list[int] | None:
    """--lora-tokens N: the N ids the train split uses most (its shards counted once, at start-up)."""
    if cfg.lora_tokens is None:
        return None

    return most_used_tokens(find_shards(cfg.data, "train"), cfg.lora_tokens, n_vocab)


def _globs(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def freeze(model: nn.Module, *, freeze: str | None = None, train_only: str | None = None) -> None:
    """Train the parameters matching train_only (all if None) minus those matching freeze. A glob
    matching nothing, or nothing left to train, raises naming it."""
    names = [n for n, _ in model.named_parameters()]
    chosen = set(names)
    for flag, text in (("--train-only", train_only), ("--freeze", freeze)):
        if text is None:
            continue
        matched: set[str] = set()
        for glob in _globs(text):
            hits = set(fnmatch.filter(names, glob))
            if not hits:
                raise ValueError(f"{flag} {glob!r} matches no parameter; names look like "
                                 f"{', '.join(names[:3])}, ..., {names[-1]}")
            matched |= hits
        chosen = chosen & matched if flag == "--train-only" else chosen - matched
    if not chosen:
        raise ValueError(f"--train-only {train_only!r} minus --freeze {freeze!r} leaves no parameter to train")
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass (torch's composable, non-reentrant
    checkpoint: forward hooks, so the model's modules, names and hooks are untouched)."""
    try:
        from torch.distributed._composable import checkpoint
    except ImportError as e:  # a torch built without torch.distributed
        raise ValueError(f"--activation-checkpointing needs torch.distributed, which this PyTorch lacks ({e})") \
            from None
    for block in model.h:
        checkpoint(block)


def checkpoint_state(model: nn.Module, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """What checkpoint.pt keeps of the model: the adapter alone for LoRA, else the whole state."""
    if cfg.lora_rank is None:
        return model.state_dict()

    return lora_state(model, cfg.lora_bias)


def load_checkpoint_state(model: nn.Module, cfg: TrainConfig, state: dict[str, torch.Tensor]) -> None:
    """Restore checkpoint_state's dict into a prepared LoRA model (the base came from --model)."""
    have = lora_state(model, cfg.lora_bias)
    if set(state) != set(have):
        missing, extra = sorted(set(have) - set(state)), sorted(set(state) - set(have))
        raise ValueError(f"the checkpoint's adapter does not fit this run: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    with torch.no_grad():
        for k, t in have.items():
            t.copy_(state[k])


def output_written(out: Path, cfg: TrainConfig) -> bool:
    return (out / (ADAPTER_CONFIG if cfg.lora_rank is not None else "config.json")).exists()


def _base(cfg: TrainConfig) -> str | None:
    """The base a LoRA run adapts, as the adapter records it (None: a preset trained from scratch)."""
    return None if cfg.from_scratch else str(cfg.model)


def save_output(model: nn.Module, cfg: TrainConfig, out: str | os.PathLike[str]) -> Path:
    """The run's result in OUT: the HF model, or for LoRA the peft adapter (with the base's tokenizer)."""
    if cfg.lora_rank is None:
        return save_model(model, out)
    base = _base(cfg)
    return save_adapter(model, out, base=base, tokenizer=load_tokenizer(base), bias=cfg.lora_bias)


def output_said(cfg: TrainConfig, out: str | os.PathLike[str]) -> str:
    """What OUT holds, for the run's last line: the model, or the adapter and how to use it."""
    if cfg.lora_rank is None:
        return f"model in {out}"

    return f"adapter in {out} (use {usage(_base(cfg), out)})"
