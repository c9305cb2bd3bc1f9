"""The training loop: pre-train or fine-tune GPT-2 on token shards, from one CPU to many GPUs.

    cfg = TrainConfig(data="shards/", out="runs/tiny", model="gpt2-tiny", max_steps=500)
    result = train(cfg)

One optimizer step is A micro-steps of (B, T) tokens on each of W ranks, so the step sees
total_batch_tokens = A * W * B * T tokens, drawn as random windows from all shards
(RandomWindowLoader; sampling="sequential" reads them in order). The loss is the model's mean
next-token cross-entropy, computed by gpt2kit.loss without the (B, T, V) logits; each micro-step's
loss is divided by A so the accumulated gradient is the mean. The optimizer and the schedule come
from gpt2kit.optim (Muon for the block matrices + AdamW for the rest, or AdamW; WSD or cosine).

OUT holds, when a run ends (finished, --stop-at, or interrupted by SIGINT/SIGTERM):
    config.json, model.safetensors, tokenizer files   the model in Hugging Face's format
    checkpoint.pt    model, optimizer, step, RNG states, data position, the TrainConfig
    metrics.jsonl    {"step", "loss", "lr", "grad_norm", "tokens_per_s"} per step, {"step", "val_loss"} per eval
    loss.png         train and validation loss, redrawn at each evaluation
    .lock            flock'ed by the run writing OUT; names it (pid, host)
checkpoint.pt is also written every save_every steps, atomically (temporary file, fsync, rename),
and ends with its SHA-256, which resuming checks. A non-finite loss stops the run without saving.

Distributed data parallel: gpt2kit.distributed joins the process group torchrun describes; every
rank reads its own slice of each batch (the loaders' rank, world_size), DDP averages gradients on the
last micro-step only (no_sync on the others), and rank 0 alone writes files and logs. metrics.jsonl,
loss.png and the progress output live in gpt2kit.metrics, checkpoint.pt's format and the lock on
OUT in gpt2kit.run_dir, the settings in gpt2kit.train_config. This module holds resuming and the
loop.

Legend: B batch size, T sequence length, W world size (ranks), A gradient-accumulation micro-steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import math
import os
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpt2kit import distributed, finetune, fsdp
from gpt2kit.checkpoint import load_model, resolve_source
from gpt2kit.checkpoint.source import HUB_NAMES
from gpt2kit.completions import with_masks
from gpt2kit.config import PRESETS, GPT2Config
from gpt2kit.data.loaders import RandomWindowLoader, ShardLoader
from gpt2kit.data.shard import find_shards
from gpt2kit.distributed import Dist
from gpt2kit.loss import TrainingLoss
from gpt2kit.metrics import PLOT_NAME, Metrics, Reporter
from gpt2kit.model import GPT2
from gpt2kit.optim import (
    ADAM_BETAS,  # noqa: F401 - re-exported for benchmarks
    ADAM_EPS,  # noqa: F401
    Optimizers,
    lr_factor,
    make_optimizer,
    param_groups,  # noqa: F401
)
from gpt2kit.run_dir import (  # noqa: F401 - CHECKPOINT_NAME, OutInUse re-exported: train's names before the split (#9)
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    OutInUse,
    claim_out,
    no_space,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from gpt2kit.train_config import ARCH_OVERRIDES, TrainConfig, batch_message, muon_available

# What a checkpoint written before these settings existed ran with.
_LEGACY = {"optimizer": "adamw", "schedule": "cosine", "sampling": "sequential"}
_OPENAI = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # presets that are also hub ids
# Settings a resumed run may change without changing what is computed (max_steps changes the
# schedule from the resumed step on, which is what extending a run means).
RESUMABLE_CHANGES = frozenset({"data", "out", "max_steps", "eval_every", "eval_steps", "save_every",
                               "log_every", "device", "compile", "resume", "stop_at", "batch_size",
                               "activation_checkpointing"})


@dataclass(frozen=True)
class TrainResult:
    step: int  # optimizer steps done in total
    loss: float | None  # the last step's train loss (None if this invocation took no step)
    val_loss: float | None  # the last evaluation's loss
    tokens: int  # tokens trained on in this invocation
    seconds: float  # wall time of this invocation's steps
    out: Path


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int,
                  schedule: str = "cosine") -> float:
    """The rate for 0-based step `step`: linear warmup to lr over warmup_steps, then the schedule
    (cosine, or wsd's flat stretch and linear decay; gpt2kit.optim.lr_factor) to min_lr at max_steps."""
    return lr * lr_factor(step, schedule=schedule, warmup_steps=warmup_steps, max_steps=max_steps,
                          min_lr_ratio=min_lr / lr)


def _saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config dict, with what older versions ran with filled in for newer settings."""
    return {k: v for k, v in _LEGACY.items() if k not in saved} | saved


def resume_config(out: str | os.PathLike[str], **changes: Any) -> TrainConfig:
    """The TrainConfig saved in OUT/checkpoint.pt, with `changes` applied and resume=True.

    The CLI uses this so that `gpt2kit train --out OUT --resume` needs no other flag; train() then
    rejects changes outside RESUMABLE_CHANGES.
    """
    # The config only; train() verifies the checksum when it reads the whole file.
    saved = _saved_config(read_checkpoint(Path(out) / CHECKPOINT_NAME, mmap=True, verify=False)["config"])
    # stop_at belongs to the invocation that saved, not to the run.
    return TrainConfig(**(saved | {"out": os.fspath(out), "stop_at": None} | changes | {"resume": True}))


# ---------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM: finish the step, save, then stop


class _StopSignal:
    """The first SIGINT/SIGTERM asks the loop to stop after the current step (and save); a second
    one raises KeyboardInterrupt at once (the last checkpoint on disk stays whole)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        name = signal.Signals(signum).name
        print(f"\n{name} received: saving a checkpoint after this step (again to quit without saving)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------
# model and optimizer


# float32 weights, gradients and AdamW's two moments; activations come on top and depend on B and T.
TRAIN_BYTES_PER_PARAMETER = 16


def parameter_count(config: GPT2Config) -> int:
    """The parameters GPT2(config) has, computed without building it."""
    C = config.n_embd
    block = 12 * C * C + 13 * C  # ln_1, c_attn, attn c_proj, ln_2, c_fc, mlp c_proj
    return config.embedding_rows * C + config.n_ctx * C + config.n_layer * block + 2 * C


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (CPU: MemAvailable), or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


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
    """cfg.optimizer (gpt2kit.optim.make_optimizer): AdamW, or Muon for the block matrices + AdamW."""
    return make_optimizer(model, cfg.optimizer or _default_optimizer(), lr=cfg.lr,
                          weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr)


def _default_optimizer() -> str:
    return "muon" if muon_available() else "adamw"


def _autocast(cfg: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if cfg.dtype == "float32":
        return contextlib.nullcontext
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} does not support bfloat16")
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _resolve(cfg: TrainConfig, model: GPT2, world_size: int) -> tuple[TrainConfig, int]:
    """Fill the None fields from the model and world size; return (config, accumulation steps A)."""
    n_ctx = model.config.n_ctx
    seq_len = cfg.seq_len or n_ctx
    if seq_len > n_ctx:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context n_ctx={n_ctx}")
    unit = cfg.batch_size * seq_len * world_size
    total = cfg.total_batch_tokens or unit
    if total % unit:
        raise ValueError(batch_message(total, cfg.batch_size, seq_len, world_size))
    cfg = cfg.replace(
        seq_len=seq_len, total_batch_tokens=total,
        min_lr=cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr,
        warmup_steps=cfg.max_steps // 20 if cfg.warmup_steps is None else cfg.warmup_steps,
        dropout=model.config.dropout,
        optimizer=cfg.optimizer or ("adamw" if cfg.fsdp else _default_optimizer()),
    )
    return cfg, total // unit


def _check_resume(saved: TrainConfig, cfg: TrainConfig) -> None:
    changed = [f"{f.name} (checkpoint {getattr(saved, f.name)!r}, now {getattr(cfg, f.name)!r})"
               for f in dataclasses.fields(TrainConfig)
               if f.name not in RESUMABLE_CHANGES and getattr(cfg, f.name) is not None
               and getattr(cfg, f.name) != getattr(saved, f.name)]
    if changed:
        raise ValueError(f"--resume continues the saved run, but these settings differ: {'; '.join(changed)}; "
                         f"a resumed run may change only {', '.join(sorted(RESUMABLE_CHANGES))}")


# ---------------------------------------------------------------------------------------------
# the loop


@dataclass
class _Run:
    """What the loop needs, built once by train()."""

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


def train(cfg: TrainConfig) -> TrainResult:
    """Train as `cfg` says; see the module docstring for what is written to cfg.out.

    Raises ValueError for bad settings (naming them), FileNotFoundError for missing data or
    checkpoint, and KeyboardInterrupt after saving when stopped by SIGINT/SIGTERM.
    """
    d = distributed.setup(cfg.device)
    try:
        with claim_out(Path(cfg.out), d):
            return _train(cfg, d)
    finally:
        distributed.teardown(d)


def _train(cfg: TrainConfig, d: Dist) -> TrainResult:
    out = Path(cfg.out)
    log = d.print0
    ckpt = read_checkpoint(out / CHECKPOINT_NAME) if cfg.resume else None
    if ckpt is not None:
        saved = TrainConfig(**_saved_config(ckpt["config"]))
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
    cfg, accum = _resolve(cfg, raw, d.world_size)
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

    # What runs forward: the model with the fused chunked loss (no (B, T, V) logits; gpt2kit.loss).
    loss_model = TrainingLoss(raw)
    if cfg.fsdp:
        fsdp.shard(loss_model)  # before the optimizer: it takes the sharded parameters
    optimizer = _make_optimizer(raw, cfg)
    fwd: nn.Module = torch.compile(loss_model) if cfg.compile else loss_model
    model = fwd
    if d.enabled and not cfg.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(fwd, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    B, T, W = cfg.batch_size, cfg.seq_len, d.world_size
    if cfg.sampling == "random":
        train_loader = RandomWindowLoader(cfg.data, "train", batch_size=B, seq_len=T, seed=cfg.seed, rank=d.rank,
                                          world_size=W)
    else:
        train_loader = ShardLoader(cfg.data, "train", batch_size=B, seq_len=T, rank=d.rank, world_size=W)
    val_loader, eval_batches = _val_loader(cfg, d)
    train_loader, val_loader = with_masks(train_loader), with_masks(val_loader)  # prompt/completion loss masks
    for loader in (train_loader, val_loader):
        if loader is not None:
            loader.check_vocab(raw.config.n_vocab)
    run = _Run(cfg, d, raw, model, fwd, optimizer, train_loader, val_loader, eval_batches, accum,
               _autocast(cfg, d.device), out)
    if ckpt is not None:
        if cfg.fsdp:
            fsdp.load_sharded(loss_model, optimizer, out, ckpt["sharded"])
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
            _match_param_layout(optimizer)
        train_loader.load_state_dict(ckpt["loader"])
        run.step = int(ckpt["step"])
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
        del ckpt
    log(f"{W} x {B} x {T} tokens x {accum} micro-steps = {cfg.total_batch_tokens:,} tokens per step, "
        f"{cfg.max_steps} steps, {cfg.dtype} on {d.device}")
    return _loop(run, fresh=run.step == 0 and not cfg.resume)


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


def _loop(run: _Run, *, fresh: bool) -> TrainResult:
    cfg, d = run.cfg, run.dist
    metrics = Metrics(run.out, None if fresh else run.step) if d.master else None
    eval_tokens = run.eval_batches * cfg.batch_size * cfg.seq_len * d.world_size if run.val_loader else 0
    reporter = Reporter(d.master, run.step, cfg.max_steps, cfg.log_every, eval_every=cfg.eval_every,
                        eval_tokens=eval_tokens)
    last_loss = val_loss = None
    tokens, seconds = 0, 0.0
    end = cfg.max_steps if cfg.stop_at is None else min(cfg.max_steps, cfg.stop_at)
    try:
        with _StopSignal() as stop:
            if fresh and run.val_loader is not None and cfg.eval_every:
                val_loss = _evaluate(run, metrics, reporter)
            while run.step < end:
                t0 = time.perf_counter()
                loss, grad_norm, lr, stop_now = _train_step(run, lambda: stop.requested)
                dt = time.perf_counter() - t0
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    raise NonFiniteLoss(_non_finite_message(run, loss, grad_norm))
                stop_now = stop_now or (stop.requested and not d.enabled)  # a signal during the update
                run.step += 1
                tokens += cfg.total_batch_tokens
                seconds += dt
                last_loss = loss
                rec = {"step": run.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                       "tokens_per_s": cfg.total_batch_tokens / dt}
                if metrics is not None:
                    metrics.log(rec)
                reporter.step(rec, dt)
                if stop_now:
                    _save(run, metrics, model_too=True)
                    reporter.line(f"stopped at step {run.step}: saved {run.out / CHECKPOINT_NAME} and the model; "
                                  f"continue with --resume")
                    raise KeyboardInterrupt
                last = run.step == end
                if run.val_loader is not None and (last or (cfg.eval_every and run.step % cfg.eval_every == 0)):
                    val_loss = _evaluate(run, metrics, reporter)
                if last or (cfg.save_every and run.step % cfg.save_every == 0):
                    _save(run, metrics, model_too=last)
    finally:
        reporter.close()
        if metrics is not None:
            metrics.close()
    if run.step >= end and tokens == 0:  # nothing to do (e.g. resumed at max_steps)
        if not finetune.output_written(run.out, cfg):  # the previous invocation died before exporting
            _save(run, metrics, model_too=True)
        reporter.line(f"nothing to do: {run.out} is already at step {run.step} (--max-steps {cfg.max_steps}"
                      + (f", --stop-at {cfg.stop_at}" if cfg.stop_at is not None else "")
                      + "); pass a larger --max-steps to extend the run")
    if d.master and tokens:
        reporter.line(f"done: step {run.step}, loss {last_loss:.4f}"
                      + (f", val loss {val_loss:.4f}" if val_loss is not None else "")
                      + f", {tokens / seconds:,.0f} tok/s; model in {run.out}")
    return TrainResult(run.step, last_loss, val_loss, tokens, seconds, run.out)


def _batches(run: _Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    dev = run.dist.device
    for _ in range(run.accum):
        x, y = run.train_loader.next_batch()  # (B, T), (B, T)
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)


class NonFiniteLoss(FloatingPointError):
    """The loss or the gradient norm became NaN or infinite; nothing was saved after it."""


def _non_finite_message(run: _Run, loss: float, grad_norm: float) -> str:
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    ckpt = run.out / CHECKPOINT_NAME
    kept = f"{ckpt} (step {_saved_step(ckpt)})" if ckpt.exists() else "no checkpoint (none was written yet)"
    return (f"step {run.step + 1}: {what}: training diverged or the weights hold non-finite values; stopped "
            f"without saving: the last good checkpoint is {kept}; a lower --lr may help")


def _saved_step(path: Path) -> str:
    try:
        return str(read_checkpoint(path, mmap=True, verify=False)["step"])
    except (OSError, ValueError, KeyError):
        return "unreadable"


def _train_step(run: _Run, stop_requested: Callable[[], bool]) -> tuple[float, float, float, bool]:
    """One optimizer step. Returns (mean loss over all ranks, grad norm, lr, whether any rank asked to stop)."""
    cfg, d, model = run.cfg, run.dist, run.model
    model.train()
    loss_sum = torch.zeros((), device=d.device)
    for i, (x, y) in enumerate(_batches(run)):
        # Gradients are averaged across ranks on the last micro-step only.
        sync = i == run.accum - 1 or not d.enabled or cfg.fsdp  # FSDP reduce-scatters every micro-step
        with contextlib.nullcontext() if sync else model.no_sync():
            with run.autocast():
                loss = model(x, y) / run.accum
            loss.backward()
        loss_sum += loss.detach()
    # One all-reduce carries the loss and the stop flag, so every rank stops after the same step.
    # The stop flag is read after the backward pass, so a signal during it stops after this step.
    stats = d.sum(torch.stack([loss_sum, torch.tensor(float(stop_requested()), device=d.device)]))
    clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: the norm, with no clipping (x1.0)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw.parameters(), clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
    factor = lr_factor(run.step, schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                       min_lr_ratio=cfg.min_lr / cfg.lr)
    run.optimizer.set_lr_factor(factor)  # every group's own peak rate (lr, muon_lr) times the schedule
    lr = cfg.lr * factor
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    stats = stats.tolist()
    return stats[0] / d.world_size, float(grad_norm), lr, stats[1] > 0


@torch.no_grad()
def _evaluate(run: _Run, metrics: Metrics | None, reporter: Reporter) -> float:
    """Mean loss over the first eval_batches batches of the validation split (the same ones every time)."""
    assert run.val_loader is not None
    model, d = run.eval_model, run.dist
    model.eval()
    run.val_loader.reset()
    total = torch.zeros((), device=d.device)
    with reporter.evaluating(run.eval_batches) as advance:
        for _ in range(run.eval_batches):
            x, y = run.val_loader.next_batch()  # (B, T), (B, T)
            with torch.no_grad(), run.autocast():  # no_grad: the fused loss then skips its gradient products
                total += model(x.to(d.device), y.to(d.device)).float()
            advance()
    model.train()
    val_loss = d.sum(total).item() / (run.eval_batches * d.world_size)
    reporter.line(f"step {run.step}: val loss {val_loss:.4f} ({run.eval_batches} batches, "
                  f"{reporter.eval_seconds:.1f} s)")
    if metrics is not None:
        metrics.log({"step": run.step, "val_loss": val_loss})
        metrics.plot(run.out / PLOT_NAME, f"{run.cfg.model} on {Path(run.cfg.data).name}")
    return val_loss


def _save(run: _Run, metrics: Metrics | None, *, model_too: bool) -> None:
    """checkpoint.pt (all ranks gather their RNG states, rank 0 writes) and, if model_too, the HF model."""
    rngs = run.dist.gather(rng_state(run.dist.device))
    sharded = fsdp.save_sharded(run.model, run.optimizer, run.out, run.step) if run.cfg.fsdp else None
    result = fsdp.full_model(run.model, run.raw) if run.cfg.fsdp and model_too else run.raw  # collectives
    if run.dist.master:
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": run.step,
            "config": run.cfg.to_dict(),
            "model_config": dataclasses.asdict(run.raw.config),
            "model": {} if sharded else finetune.checkpoint_state(run.raw, run.cfg),
            "optimizer": {} if sharded else run.optimizer.state_dict(),
            "sharded": sharded,  # the torch.distributed.checkpoint directory holding both (--fsdp)
            "rng": rngs,
            "loader": run.train_loader.state_dict(),
            "world_size": run.dist.world_size,
        }
        write_checkpoint(run.out / CHECKPOINT_NAME, state)
        if sharded:
            fsdp.remove_older(run.out, keep=sharded)
        if model_too:
            try:
                finetune.save_output(result, run.cfg, run.out)
            except (OSError, RuntimeError) as e:
                if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or no_space(run.out):
                    raise OSError(errno.ENOSPC, f"no space left on {run.out} while saving the model; "
                                                f"{CHECKPOINT_NAME} (step {run.step}) was saved") from e
                raise
            if metrics is not None and metrics.train:
                metrics.plot(run.out / PLOT_NAME, f"{run.cfg.model} on {Path(run.cfg.data).name}")
    run.dist.barrier()
