"""Building and restoring a training run: the model (a preset from scratch, or a checkpoint to
fine-tune, its source checked and named), its memory checked before it is built, the settings
resolved (sequence length, accumulation, schedule defaults), the optimizer, the loaders, and, with
--resume, everything checkpoint.pt holds put back (model, optimizer, data position, step, RNG
states) after checking that the run's settings did not change. gpt2kit.train.loop runs the loop on the
`Run` built here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpt2kit.checkpoint import load_model, resolve_source
from gpt2kit.checkpoint.source import HUB_NAMES
from gpt2kit.config import PRESETS, GPT2Config
from gpt2kit.data.completions import with_masks
from gpt2kit.data.loaders import RandomWindowLoader, ShardLoader
from gpt2kit.data.shard import find_shards
from gpt2kit.machine import mem_available
from gpt2kit.model import GPT2
from gpt2kit.train import distill, finetune, fsdp
from gpt2kit.train.config import ARCH_OVERRIDES, TrainConfig, batch_message, muon_available
from gpt2kit.train.distributed import Dist
from gpt2kit.train.loss import TrainingLoss
from gpt2kit.train.optim import Optimizers, make_optimizer, newton_schulz_dtype
from gpt2kit.train.run_dir import (
    CHECKPOINT_NAME,
    read_checkpoint,
    set_rng_state,
)

# What a checkpoint written before these settings existed ran with.
_LEGACY = {"optimizer": "adamw", "schedule": "cosine", "sampling": "sequential"}


_OPENAI = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # presets that are also hub ids


# Settings a resumed run may change without changing what is computed (max_steps changes the
# schedule from the resumed step on, which is what extending a run means).
RESUMABLE_CHANGES = frozenset({"data", "out", "max_steps", "eval_every", "eval_steps", "save_every",
                               "log_every", "device", "compile", "resume", "stop_at", "batch_size",
                               "activation_checkpointing"})


def saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config dict, with what older versions ran with filled in for newer settings."""
    return {k: v for k, v in _LEGACY.items() if k not in saved} | saved


# float32 weights, gradients and AdamW's two moments; activations come on top and depend on B and T.
TRAIN_BYTES_PER_PARAMETER = 16


def parameter_count(config: GPT2Config) -> int:
    """The parameters GPT2(config) has, computed without building it (GPT2Config.n_params)."""
    return config.n_params


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (CPU: MemAvailable), or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    return mem_available()  # the one MemAvailable reader (GPT2KIT_MEM_AVAILABLE overrides it)


def check_memory(config: GPT2Config, device: torch.device, what: str,
                 per_parameter: int = TRAIN_BYTES_PER_PARAMETER) -> None:
    """Refuse, in one line naming the size, a model whose training state cannot fit before building it
    (per_parameter: bytes of training state per parameter; 4 when only the frozen weights count)."""
    n = parameter_count(config)
    parts = "float32 weights, gradients and AdamW state" if per_parameter > 4 else "frozen float32 weights"
    needs = [(device, n * per_parameter, parts)]
    if device.type != "cpu":  # the model is built on the CPU first, then moved
        needs.append((torch.device("cpu"), n * 4, "float32 weights, built on the CPU before the move"))
    for dev, need, parts in needs:
        have = available_memory(dev)
        if have is not None and need > have:
            raise MemoryError(f"{what} has {_count(n)} parameters: training needs {_bytes(need)} on {dev} for "
                              f"its {parts} (before activations), but only {_bytes(have)} is available")


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


