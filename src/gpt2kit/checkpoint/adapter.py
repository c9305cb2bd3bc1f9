"""LoRA adapters in peft's own format: adapter_config.json + adapter_model.safetensors.

What peft's `PeftModel.save_pretrained` writes for a GPT2LMHeadModel and what
`PeftModel.from_pretrained(GPT2LMHeadModel...)` reads unchanged:

    adapter_model.safetensors   base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}
                                .lora_A.weight (r, in) and .lora_B.weight (out, r)
    adapter_config.json         peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha, lora_dropout,
                                target_modules, fan_in_fan_out true (GPT-2's Conv1D holds (in, out)),
                                bias, base_model_name_or_path, rank_pattern, alpha_pattern, ...

With peft's bias "all" or "lora_only" the trained biases are saved beside the adapters, under the
model's own keys as peft's wrapped model names them: base_model.model.transformer.h.{i}.ln_1.bias,
... .ln_f.bias, and for an adapted matrix the bias of its base layer, ...h.{i}.attn.c_attn.base_layer.bias.
Reading them replaces the base's biases (gpt2kit's names: h.{i}.attn.c_attn.bias, ln_f.bias).

With peft's trainable_token_indices (gpt2kit's TrainableTokens: embedding rows trained beside the
adapters) the config lists the ids and base_model.model.transformer.wte.token_adapter.
trainable_tokens_delta (K, C) holds their rows, which replace the base's in wte (peft wraps the tied
lm_head with the same rows; gpt2kit's head is wte).

lora_A / lora_B have the same shapes whatever fan_in_fan_out says (peft transposes only the merged
delta for a Conv1D), so they map to gpt2kit's LoRALinear with no transpose. Reading accepts what
peft writes for GPT-2 with LoRA on the block matrices: per-module ranks and alphas (rank_pattern,
alpha_pattern), rsLoRA's alpha / sqrt(r), trained biases (bias "all" / "lora_only"); DoRA,
lora_bias (a bias on lora_B), embedding adapters and modules_to_save are refused by name.

An adapter is a downloaded file, read as data (adapter_config.py checks the settings): a tensor
holding NaN or infinity, an empty one, or an update scaling x B A beyond float32's range is refused
naming it, as is anything that leaves the model's dtype's range once cast or merged, before the
model is changed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from gpt2kit._io import atomic_directory, atomic_write_path, atomic_write_text
from gpt2kit.checkpoint.adapter_config import ADAPTER_CONFIG, AdapterSettings, pattern_value, read_settings, shown
from gpt2kit.checkpoint.contract import check_finite
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.lora import TARGETS, TrainableTokens, apply_lora, bias_names, lora_modules

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.transformer."
_KEY = re.compile(r"^base_model\.model\.transformer\.(h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj))"
                  r"\.lora_(A|B)\.weight$")
# A bias peft saves with bias "all" / "lora_only"; group 1 is our module name (".base_layer" is peft's
# wrapper around an adapted matrix).
TOKENS_KEY = "base_model.model.transformer.wte.token_adapter.trainable_tokens_delta"
_BIAS_KEY = re.compile(r"^base_model\.model\.transformer\.((?:h\.\d+\.(?:ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc"
                       r"|mlp\.c_proj))|ln_f)(?:\.base_layer)?\.bias$")
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Adapter:
    """A read adapter: per module (our name), its A (r, in), B (out, r) and scaling."""

    path: Path
    base: str | None  # base_model_name_or_path, as recorded
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scalings: dict[str, float]
    dropout: float
    bias: str = "none"  # peft's bias option, as recorded
    biases: dict[str, torch.Tensor] | None = None  # our parameter name ("ln_f.bias"): the trained bias
    tokens: tuple[list[int], torch.Tensor] | None = None  # trainable_token_indices and their rows (K, C)


def _peft_key(module: str, part: str) -> str:
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def _peft_bias_key(name: str, adapted: set[str]) -> str:
    """Our bias name -> peft's key: an adapted matrix's bias lives on its base_layer."""
    module = name.removesuffix(".bias")
    return f"{PEFT_PREFIX}{module}.base_layer.bias" if module in adapted else f"{PEFT_PREFIX}{name}"


def save_adapter(model: nn.Module, directory: str | os.PathLike[str], *, base: str | None = None,
                 tokenizer=None, bias: str = "none") -> Path:
    """Write the model's LoRA adapters as peft writes them (replacing the directory's adapter files
    atomically; other files in it are kept); `bias` is peft's option, and the biases it names are
    saved with them."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to save (gpt2kit.lora.apply_lora adds them)")
    first = next(iter(modules.values()))
    ranks = {name: m.rank for name, m in modules.items()}
    alphas = {name: m.scaling * m.rank for name, m in modules.items()}
    r, alpha = first.rank, first.scaling * first.rank
    dropout = first.lora_dropout.p if hasattr(first.lora_dropout, "p") else 0.0
    targets = sorted({name.split(".", 2)[2] for name in modules}, key=TARGETS.index)
    state = {_peft_key(name, part): getattr(m, f"lora_{part}").detach().contiguous().cpu()
             for name, m in modules.items() for part in ("A", "B")}
    state |= {_peft_bias_key(name, set(modules)): model.get_parameter(name).detach().contiguous().cpu()
              for name in bias_names(model, bias)}
    indices = None
    if isinstance(model.wte, TrainableTokens):
        indices = model.wte.token_indices.tolist()
        state[TOKENS_KEY] = model.wte.trainable_tokens.detach().contiguous().cpu()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets,
        "fan_in_fan_out": True, "bias": bias, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "use_rslora": False,
        "use_dora": False, "lora_bias": False, "trainable_token_indices": indices,
        # peft keys these by module-name suffix; ours are the full names, which match only themselves
        "rank_pattern": {f"transformer.{k}": v for k, v in ranks.items() if v != r},
        "alpha_pattern": {f"transformer.{k}": v for k, v in alphas.items() if v != alpha},
    }
    d = Path(directory)
    with atomic_directory(d) as stage:
        atomic_write_path(stage / ADAPTER_WEIGHTS, lambda p: save_file(state, p, metadata={"format": "pt"}))
        if tokenizer is not None:
            tokenizer.save(stage)
        atomic_write_text(stage / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return d


def read_adapter(directory: str | os.PathLike[str]) -> Adapter:
    """Read and check a peft LoRA adapter directory (CPU tensors); CheckpointError names what is wrong:
    the file, and the field or tensor. Every value is data: checked, never run."""
    d = Path(directory).expanduser()
    cfg_file = d / ADAPTER_CONFIG
    settings = read_settings(d)
    weights = d / ADAPTER_WEIGHTS
    raw = _read_tensors(weights)
    tokens = _read_tokens(cfg_file, weights, settings.tokens, raw.pop(TOKENS_KEY, None))
    parts, biases = _sort_tensors(weights, raw)
    tensors, scalings = _pair(weights, parts, settings)
    return Adapter(d, settings.base, tensors, scalings, settings.dropout, settings.bias, biases, tokens)


def _read_tensors(weights: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors, every floating one finite (as the model loader checks its own)."""
    if not weights.is_file():
        raise FileNotFoundError(f"{weights.parent}: no {ADAPTER_WEIGHTS} (a .bin adapter is not read; peft writes "
                                "safetensors)")
    try:
        raw = load_file(weights)
    except Exception as e:  # safetensors raises several types for a bad file
        raise CheckpointError(f"{weights}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None
    check_finite(raw, dict.fromkeys(raw, weights))
    return raw


def _need(weights: Path, key: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims or not t.dtype.is_floating_point or 0 in t.shape:
        raise CheckpointError(f"{weights}: {key} must be a {dims}-D floating tensor with no empty dimension (a "
                              f"LoRA rank is at least 1), got {tuple(t.shape)} {t.dtype}")


def _sort_tensors(weights: Path, raw: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The file's tensors as {module: {"A": lora_A, "B": lora_B}} and {our bias name: bias}; any other
    key refused by name."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    biases: dict[str, torch.Tensor] = {}
    for key, t in sorted(raw.items()):  # the file's order varies: the first refusal is always the same one
        if (mb := _BIAS_KEY.match(key)) is not None:
            _need(weights, key, t, 1)
            biases[f"{mb.group(1)}.bias"] = t
            continue
        m = _KEY.match(key)
        if m is None:
            raise CheckpointError(f"{weights}: unexpected tensor {shown(key)}; gpt2kit reads LoRA on "
                                  f"{', '.join(TARGETS)} (keys {PEFT_PREFIX}h.N.<target>.lora_A/B.weight) and "
                                  f"the block and ln_f biases")
        _need(weights, key, t, 2)
        parts.setdefault(m.group(1), {})[m.group(2)] = t
    if not parts:
        raise CheckpointError(f"{weights}: holds no LoRA tensors")
    return parts, biases


def _pair(weights: Path, parts: dict[str, dict[str, torch.Tensor]], settings: AdapterSettings
          ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """Each module's (A, B), their ranks agreeing, and its scaling (alpha / r, or rsLoRA's alpha / sqrt(r))."""
    tensors, scalings = {}, {}
    for module, ab in parts.items():
        for part in ("A", "B"):
            if part not in ab:
                raise CheckpointError(f"{weights}: {_peft_key(module, part)} is missing")
        a, b = ab["A"], ab["B"]
        if b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{weights}: {_peft_key(module, 'B')} is {tuple(b.shape)}, but lora_A has rank "
                                  f"{a.shape[0]}")
        r = a.shape[0]
        alpha = pattern_value(settings.alpha_pattern, module, settings.alpha)
        scalings[module] = alpha / math.sqrt(r) if settings.rslora else alpha / r
        _check_update(weights, module, a, b, scalings[module])
        tensors[module] = (a, b)
    return tensors, scalings


def _check_update(weights: Path, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """The update scaling x B A, as merging and LoRALinear compute it in float32, must be finite."""
    if scaling > FLOAT32_MAX:
        raise CheckpointError(f"{weights}: {module}'s scaling (alpha / rank) is {scaling:g}, beyond float32's "
                              f"range ({FLOAT32_MAX:.4g})")
    # |(B A)[i, j]| <= r max|B| max|A|: only when that bound nears float32's limit is the product computed
    if scaling * a.shape[0] * float(a.abs().max()) * float(b.abs().max()) < FLOAT32_MAX / 2:
        return
    bad = int((~(scaling * (b.float() @ a.float())).isfinite()).sum())
    if bad:
        raise CheckpointError(f"{weights}: {module}'s update ({scaling:g} x lora_B @ lora_A) overflows float32 in "
                              f"{bad:,} value(s); a model built from it computes nan")


def _read_tokens(cfg_file: Path, weights: Path, indices: list[int] | None, rows: torch.Tensor | None
                 ) -> tuple[list[int], torch.Tensor] | None:
    """trainable_token_indices and their rows, checked against each other."""
    if indices is None and rows is None:
        return None
    if indices is None or rows is None:
        raise CheckpointError(f"{cfg_file if indices is None else weights}: trainable tokens need both "
                              f"trainable_token_indices in {ADAPTER_CONFIG} and {TOKENS_KEY} in {ADAPTER_WEIGHTS}")
    if rows.dim() != 2 or rows.shape[0] != len(indices) or not rows.dtype.is_floating_point:
        raise CheckpointError(f"{weights}: {TOKENS_KEY} has shape {tuple(rows.shape)}, but trainable_token_indices "
                              f"lists {len(indices)} tokens")
    return indices, rows


def apply_adapter(model: nn.Module, directory: str | os.PathLike[str], *, merge: bool = True) -> nn.Module:
    """Add a peft LoRA adapter to a float GPT2, in place: merged into the weights (merge=True: a plain
    model every fast path runs), or as LoRALinear modules (merge=False). A tensor whose shape does
    not fit the model, or whose values leave the range of the model's dtype once cast or merged,
    raises CheckpointError naming it, before the model is changed."""
    ad = read_adapter(directory)
    _check_fits(model, ad)
    _check_values(model, ad, merge)
    _replace_biases(model, ad.biases or {})
    if merge:
        _merge(model, ad)
        return model
    _add_modules(model, ad)
    return model.eval()


def read_fitting(model: nn.Module, directory: str | os.PathLike[str]) -> Adapter:
    """read_adapter, then every check apply_adapter makes before it changes the model: the shapes
    fit this model, and the values stay finite in its dtype, cast and merged."""
    ad = read_adapter(directory)
    _check_fits(model, ad)
    _check_values(model, ad, True)
    _check_values(model, ad, False)
    return ad


def _check_fits(model: nn.Module, ad: Adapter) -> None:
    """Every tensor of the adapter has the shape the model needs (an adapter for another base is refused)."""
    n_layer, where = len(model.h), ad.path / ADAPTER_WEIGHTS
    for module, (a, b) in ad.tensors.items():
        layer = int(module.split(".")[1])
        if layer >= n_layer:
            raise CheckpointError(f"{where}: {_peft_key(module, 'A')} is for block {layer}, but the model has "
                                  f"{n_layer} blocks: the adapter was made for another base")
        out_f, in_f = model.get_submodule(module).weight.shape
        for part, t, want in (("A", a, (a.shape[0], in_f)), ("B", b, (out_f, a.shape[0]))):
            if tuple(t.shape) != want or a.shape[0] > min(out_f, in_f):
                raise CheckpointError(f"{where}: {_peft_key(module, part)} has shape {tuple(t.shape)}, the model's "
                                      f"{module} ({out_f} x {in_f}) needs {want}: the adapter was made for another "
                                      "base")
    for name, t in (ad.biases or {}).items():
        layer = int(name.split(".")[1]) if name.startswith("h.") else 0
        want = tuple(model.get_parameter(name).shape) if layer < n_layer else None
        if tuple(t.shape) != want:
            raise CheckpointError(f"{where}: the bias for {name} has shape {tuple(t.shape)}, the model's is "
                                  f"{want if want else f'absent ({n_layer} blocks)'}: the adapter was made for "
                                  "another base")
    if ad.tokens is not None:
        ids, rows = ad.tokens
        vocab, width = model.config.n_vocab, model.wte.weight.shape[1]
        if max(ids) >= vocab or rows.shape[1] != width:
            raise CheckpointError(f"{where}: {TOKENS_KEY} has shape {tuple(rows.shape)} for ids up to {max(ids)}, "
                                  f"the model's wte needs rows of {width} for ids below {vocab}: the adapter was "
                                  "made for another base")


def _merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A in float32 from the stored tensors, then W's dtype."""
    return (w.float() + (scaling * (b.float() @ a.float())).to(w.device)).to(w.dtype)


def _check_values(model: nn.Module, ad: Adapter, merge: bool) -> None:
    """What the model will hold is finite in its dtype: the biases and rows cast, and the merged
    matrices (merge) or lora_A / lora_B cast (not merged); checked before anything is written, so a
    refused adapter leaves the model as it was (and `gpt2kit merge` writes nothing)."""
    where = ad.path / ADAPTER_WEIGHTS
    casts = {_peft_bias_key(name, set(ad.tensors)): (t, model.get_parameter(name).dtype)
             for name, t in (ad.biases or {}).items()}
    if ad.tokens is not None:
        casts[TOKENS_KEY] = (ad.tokens[1], model.wte.weight.dtype)
    for module, (a, b) in ad.tensors.items():
        w = model.get_submodule(module).weight
        if merge:
            check_finite({f"{module}.weight": _merged(w, a, b, ad.scalings[module])}, {f"{module}.weight": where},
                         f" once the adapter is merged into it ({str(w.dtype).removeprefix('torch.')}: out of its "
                         "range)")
        else:
            casts |= {_peft_key(module, "A"): (a, w.dtype), _peft_key(module, "B"): (b, w.dtype)}
    for name, (t, dtype) in casts.items():
        check_finite({name: t.to(dtype)}, {name: where}, f" once cast to {str(dtype).removeprefix('torch.')} "
                                                         "(out of its range)")


def _replace_biases(model: nn.Module, biases: dict[str, torch.Tensor]) -> None:
    """Copy an adapter's trained biases over the model's (the names and shapes already checked)."""
    with torch.no_grad():
        for name, t in biases.items():
            p = model.get_parameter(name)
            p.copy_(t.to(device=p.device, dtype=p.dtype))


def _merge(model: nn.Module, ad: Adapter) -> None:
    """The trained rows over the base's (the tied head reads them too), and each matrix merged."""
    with torch.no_grad():
        if ad.tokens is not None:
            w = model.wte.weight
            w[torch.tensor(ad.tokens[0], device=w.device)] = ad.tokens[1].to(device=w.device, dtype=w.dtype)
        for module, (a, b) in ad.tensors.items():
            w = model.get_submodule(module).weight
            w.copy_(_merged(w, a, b, ad.scalings[module]))


def _add_modules(model: nn.Module, ad: Adapter) -> None:
    """The adapter as LoRALinear modules (and TrainableTokens) holding its tensors."""
    targets = sorted({m.split(".", 2)[2] for m in ad.tensors}, key=TARGETS.index)
    missing = [f"h.{i}.{t}" for i in range(len(model.h)) for t in targets if f"h.{i}.{t}" not in ad.tensors]
    ranks = {m: a.shape[0] for m, (a, _) in ad.tensors.items()}
    apply_lora(model, 1, targets=targets, ranks=ranks | dict.fromkeys(missing, 1), scalings=ad.scalings,
               dropout=ad.dropout, tokens=None if ad.tokens is None else ad.tokens[0])
    with torch.no_grad():
        if ad.tokens is not None:
            model.wte.trainable_tokens.copy_(ad.tokens[1])
        for name, m in lora_modules(model).items():
            if name in ad.tensors:
                a, b = ad.tensors[name]
                m.lora_A.copy_(a)
                m.lora_B.copy_(b)
            # else: a block the adapter leaves alone (layers_to_transform); its lora_B is zero


def add_adapter(model: nn.Module, name: str, directory: str | os.PathLike[str]) -> int:
    """Read and check a peft adapter (read_fitting: every check merging makes) and add it to
    the model's bank under `name`; returns its index. One that trains biases or embedding rows is
    refused (those are not per row): serve it alone, merged."""
    bank = getattr(model, "adapter_bank", None)
    if bank is None:
        raise ValueError("the model holds no adapter bank (gpt2kit.lora.enable_multi_lora first)")
    if name in bank.adapters:
        raise ValueError(f"an adapter named {name!r} is already loaded")
    ad = read_fitting(model, directory)
    if ad.biases or ad.tokens is not None:
        raise CheckpointError(f"{ad.path}: the adapter trains {'biases' if ad.biases else 'embedding rows'}, "
                              "which cannot differ per row; serve it alone (merged, --adapter)")
    return bank.add(name, ad.tensors, ad.scalings)
