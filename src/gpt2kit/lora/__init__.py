"""LoRA as module swaps on the spec: one adapter trained, merged or disabled (modules.py), and many
adapters on one base, each row running its own (multi.py). The adapters' on-disk form is peft's
(gpt2kit.checkpoint.adapter)."""

from gpt2kit.lora.modules import (
    TARGETS,
    LoRALinear,
    TrainableTokens,
    apply_lora,
    bias_names,
    check_bias,
    check_rank,
    check_tokens,
    lora_modules,
    lora_state,
    merge_lora,
    parse_targets,
    unmerge_lora,
)
from gpt2kit.lora.multi import AdapterBank, MultiLoRALinear, adapter_rows, enable_multi_lora

__all__ = ["TARGETS", "AdapterBank", "LoRALinear", "MultiLoRALinear", "TrainableTokens", "adapter_rows", "apply_lora",
           "bias_names", "check_bias", "check_rank", "check_tokens", "enable_multi_lora", "lora_modules", "lora_state",
           "merge_lora", "parse_targets", "unmerge_lora"]
