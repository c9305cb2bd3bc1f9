"""The one name table between gpt2kit's parameters and the published checkpoint layouts.

gpt2kit keeps GPT-2's names, so the HF layout differs only by an optional `transformer.` prefix and
the Conv1D matrices, stored (in, out) where nn.Linear holds (out, in). OpenAI's TF names differ by
`model/` scopes, g/b for LayerNorm gain/bias and w [1, in, out] for the same four matrices.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gpt2kit.config import GPT2Config

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


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of GPT2(config).state_dict() and its shape, by arithmetic (no model is built).

    The strict check compares a checkpoint against this; tests prove it equals the model's own."""
    C = config.n_embd
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (config.embedding_rows, C), "wpe.weight": (config.n_ctx, C)}
    for i in range(config.n_layer):
        h = f"h.{i}."
        shapes |= {h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
                   h + "attn.c_attn.weight": (3 * C, C), h + "attn.c_attn.bias": (3 * C,),
                   h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                   h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                   h + "mlp.c_fc.weight": (4 * C, C), h + "mlp.c_fc.bias": (4 * C,),
                   h + "mlp.c_proj.weight": (C, 4 * C), h + "mlp.c_proj.bias": (C,)}
    shapes |= {"ln_f.weight": (C,), "ln_f.bias": (C,)}
    return shapes


def layer_count(names: list[str] | set[str] | dict) -> int:
    """Blocks present in a set of our names (highest h.{i} + 1; 0 when there are none)."""
    layers = [int(m.group(1)) for n in names if (m := _OUR_LAYER.match(n))]
    return max(layers) + 1 if layers else 0


_OUR_LAYER = re.compile(r"^h\.(\d+)\.")


def to_hf_state(state: dict[str, torch.Tensor], config: GPT2Config) -> dict[str, torch.Tensor]:
    """Our state dict -> the one transformers' GPT2LMHeadModel holds (and save_pretrained writes).

    The one conversion in that direction: `transformer.` prefix, Conv1D matrices transposed to
    (in, out), padded embedding rows dropped. CPU, contiguous, dtype kept."""
    out = {}
    for name, t in state.items():
        if name == "wte.weight":
            t = t[: config.n_vocab]  # drop rows padded for speed
        if is_transposed(name):
            t = t.t()
        out[ours_to_hf(name)] = t.detach().to("cpu").contiguous()
    return out


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
