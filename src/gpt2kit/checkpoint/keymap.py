"""The one name table between gpt2kit's parameters and the published checkpoint layouts.

gpt2kit keeps GPT-2's names, so the HF layout differs only by an optional `transformer.` prefix and
the Conv1D matrices, stored (in, out) where nn.Linear holds (out, in). OpenAI's TF names differ by
`model/` scopes, g/b for LayerNorm gain/bias and w [1, in, out] for the same four matrices.
"""

from __future__ import annotations

import re

# The four Conv1D weights: stored transposed in HF and TF checkpoints.
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

# Buffers that transformers writes and that carry no weights (the causal mask and its fill value).
HF_SKIPPED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
# transformers' LM head is tied to wte; some checkpoints store it anyway.
HF_TIED = ("lm_head.weight",)


def is_transposed(name: str) -> bool:
    return name.endswith(TRANSPOSED)


def hf_to_ours(key: str) -> str:
    return key.removeprefix("transformer.")


def ours_to_hf(name: str) -> str:
    """The key transformers' GPT2LMHeadModel.save_pretrained writes for our parameter name."""
    return "transformer." + name


_TF_LAYER = re.compile(r"^model/h(\d+)/(.+)$")
_TF_LEAF = {"g": "weight", "b": "bias", "w": "weight"}


def tf_to_ours(name: str) -> str | None:
    """OpenAI TF variable name -> our parameter name (None for a name we don't know)."""
    if name == "model/wte":
        return "wte.weight"
    if name == "model/wpe":
        return "wpe.weight"
    m = re.fullmatch(r"model/ln_f/([gb])", name)
    if m:
        return "ln_f." + _TF_LEAF[m.group(1)]
    m = _TF_LAYER.match(name)
    if not m:
        return None
    i, rest = m.groups()
    parts = rest.split("/")
    if parts[-1] not in _TF_LEAF or len(parts) not in (2, 3):
        return None
    module = ".".join(parts[:-1])
    if module not in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        return None
    return f"h.{i}.{module}.{_TF_LEAF[parts[-1]]}"