def _build_model(cfg: TrainConfig, log: Callable[[str], None], device: torch.device) -> GPT2:
    """A float32 model on the CPU: a fresh preset (from scratch) or a loaded checkpoint (fine-tune)."""
    overrides = {k: getattr(cfg, k) for k in ARCH_OVERRIDES if getattr(cfg, k) is not None}
    if cfg.dropout is not None:
        overrides["dropout"] = cfg.dropout
    if cfg.from_scratch:
        config = GPT2Config.from_name(cfg.model, **overrides)
        # Embedding rows padded to a multiple of 64 (50,257 -> 50,304, as llm.c): the fused loss's head
        # products run over all rows (a faster GEMM shape); the padded columns are masked, never predicted.
        config = config.replace(n_vocab_padded=config.n_vocab_padded or -(-config.n_vocab // 64) * 64)
        check_memory(config, device, f"preset {cfg.model!r}" + "".join(f" {k}={v}" for k, v in overrides.items()),
                     finetune.bytes_per_parameter(cfg))
        model = GPT2(config)
        hint = f" (to fine-tune OpenAI's weights: --model openai-community/{cfg.model})" if cfg.model in _OPENAI else ""
        log(f"from scratch: preset {cfg.model!r}, {model.num_parameters() / 1e6:.1f}M parameters{hint}")
        return model
    arch = [f"--{k.replace('_', '-')}" for k in ARCH_OVERRIDES if getattr(cfg, k) is not None]
    if arch:
        raise ValueError(f"{', '.join(arch)} only apply to from-scratch runs (--model one of "
                         f"{', '.join(PRESETS)}); {cfg.model!r} is a checkpoint to fine-tune")
    model = load_model(_fine_tune_source(cfg.model), dtype=torch.float32, device="cpu", allow_int8=False)
    if cfg.dropout is not None and cfg.dropout != model.config.dropout:
        fresh = GPT2(model.config.replace(dropout=cfg.dropout))
        fresh.load_state_dict(model.state_dict())
        model = fresh
    log(f"fine-tuning {cfg.model}: {model.num_parameters() / 1e6:.1f}M parameters")
    return model


def _fine_tune_source(name: str) -> Path:
    """The local directory of the checkpoint to fine-tune; a name that is none names the presets too."""
    try:
        return resolve_source(name)[1]
    except FileNotFoundError as e:
        if "/" in name or os.sep in name or name.startswith((".", "~")):
            raise  # a path: its own message says what is missing
        close = difflib.get_close_matches(name, [*PRESETS, *HUB_NAMES], n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise FileNotFoundError(
            f"{name}: neither a preset to train from scratch ({', '.join(PRESETS)}) nor a checkpoint to "
            f"fine-tune (a directory, a published GPT-2 name: {', '.join(HUB_NAMES)}, or a hub id owner/name)"
            f"{hint}") from e


def _make_contiguous(model: nn.Module) -> None:
    """Store every parameter row-major (contiguous), in place.

    Loaders may hand over transposed views (HF's Conv1D and TF's [in, out] matrices); AdamW's moments
    copy their parameter's strides and are saved with them, while a resumed model is built row-major.
    Fused AdamW walks parameter, gradient and moments as flat memory, so a layout mismatch pairs the
    wrong elements. One layout for every run, fresh or resumed, removes the mismatch at its source.
    """
    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()


def _match_param_layout(optimizer: torch.optim.Optimizer | Optimizers) -> None:
    """Give each restored optimizer state tensor its parameter's memory layout (values unchanged).

    load_state_dict keeps the strides the tensors were saved with; a checkpoint written by a run whose
    parameters had another layout would otherwise be paired element-by-memory-slot with the wrong values.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def _make_optimizer(model: nn.Module, cfg: TrainConfig) -> Optimizers:
    """cfg.optimizer (gpt2kit.train.optim.make_optimizer): AdamW, or Muon for the block matrices + AdamW."""
    return make_optimizer(model, cfg.optimizer or _default_optimizer(), lr=cfg.lr,
                          weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr, muon_dtype=cfg.muon_dtype)


def _default_optimizer() -> str:
    return "muon" if muon_available() else "adamw"


def _autocast(cfg: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if cfg.dtype == "float32":
        return contextlib.nullcontext
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} does not support bfloat16")
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _resolve(cfg: TrainConfig, model: GPT2, world_size: int, device: torch.device) -> tuple[TrainConfig, int]:
    """Fill the None fields from the model and world size; return (config, accumulation steps A)."""
    n_ctx = model.config.n_ctx
    seq_len = cfg.seq_len or n_ctx
    if seq_len > n_ctx:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context n_ctx={n_ctx}")
    unit = cfg.batch_size * seq_len * world_size
    total = cfg.total_batch_tokens or unit
    if total % unit:
        raise ValueError(batch_message(total, cfg.batch_size, seq_len, world_size))
    optimizer = cfg.optimizer or ("adamw" if cfg.fsdp else _default_optimizer())
    cfg = cfg.replace(
        seq_len=seq_len, total_batch_tokens=total,
        min_lr=cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr,
        warmup_steps=cfg.max_steps // 20 if cfg.warmup_steps is None else cfg.warmup_steps,
        dropout=model.config.dropout,
        optimizer=optimizer,
        muon_dtype=_muon_dtype(cfg, optimizer, device),
        distill_dtype=cfg.distill_dtype or (distill.default_dtype(device) if cfg.distill_from else None),
    )
    return cfg, total // unit


def _muon_dtype(cfg: TrainConfig, optimizer: str, device: torch.device) -> str | None:
    """cfg.muon_dtype, or for a Muon run the dtype newton_schulz_dtype picks for cfg.dtype on device;
    saved in checkpoint.pt, so a resumed run orthogonalises as it did whichever machine it moves to."""
    if optimizer != "muon":
        if cfg.muon_dtype is not None:
            raise ValueError(f"--muon-dtype {cfg.muon_dtype} needs --optimizer muon (this run uses {optimizer})")
        return None
    return cfg.muon_dtype or str(newton_schulz_dtype(cfg.dtype, device)).removeprefix("torch.")


def _check_resume(saved: TrainConfig, cfg: TrainConfig) -> None:
    changed = [f"{f.name} (checkpoint {getattr(saved, f.name)!r}, now {getattr(cfg, f.name)!r})"
               for f in dataclasses.fields(TrainConfig)
               if f.name not in RESUMABLE_CHANGES and getattr(cfg, f.name) is not None
               and getattr(cfg, f.name) != getattr(saved, f.name)]
    if changed:
        raise ValueError(f"--resume continues the saved run, but these settings differ: {'; '.join(changed)}; "
                         f"a resumed run may change only {', '.join(sorted(RESUMABLE_CHANGES))}")


@dataclass
class Run:
    """What the loop needs, built once by build_run()."""

    cfg: TrainConfig
    dist: Dist
    raw: GPT2  # the plain module: its state_dict is what we save
    model: nn.Module  # what runs forward/backward (compiled and/or DDP-wrapped)
    eval_model: nn.Module  # compiled or raw, never DDP
    optimizer: Optimizers
    train_loader: RandomWindowLoader | ShardLoader
    val_loader: ShardLoader | None
    eval_batches: int
    accum: int
    autocast: Callable[[], contextlib.AbstractContextManager]
    out: Path
    step: int = 0
    sharded: str | None = None  # --fsdp: the sharded checkpoint checkpoint.pt names
    output_step: int | None = None  # the step of the model (or adapter) OUT holds, None if none


def build_run(cfg: TrainConfig, d: Dist) -> tuple[Run, bool]:
    """The run cfg describes, built fresh or restored from OUT/checkpoint.pt (model, optimizer, data
    position, step, RNG states); returns it and whether it starts fresh (no earlier steps).
    """
    out = Path(cfg.out)
    log = d.print0
    ckpt = read_checkpoint(out / CHECKPOINT_NAME) if cfg.resume else None
    if ckpt is not None:
        saved = TrainConfig(**saved_config(ckpt["config"]))
        _check_resume(saved, cfg)
        cfg = saved.replace(**{k: getattr(cfg, k) for k in RESUMABLE_CHANGES})
    if ckpt is None and (out / CHECKPOINT_NAME).exists():
        raise FileExistsError(f"{out / CHECKPOINT_NAME} exists: pass --resume to continue that run, "
                              f"or choose another --out (or delete it) to start a new one")
    find_shards(cfg.data, "train")  # fail early, with the data module's message, if there are none
    if cfg.fsdp:
        fsdp.check(cfg, d)

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if ckpt is None or cfg.lora_rank is not None or cfg.fsdp:  # rebuilt; checkpoint.pt holds the adapter / the
        # sharded checkpoint's name
        raw = _build_model(cfg, log, d.device)
    else:
        model_config = GPT2Config(**ckpt["model_config"])
        check_memory(model_config, d.device, f"the model in {out / CHECKPOINT_NAME}")
        raw = GPT2(model_config)
        raw.load_state_dict(ckpt["model"])
    cfg, accum = _resolve(cfg, raw, d.world_size, d.device)
    raw.to(d.device)
    _make_contiguous(raw)
    what = finetune.prepare(raw, cfg)  # LoRA, frozen parameters, activation checkpointing
    if what is not None:
        log(what)
    if ckpt is not None and cfg.lora_rank is not None:
        finetune.load_checkpoint_state(raw, cfg, ckpt["model"])
    torch.manual_seed(cfg.seed + d.rank)  # ranks draw different dropout masks
    if d.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT/llm.c: TF32 matmuls for float32 on GPUs
        torch.backends.cudnn.allow_tf32 = True

    # What runs forward: the model with the fused chunked loss (no (B, T, V) logits; gpt2kit.train.loss).
    loss_model = _loss_model(cfg, raw, d)
    if cfg.fsdp:
        fsdp.shard(loss_model)  # before the optimizer: it takes the sharded parameters
    optimizer = _make_optimizer(raw, cfg)
    fwd: nn.Module = torch.compile(loss_model) if cfg.compile else loss_model
    model = fwd
    if d.enabled and not cfg.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(fwd, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    B, T, W = cfg.batch_size, cfg.seq_len, d.world_size
    train_loader = _train_loader(cfg, d)
    val_loader, eval_batches = _val_loader(cfg, d)
    train_loader, val_loader = with_masks(train_loader), with_masks(val_loader)  # prompt/completion loss masks
    for loader in (train_loader, val_loader):
        if loader is not None:
            loader.check_vocab(raw.config.n_vocab)
    run = Run(cfg, d, raw, model, fwd, optimizer, train_loader, val_loader, eval_batches, accum,
              _autocast(cfg, d.device), out)
    if ckpt is not None:
        _restore(run, ckpt, loss_model)
        del ckpt
    log(f"{W} x {B} x {T} tokens x {accum} micro-steps = {cfg.total_batch_tokens:,} tokens per step, "
        f"{cfg.max_steps} steps, {cfg.dtype} on {d.device}"
        + (f" (Muon's Newton-Schulz in {cfg.muon_dtype})" if cfg.muon_dtype else ""))
    return run, run.step == 0 and not cfg.resume


def _loss_model(cfg: TrainConfig, raw: GPT2, d: Dist) -> TrainingLoss:
    teacher = None
    if cfg.distill_from is not None:
        teacher = distill.load_teacher(cfg.distill_from, _fine_tune_source(cfg.distill_from), raw.config,
                                       cfg.seq_len, cfg.distill_dtype, d.device)
        d.print0(f"distilling from {cfg.distill_from} ({teacher.num_parameters() / 1e6:.1f}M parameters, "
                 f"{cfg.distill_dtype}): targets {cfg.distill_weight:g} x its probabilities"
                 + (f" + {1 - cfg.distill_weight:g} x the data's tokens" if cfg.distill_weight < 1 else ""))
    return TrainingLoss(raw, teacher=teacher, teacher_weight=cfg.distill_weight)


def _train_loader(cfg: TrainConfig, d: Dist) -> RandomWindowLoader | ShardLoader:
    B, T, W = cfg.batch_size, cfg.seq_len, d.world_size
    if cfg.sampling == "random":
        return RandomWindowLoader(cfg.data, "train", batch_size=B, seq_len=T, seed=cfg.seed, rank=d.rank,
                                  world_size=W)
    return ShardLoader(cfg.data, "train", batch_size=B, seq_len=T, rank=d.rank, world_size=W)


def _restore(run: Run, ckpt: dict[str, Any], loss_model: TrainingLoss) -> None:
    """The optimizer, data position, step and RNG states of the run OUT/checkpoint.pt holds."""
    cfg, d, out = run.cfg, run.dist, run.out
    log, W = d.print0, d.world_size
    if cfg.fsdp:
        fsdp.load_sharded(loss_model, run.optimizer, out, ckpt["sharded"])
    else:
        run.optimizer.load_state_dict(ckpt["optimizer"])
        _match_param_layout(run.optimizer)
    run.train_loader.load_state_dict(ckpt["loader"])
    run.step = int(ckpt["step"])
    run.sharded = ckpt.get("sharded")
    # written before checkpoints said it: the output, if there is one, was written with the checkpoint
    legacy = run.step if finetune.output_written(out, cfg) else None
    run.output_step = ckpt.get("output_step", legacy)
    if cfg.max_steps < run.step:
        raise ValueError(f"--max-steps {cfg.max_steps} is below the step {out / CHECKPOINT_NAME} is at "
                         f"({run.step}); a run cannot go back: pass --max-steps above {run.step} to extend it")
    rngs = ckpt["rng"]
    if len(rngs) == W:
        set_rng_state(rngs[d.rank], d.device)
    else:
        log(f"warning: the checkpoint was written by {len(rngs)} ranks, this run has {W}: "
            f"dropout masks will differ from an uninterrupted run")
    log(f"resuming {out / CHECKPOINT_NAME} at step {run.step}")


def _val_loader(cfg: TrainConfig, d: Dist) -> tuple[ShardLoader | None, int]:
    try:
        find_shards(cfg.data, "val")
    except ValueError:
        if d.master:
            warnings.warn(f"{cfg.data} has no val_*.bin shards: no validation loss will be reported",
                          stacklevel=3)
        return None, 0
    B, T, W = cfg.batch_size, cfg.seq_len, d.world_size
    try:
        loader = ShardLoader(cfg.data, "val", batch_size=B, seq_len=T, rank=d.rank, world_size=W)
    except ValueError as e:
        raise ValueError(f"the validation split is too small to evaluate: {e}; prepare the data with a larger "
                         f"--val-fraction, or use a smaller --batch-size / --seq-len") from None
    windows = sum((n - 1) // (W * B * T) for n in loader.counts)
    return loader, min(cfg.eval_steps, windows)  # at most one pass over the validation split
