"""TrainConfig: everything that defines a training run, and the one description of each setting.

Each field's metadata carries its help text (and, where the flag differs from the name, a short
flag or the choices); `gpt2kit train`'s flags are built from these fields, so the command line, the
Python API and the checkpoint's saved config cannot drift apart. No torch here: `gpt2kit train
--help` answers without importing it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from gpt2kit.config import DTYPE_NAMES, LORA_BIASES, PRESETS
from gpt2kit.validate import check_choice, check_int, check_number

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
SAMPLINGS = ("random", "sequential")
TRAIN_DTYPES = ("float32", "bfloat16")  # canonical names (float16 would need loss scaling and gains nothing)
ARCH_OVERRIDES = ("n_layer", "n_embd", "n_head", "n_ctx")
LORA_TARGETS = "c_attn,attn.c_proj,c_fc,mlp.c_proj"


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """A TrainConfig field: its default and what the CLI shows (help; optionally short, choices,
    default_text for a None that train() resolves)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Fields left None are resolved when training starts."""

    data: str = field(metadata={"help": "directory of train_*.bin / val_*.bin shards (gpt2kit prepare, or llm.c's)"})
    out: str = field(metadata={"help": "output directory: the model, checkpoint.pt, metrics.jsonl, loss.png",
                               "short": "-o"})
    model: str = _setting("gpt2-tiny", "a preset to train from scratch (gpt2-tiny, gpt2-mini, gpt2, gpt2-medium, "
                                       "gpt2-large, gpt2-xl), or a checkpoint directory or hub id to fine-tune, "
                                       "e.g. openai-community/gpt2", short="-m")
    n_layer: int | None = _setting(None, "from scratch: override the preset's layers", default_text="the preset's")
    n_embd: int | None = _setting(None, "from scratch: override the preset's width", default_text="the preset's")
    n_head: int | None = _setting(None, "from scratch: override the preset's attention heads",
                                  default_text="the preset's")
    n_ctx: int | None = _setting(None, "from scratch: override the preset's context length",
                                 default_text="the preset's")
    dropout: float | None = _setting(None, "embedding, attention and residual dropout probability",
                                     default_text="0.0")
    batch_size: int = _setting(8, "sequences per micro-step and rank (B)", short="-b")
    seq_len: int | None = _setting(None, "tokens per sequence (T)", default_text="the model's n_ctx")
    total_batch_tokens: int | None = _setting(
        None, "tokens per optimizer step, reached by gradient accumulation; a multiple of "
              "batch-size x seq-len x ranks", default_text="exactly that, no accumulation")
    lr: float = _setting(6e-4, "peak learning rate of AdamW (everything with adamw; embeddings, biases and "
                               "gains with muon); ~3e-5 suits fine-tuning")
    min_lr: float | None = _setting(None, "learning rate at --max-steps", default_text="lr/10")
    warmup_steps: int | None = _setting(None, "linear warmup steps", default_text="max-steps/20")
    max_steps: int = _setting(1000, "optimizer steps; the schedule ends here")
    weight_decay: float = _setting(0.1, "AdamW weight decay on 2-D weights")
    grad_clip: float = _setting(1.0, "clip the global gradient norm to this; 0 disables")
    eval_every: int = _setting(100, "steps between validation evaluations; 0: only at the end")
    eval_steps: int = _setting(20, "batches per evaluation")
    save_every: int = _setting(500, "steps between checkpoints; 0: only at the end")
    log_every: int = _setting(10, "steps between log lines when stderr is not a terminal")
    seed: int = _setting(1337, "random seed: initial weights, dropout, the random windows")
    optimizer: str | None = _setting(None, "muon: Muon for the block matrices, AdamW for embeddings, biases and "
                                           "gains; adamw: AdamW for everything", choices=OPTIMIZERS,
                                     default_text="muon where torch has torch.optim.Muon, else adamw")
    muon_lr: float = _setting(0.02, "Muon's peak learning rate (--lr is AdamW's)")
    muon_dtype: str | None = _setting(None, "the dtype Muon orthogonalises its update in (Newton-Schulz): float32, "
                                            "or bfloat16 (torch.optim.Muon's own: faster where the device has "
                                            "native bfloat16, but it rounds the update)", choices=TRAIN_DTYPES,
                                      default_text="the run's --dtype; float32 for a bfloat16 run on a device "
                                                   "without native bfloat16 (an AVX2 CPU)")
    schedule: str = _setting("wsd", "wsd (warmup, flat, linear decay over the last 40%) or cosine "
                                    "(to --min-lr at --max-steps)", choices=SCHEDULES)
    sampling: str = _setting("random", "random: windows drawn at random from all shards; sequential: shards "
                                       "read front to back", choices=SAMPLINGS)
    dtype: str = _setting("float32", "float32, or bfloat16 autocast (weights and optimizer stay float32)",
                          choices=tuple(n for n, c in DTYPE_NAMES.items() if c in TRAIN_DTYPES))
    compile: bool = _setting(False, "torch.compile the model")
    device: str | None = _setting(None, "cpu | cuda | cuda:N", default_text="this rank's GPU if there is one, "
                                                                         "else cpu")
    resume: bool = _setting(False, "continue the run saved in OUT/checkpoint.pt")
    lora_rank: int | None = _setting(None, "fine-tune with LoRA adapters of this rank on the block matrices (the "
                                           "base frozen; OUT gets a peft-format adapter, not a model)",
                                     default_text="off: every parameter trains")
    lora_alpha: float | None = _setting(None, "LoRA's alpha: the update is scaled by alpha / rank",
                                        default_text="2 x lora-rank")
    lora_dropout: float = _setting(0.0, "dropout on the LoRA branch's input")
    lora_targets: str = _setting(LORA_TARGETS, "comma list of the block matrices LoRA adapts: attn.c_attn, "
                                               "attn.c_proj, mlp.c_fc, mlp.c_proj (c_attn, c_fc, c_proj: peft's short "
                                               "names)")
    lora_bias: str = _setting("none", "peft's bias option: none; all (every bias trains: the Linear and LayerNorm "
                                      "biases, ln_f's included); lora_only (the adapted matrices' biases). The "
                                      "trained biases are saved in the adapter, as peft does", choices=LORA_BIASES)
    lora_tokens: int | None = _setting(None, "also train the tied embedding's rows of the N tokens the train split "
                                             "uses most (peft's trainable_token_indices, saved in the adapter): "
                                             "what adapters on the blocks cannot reach, at C values a row",
                                       metavar="N", default_text="none")
    activation_checkpointing: bool = _setting(False, "recompute each block's activations in the backward pass "
                                                     "instead of keeping them (less memory, ~1/3 more compute)")
    freeze: str | None = _setting(None, "comma list of parameter-name globs to freeze, e.g. 'wte.*,wpe.*' or "
                                        "'h.[0-9].*'", default_text="none")
    train_only: str | None = _setting(None, "comma list of parameter-name globs: train these, freeze the rest, "
                                            "e.g. 'h.1[01].*,ln_f.*'", default_text="all")
    fsdp: bool = _setting(False, "shard parameters, gradients and AdamW state across the torchrun processes "
                                 "(FSDP2; AdamW only; checkpoints sharded with torch.distributed.checkpoint)")
    distill_from: str | None = _setting(None, "a teacher (checkpoint directory or hub id with the same tokenizer) "
                                              "whose next-token probabilities the model learns instead of the "
                                              "data's tokens alone: e.g. a draft model made to agree with the "
                                              "target it will draft for (--draft-model)",
                                        default_text="none: the data's tokens")
    distill_weight: float = _setting(1.0, "with --distill-from: the teacher's share of each target distribution "
                                          "(the rest is the data's token); in (0, 1]")
    distill_dtype: str | None = _setting(None, "with --distill-from: the teacher's weights, float32 or bfloat16 "
                                               "(it only gives probabilities)", choices=TRAIN_DTYPES,
                                         default_text="bfloat16 on a GPU or a CPU with native bfloat16, else "
                                                      "float32")
    stop_at: int | None = _setting(None, "end this invocation after this step, saving a checkpoint (the "
                                         "schedule still runs to --max-steps; continue with --resume)",
                                   default_text="none")

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_optimizer()
        self._check_lora()
        for name in ("freeze", "train_only", "lora_targets"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip(" ,")):
                raise ValueError(f"TrainConfig.{name} must be a non-empty comma list, got {value!r}")
        self._check_distill()
        if self.dropout is not None:
            check_number("TrainConfig.dropout", self.dropout, "in [0, 1)", lambda v: 0 <= v < 1)
        for name in ("dtype", "muon_dtype"):
            self._canonical_dtype(name)
        if self.total_batch_tokens is not None and self.seq_len is not None:
            if self.total_batch_tokens % (self.batch_size * self.seq_len):
                raise ValueError(batch_message(self.total_batch_tokens, self.batch_size, self.seq_len, 1))

    def _check_counts(self) -> None:
        for name in ("data", "out", "model"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"TrainConfig.{name} must be a non-empty string, got {getattr(self, name)!r}")
        positive = ["batch_size", "max_steps", "eval_steps", "log_every"]
        positive += [n for n in (*ARCH_OVERRIDES, "seq_len", "total_batch_tokens") if getattr(self, n) is not None]
        for name in positive:
            check_int(f"TrainConfig.{name}", getattr(self, name), ">= 1", lambda v: v >= 1)
        for name in ("eval_every", "save_every", "seed", "warmup_steps", "stop_at"):
            if getattr(self, name) is not None:
                check_int(f"TrainConfig.{name}", getattr(self, name), ">= 0", lambda v: v >= 0)

    def _check_optimizer(self) -> None:
        for name in ("lr", "muon_lr"):
            check_number(f"TrainConfig.{name}", getattr(self, name), "> 0", lambda v: v > 0)
        if self.optimizer is not None:
            check_choice("optimizer", self.optimizer, OPTIMIZERS)
            if self.optimizer == "muon":
                require_muon()
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("sampling", self.sampling, SAMPLINGS)
        if self.min_lr is not None:
            check_number("TrainConfig.min_lr", self.min_lr, f"in [0, lr={self.lr}]", lambda v: 0 <= v <= self.lr)
        for name in ("weight_decay", "grad_clip"):
            check_number(f"TrainConfig.{name}", getattr(self, name), ">= 0", lambda v: v >= 0)

    def _check_lora(self) -> None:
        if self.lora_rank is not None:
            check_int("TrainConfig.lora_rank", self.lora_rank, ">= 1", lambda v: v >= 1)
            if self.freeze is not None or self.train_only is not None:
                raise ValueError("--freeze / --train-only cannot be combined with --lora-rank (LoRA already "
                                 "freezes the whole base; peft's adapter format holds only the adapters)")
        check_choice("LoRA bias", self.lora_bias, LORA_BIASES)
        if self.lora_tokens is not None:
            check_int("TrainConfig.lora_tokens", self.lora_tokens, ">= 1", lambda v: v >= 1)
            if self.lora_rank is None:
                raise ValueError(f"--lora-tokens {self.lora_tokens} needs --lora-rank (it adds embedding rows to a "
                                 "LoRA adapter)")
        if self.lora_bias != "none" and self.lora_rank is None:
            raise ValueError(f"--lora-bias {self.lora_bias} needs --lora-rank (it chooses the biases a LoRA run "
                             "trains beside its adapters)")
        if self.lora_alpha is not None:
            check_number("TrainConfig.lora_alpha", self.lora_alpha, "> 0", lambda v: v > 0)
        check_number("TrainConfig.lora_dropout", self.lora_dropout, "in [0, 1)", lambda v: 0 <= v < 1)

    def _canonical_dtype(self, name: str) -> None:
        """dtype / muon_dtype by their canonical names (bf16 -> bfloat16); None (not yet resolved) stays."""
        value = getattr(self, name)
        if value is None and name != "dtype":
            return
        if DTYPE_NAMES.get(value) not in TRAIN_DTYPES:
            names = [n for n, c in DTYPE_NAMES.items() if c in TRAIN_DTYPES]
            raise ValueError(f"TrainConfig.{name} must be one of {', '.join(names)}, got {value!r}")
        object.__setattr__(self, name, DTYPE_NAMES[value])

    def _check_distill(self) -> None:
        check_number("TrainConfig.distill_weight", self.distill_weight, "in (0, 1]", lambda v: 0 < v <= 1)
        if self.distill_from is None:
            if self.distill_weight != 1.0 or self.distill_dtype is not None:
                flag = "--distill-weight" if self.distill_weight != 1.0 else "--distill-dtype"
                raise ValueError(f"{flag} needs --distill-from (it sets how the teacher is used)")
            return
        if not isinstance(self.distill_from, str) or not self.distill_from:
            raise ValueError(f"TrainConfig.distill_from must be a non-empty string, got {self.distill_from!r}")
        if self.distill_dtype is not None:
            check_choice("distill dtype", self.distill_dtype, TRAIN_DTYPES)
        if self.fsdp:
            raise ValueError("--distill-from cannot be combined with --fsdp (each rank would need the whole "
                             "teacher; use DDP, or LoRA for a model that does not fit)")

    @property
    def from_scratch(self) -> bool:
        return self.model in PRESETS and not os.path.isdir(self.model)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def muon_available() -> bool:
    import torch  # only here: the rest of this module is torch-free for the CLI's start-up

    return getattr(torch.optim, "Muon", None) is not None


def require_muon() -> None:
    if not muon_available():
        import torch

        raise ValueError(f"--optimizer muon needs torch.optim.Muon (PyTorch 2.9 or later); this is PyTorch "
                         f"{torch.__version__}: upgrade torch or use --optimizer adamw")


def batch_message(total: int, batch_size: int, seq_len: int, world_size: int) -> str:
    unit = batch_size * seq_len * world_size
    return (f"total_batch_tokens {total} is not a multiple of batch_size {batch_size} x seq_len {seq_len} "
            f"x world_size {world_size} = {unit} tokens (try {max(1, round(total / unit)) * unit})")
