"""The teacher of a distillation run (`gpt2kit train --distill-from M`): loaded frozen, checked against
the model it teaches, in the dtype that serves it fastest here.

Why: a draft model drafts well for speculative decoding when its greedy choices agree with its
target's, and the target's whole next-token distribution says more about that than the data's one
token (DistillSpec, Zhou et al. 2023). The loss itself is gpt2kit.train.loss's fused cross-entropy with
the teacher's probabilities as the (soft) target; this module only provides the teacher.
"""

from __future__ import annotations

import os

import torch

from gpt2kit.checkpoint import load_model
from gpt2kit.config import GPT2Config
from gpt2kit.decode.plain import cpu_has_native_bfloat16
from gpt2kit.model import GPT2


def default_dtype(device: torch.device) -> str:
    """bfloat16 where the device multiplies it natively (a GPU with bfloat16, or a CPU with
    AVX512-BF16 / AMX), else float32: the teacher only gives probabilities, and bfloat16 rounds
    them far below what the student can learn from."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if device.type == "cpu" and cpu_has_native_bfloat16() else "float32"


def load_teacher(name: str, source: str | os.PathLike[str], student: GPT2Config, seq_len: int, dtype: str,
                 device: torch.device) -> GPT2:
    """The teacher `name` (read from the directory source) frozen, in eval mode, on device in dtype;
    ValueError, naming both values, when its vocabulary differs from the student's or its context is
    shorter than seq_len."""
    teacher = load_model(source, dtype=getattr(torch, dtype), device=device, allow_int8=False)
    if teacher.config.n_vocab != student.n_vocab:
        raise ValueError(f"--distill-from {name}: its vocabulary has {teacher.config.n_vocab} tokens, the model's "
                         f"{student.n_vocab}: a teacher needs the same tokenizer")
    if teacher.config.n_ctx < seq_len:
        raise ValueError(f"--distill-from {name}: its context is {teacher.config.n_ctx} tokens, shorter than "
                         f"--seq-len {seq_len}")
    teacher.requires_grad_(False)
    return teacher.eval()
