"""The training loop: pre-train or fine-tune GPT-2 on token shards, from one CPU to many GPUs.

    cfg = TrainConfig(data="shards/", out="runs/tiny", model="gpt2-tiny", max_steps=500)
    result = train(cfg)

One optimizer step is A micro-steps of (B, T) tokens on each of W ranks, so the step sees
total_batch_tokens = A * W * B * T tokens, drawn as random windows from all shards
(RandomWindowLoader; sampling="sequential" reads them in order). The loss is the model's mean
next-token cross-entropy, computed by gpt2kit.train.loss without the (B, T, V) logits; each micro-step's
loss is divided by A so the accumulated gradient is the mean. The optimizer and the schedule come
from gpt2kit.train.optim (Muon for the block matrices + AdamW for the rest, or AdamW; WSD or cosine).

OUT holds, when a run ends (finished, --stop-at, or interrupted by SIGINT/SIGTERM):
    config.json, model.safetensors, tokenizer files   the model in Hugging Face's format
    checkpoint.pt    model, optimizer, step, RNG states, data position, the TrainConfig
    metrics.jsonl    {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} per step, {"step", "val_loss"} per eval
    loss.png         train and validation loss, redrawn at each evaluation
    .lock            flock'ed by the run writing OUT; names it (pid, host)
checkpoint.pt is also written every save_every steps, atomically (temporary file, fsync, rename),
and ends with its SHA-256, which resuming checks. A non-finite loss stops the run without saving.

Distributed data parallel: gpt2kit.train.distributed joins the process group torchrun describes; every
rank reads its own slice of each batch (the loaders' rank, world_size), DDP averages gradients on the
last micro-step only (no_sync on the others), and rank 0 alone writes files and logs. metrics.jsonl,
loss.png and the progress output live in gpt2kit.train.metrics, checkpoint.pt's format and the lock on
OUT in gpt2kit.train.run_dir, the settings in gpt2kit.train.config, building and restoring a run
(model, optimizer, loaders, resume from checkpoint.pt) in gpt2kit.train.build. This module holds the loop: accumulation,
autocast, evaluation, signals, non-finite stops and saving.

Legend: B batch size, T sequence length, W world size (ranks), A gradient-accumulation micro-steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpt2kit._io import no_space_error, out_of_space
from gpt2kit.train import distributed, finetune, flops, fsdp
from gpt2kit.train.build import Run, build_run, saved_config
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.metrics import PLOT_NAME, Metrics, Reporter
from gpt2kit.train.optim import lr_factor
from gpt2kit.train.run_dir import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    claim_out,
    read_checkpoint,
    rng_state,
    write_checkpoint,
)


@dataclass(frozen=True)
class TrainResult:
    step: int  # optimizer steps done in total
    loss: float | None  # the last step's train loss (None if this invocation took no step)
    val_loss: float | None  # the last evaluation's loss
    tokens: int  # tokens trained on in this invocation
    seconds: float  # wall time of this invocation's steps
    out: Path


def resume_config(out: str | os.PathLike[str], **changes: Any) -> TrainConfig:
    """The TrainConfig saved in OUT/checkpoint.pt, with `changes` applied and resume=True.

    The CLI uses this so that `gpt2kit train --out OUT --resume` needs no other flag; train() then
    rejects changes outside RESUMABLE_CHANGES.
    """
    # The config only; train() verifies the checksum when it reads the whole file.
    saved = saved_config(read_checkpoint(Path(out) / CHECKPOINT_NAME, mmap=True, verify=False)["config"])
    # stop_at belongs to the invocation that saved, not to the run.
    return TrainConfig(**(saved | {"out": os.fspath(out), "stop_at": None} | changes | {"resume": True}))


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


def train(cfg: TrainConfig) -> TrainResult:
    """Train as `cfg` says; see the module docstring for what is written to cfg.out.

    Raises ValueError for bad settings (naming them), FileNotFoundError for missing data or
    checkpoint, and KeyboardInterrupt after saving when stopped by SIGINT/SIGTERM.
    """
    d = distributed.setup(cfg.device)
    try:
        with claim_out(Path(cfg.out), d):
            run, fresh = build_run(cfg, d)
            return _loop(run, fresh=fresh)
    finally:
        distributed.teardown(d)


def _loop(run: Run, *, fresh: bool) -> TrainResult:
    cfg, d = run.cfg, run.dist
    metrics = Metrics(run.out, None if fresh else run.step) if d.master else None
    eval_tokens = run.eval_batches * cfg.batch_size * cfg.seq_len * d.world_size if run.val_loader else 0
    reporter = Reporter(d.master, run.step, cfg.max_steps, cfg.log_every, eval_every=cfg.eval_every,
                        eval_tokens=eval_tokens)
    last_loss = val_loss = None
    tokens, seconds = 0, 0.0
    end = cfg.max_steps if cfg.stop_at is None else min(cfg.max_steps, cfg.stop_at)
    utilisation = _utilisation(run, reporter) if d.master and run.step < end else None
    try:
        with _StopSignal() as stop:
            # Step 0 is evaluated only when fine-tuning: the base's loss is the baseline. An untrained
            # model's (near ln(vocab)) tells nothing the first train losses do not, for a whole evaluation.
            if fresh and run.val_loader is not None and cfg.eval_every and not cfg.from_scratch:
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
                if utilisation is not None:
                    rec["mfu"] = utilisation(rec["tokens_per_s"])
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
        if run.output_step != run.step:  # the previous invocation died before exporting this step
            _save(run, metrics, model_too=True, state_too=False)
        reporter.line(f"nothing to do: {run.out} is already at step {run.step} (--max-steps {cfg.max_steps}"
                      + (f", --stop-at {cfg.stop_at}" if cfg.stop_at is not None else "")
                      + "); pass a larger --max-steps to extend the run")
    if d.master and tokens:
        reporter.line(f"done: step {run.step}, loss {last_loss:.4f}"
                      + (f", val loss {val_loss:.4f}" if val_loss is not None else "")
                      + f", {tokens / seconds:,.0f} tok/s"
                      + (f" (MFU {utilisation(tokens / seconds):.1%})" if utilisation is not None else "")
                      + f"; {finetune.output_said(cfg, run.out)}")
    return TrainResult(run.step, last_loss, val_loss, tokens, seconds, run.out)


def _utilisation(run: Run, reporter: Reporter) -> Callable[[float], float]:
    """tokens/s -> MFU for this run (gpt2kit.train.flops), its peak rate measured or looked up once
    here and said on the progress output."""
    cfg, d = run.cfg, run.dist
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    per_token = flops.flops_per_token(run.raw, cfg.seq_len)
    peak = flops.peak_rate(d.device, dtype)
    reporter.line(f"MFU: model FLOPs ({per_token / 1e6:,.1f} MFLOP a token) against {peak.describe()}"
                  + (f" x {d.world_size} ranks" if d.world_size > 1 else ""))
    return lambda tokens_per_s: flops.mfu(tokens_per_s, per_token, peak, d.world_size)


def _batches(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    dev = run.dist.device
    for _ in range(run.accum):
        x, y = run.train_loader.next_batch()  # (B, T), (B, T)
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)


class NonFiniteLoss(FloatingPointError):
    """The loss or the gradient norm became NaN or infinite; nothing was saved after it."""


def _non_finite_message(run: Run, loss: float, grad_norm: float) -> str:
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


def _train_step(run: Run, stop_requested: Callable[[], bool]) -> tuple[float, float, float, bool]:
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
def _evaluate(run: Run, metrics: Metrics | None, reporter: Reporter) -> float:
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


def _save(run: Run, metrics: Metrics | None, *, model_too: bool, state_too: bool = True) -> None:
    """checkpoint.pt (all ranks gather their RNG states, rank 0 writes) after, if model_too, the HF
    model or adapter. The output first and checkpoint.pt last, which records the step the output is
    at: a kill at any point leaves checkpoint.pt whole, naming a whole sharded checkpoint, and never
    claiming an output newer than the one in OUT (resuming redoes what it does not claim).
    state_too=False: the state on disk is the run's already (a resume with nothing to train); the
    sharded checkpoint checkpoint.pt names is kept, not written again over itself."""
    rngs = run.dist.gather(rng_state(run.dist.device))
    if run.cfg.fsdp and state_too:
        run.sharded = fsdp.save_sharded(run.model, run.optimizer, run.out, run.step)
    result = fsdp.full_model(run.model, run.raw) if run.cfg.fsdp and model_too else run.raw  # collectives
    if run.dist.master:
        failed = None
        if model_too:
            try:
                finetune.save_output(result, run.cfg, run.out)
                run.output_step = run.step
            except Exception as e:  # safetensors' SafetensorError is neither an OSError nor a RuntimeError
                if not isinstance(e, (OSError, RuntimeError)) and not out_of_space(e, run.out):
                    raise
                failed = e  # checkpoint.pt is still written: the training state is not lost with the export
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": run.step,
            "config": run.cfg.to_dict(),
            "model_config": dataclasses.asdict(run.raw.config),
            "model": {} if run.sharded else finetune.checkpoint_state(run.raw, run.cfg),
            "optimizer": {} if run.sharded else run.optimizer.state_dict(),
            "sharded": run.sharded,  # the torch.distributed.checkpoint directory holding both (--fsdp)
            "output_step": run.output_step,  # the step of the model (or adapter) in OUT, None if none
            "rng": rngs,
            "loader": run.train_loader.state_dict(),
            "world_size": run.dist.world_size,
        }
        write_checkpoint(run.out / CHECKPOINT_NAME, state)
        if run.sharded:
            fsdp.remove_older(run.out, keep=run.sharded)
        if failed is not None:
            if out_of_space(failed, run.out):
                raise no_space_error(run.out, "saving the model",
                                     f"{CHECKPOINT_NAME} (step {run.step}) was saved") from failed
            raise failed
        if model_too and metrics is not None and metrics.train:
            metrics.plot(run.out / PLOT_NAME, f"{run.cfg.model} on {Path(run.cfg.data).name}")
    run.dist.barrier()
