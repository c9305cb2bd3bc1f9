"""Training: pre-training, fine-tuning (full, LoRA, completions-only), distillation, DDP and FSDP2.

- config.py      TrainConfig, the one definition of every setting (no torch: the CLI builds its flags from it)
- build.py       a Run from a config: model, data, optimizer, schedule, parallelism, resume
- loop.py        train(cfg): the loop, evaluation, checkpoints, stop on a signal
- optim.py       Muon + AdamW or AdamW, and the schedules (WSD, cosine)
- loss.py        the next-token loss without the (B, T, V) logits
- finetune.py    LoRA and trainable-token set-up, merge on save
- distill.py     the teacher's soft targets
- distributed.py fsdp.py   ranks and FSDP2 wrapping
- metrics.py run_dir.py    the metrics log, the run directory and its atomic checkpoints

This face hands on the config only, so `gpt2kit train --help` imports no torch.
"""

from gpt2kit.train.config import TrainConfig

__all__ = ["TrainConfig"]
