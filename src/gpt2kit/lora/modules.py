"""LoRA: low-rank adapters on GPT-2's block matrices, as a module swap.

    apply_lora(model, rank=8, alpha=16, targets="c_attn,attn.c_proj,c_fc,mlp.c_proj")
    ... train: only the lora_A / lora_B parameters require gradients ...
    merge_lora(model)  # back to plain nn.Linear with W + (alpha / r) B A
    with model.disable_adapter(): ...  # the base model meanwhile; merge_lora(model, unload=False) / unmerge_lora

Each targeted nn.Linear (out, in) becomes a LoRALinear holding the same frozen `weight` and `bias`
(the same names, so the base's state-dict keys do not move) plus lora_A (r, in) and lora_B (out, r):

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

which is peft's LoRA (lora_A initialised as peft's kaiming-uniform, lora_B zero, so a fresh
adapter changes nothing). peft's `bias` option trains biases beside the adapters: "none" (no bias),
"all" (every parameter named *bias: the Linear biases and the LayerNorm biases, ln_f's included),
"lora_only" (the biases of the adapted matrices). model.py stays the spec: the swapped module is called as a module, so
hooks fire. Every other parameter of the model is frozen. The adapter's on-disk form is peft's
(checkpoint/adapter.py). An int8 base (QuantLinear) is not supported: LoRA needs the float model.

Beside the adapters, `tokens` trains chosen rows of the tied embedding (peft's
`trainable_token_indices`): wte becomes a TrainableTokens holding the frozen table and the trained
rows, which replace theirs in the embedding lookup and in the tied head alike. The embedding and head
are most of a small model and what low-rank adapters on the blocks cannot reach (docs/training.md);
a few hundred rows of the tokens a fine-tuning text uses most cost a few hundred kilobytes.

Legend: r rank, in/out the matrix's features.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kit.config import LORA_BIASES
from gpt2kit.quant.modules import is_quantized

# Our module names inside a block, the matrices LoRA can adapt.
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# Short names as peft writes them: a target matches a module whose name ends with it ("c_proj": both).
_SHORT = {"c_attn": ("attn.c_attn",), "c_fc": ("mlp.c_fc",), "c_proj": ("attn.c_proj", "mlp.c_proj")}


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """"c_attn,attn.c_proj" (or a list) -> our full names in block order; an unknown name raises,
    listing the valid ones."""
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if not names:
        raise ValueError(f"LoRA targets must name at least one of {', '.join(TARGETS)}, got {targets!r}")
    chosen: set[str] = set()
    for name in names:
        full = _SHORT.get(name, (name,) if name in TARGETS else None)
        if full is None:
            raise ValueError(f"unknown LoRA target {name!r}; valid targets: {', '.join(TARGETS)} "
                             f"(or c_attn, c_fc, c_proj)")
        chosen.update(full)
    return tuple(t for t in TARGETS if t in chosen)


@contextlib.contextmanager
def switched_off(module: nn.Module) -> Iterator[None]:
    """module.disabled within the block, an error included (GPT2.disable_adapter's per-module step)."""
    module.disabled = True
    try:
        yield
    finally:
        module.disabled = False


class LoRALinear(nn.Module):
    """nn.Linear's frozen weight (out, in) and bias, plus a trained low-rank update (alpha/r) B A."""

    def __init__(self, linear: nn.Linear, rank: int, scaling: float, dropout: float = 0.0) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        self.in_features, self.out_features, self.rank, self.scaling = in_f, out_f, rank, scaling
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach(), requires_grad=False) if linear.bias is not None else None
        kw = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, in_f, **kw))
        self.lora_B = nn.Parameter(torch.zeros(out_f, rank, **kw))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @torch.no_grad()
    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """peft's init: A kaiming-uniform with a=sqrt(5) (nn.Linear's), B zero."""
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)): sqrt(2 / 6) * sqrt(3 / in)
        self.lora_A.uniform_(-bound, bound, generator=generator)
        self.lora_B.zero_()

    merged = False  # the update is in weight (merge_lora(unload=False)): unmerge_lora takes it out
    disabled = False  # within disable_adapter: the base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if self.merged or self.disabled:
            return y
        z = F.linear(self.lora_dropout(x), self.lora_A)  # (..., r)
        return y + F.linear(z, self.lora_B) * self.scaling  # (..., out)

    @contextlib.contextmanager
    def adapter_off(self) -> Iterator[None]:
        """The base alone within the block (GPT2.disable_adapter): a merged update taken out, merged again after."""
        merged = self.merged
        if merged:
            self.unmerge()
        self.disabled = True
        try:
            yield
        finally:
            self.disabled = False
            if merged:
                self.merge()

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.weight.copy_(self.merged_weight())
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W + s B A - s B A: W within float rounding, as peft's unmerge."""
        if self.merged:
            delta = self.scaling * (self.lora_B.float() @ self.lora_A.float())
            self.weight.copy_((self.weight.float() - delta).to(self.weight.dtype))
            self.merged = False

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B A, (out, in), computed in float32 and returned in the weight's dtype."""
        delta = self.lora_B.float() @ self.lora_A.float()
        return (self.weight.float() + self.scaling * delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.rank}, " \
               f"scaling={self.scaling:g}"


class TrainableTokens(nn.Module):
    """nn.Embedding's frozen table (V, C) with the rows `indices` replaced by trained values: the
    lookup and the tied head (the model asks wte for lm_head) both read the table with them in."""

    def __init__(self, embedding: nn.Embedding, indices: Sequence[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(embedding.weight.detach(), requires_grad=False)
        self.register_buffer("token_indices", torch.tensor(list(indices), dtype=torch.long,
                                                            device=embedding.weight.device))
        self.trainable_tokens = nn.Parameter(embedding.weight.detach()[self.token_indices].clone())  # (K, C)

    def merged_weight(self) -> torch.Tensor:
        """The table with the trained rows in (V, C), differentiable in them."""
        return self.weight.index_copy(0, self.token_indices, self.trainable_tokens)

    disabled = False  # within disable_adapter: the frozen table

    def adapter_off(self) -> contextlib.AbstractContextManager[None]:
        return switched_off(self)

    def table(self) -> torch.Tensor:
        return self.weight if self.disabled else self.merged_weight()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.table())  # (..., C)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.table())  # (..., V)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, trainable rows={len(self.token_indices)}"


def check_tokens(tokens: object, n_vocab: int) -> list[int]:
    """A non-empty list of distinct token ids in [0, n_vocab), else one ValueError naming the value."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise ValueError(f"trainable tokens must be a list of token ids, got {tokens!r}")
    ids = list(tokens)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab]
    if not ids or bad:
        raise ValueError(f"trainable tokens must be token ids in [0, {n_vocab}), got {bad[:3] or ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"trainable tokens must be distinct, got {len(ids) - len(set(ids))} repeated")
    return ids


def check_bias(bias: object) -> str:
    if bias not in LORA_BIASES:
        raise ValueError(f"unknown LoRA bias {bias!r}; valid choices: {', '.join(LORA_BIASES)}")
    return bias  # type: ignore[return-value]


def bias_names(model: nn.Module, bias: str) -> list[str]:
    """The parameter names peft's `bias` option trains on a LoRA model, in model order: "all" every
    name ending in "bias" (peft's test), "lora_only" those of the LoRALinear modules, "none" none."""
    if check_bias(bias) == "none":
        return []
    if bias == "all":
        return [n for n, _ in model.named_parameters() if n == "bias" or n.endswith(".bias")]
    return [f"{name}.bias" for name, m in lora_modules(model).items() if m.bias is not None]


def check_rank(name: str, rank: object, linear: nn.Module) -> int:
    out_f, in_f = linear.weight.shape
    limit = min(out_f, in_f)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= limit:
        raise ValueError(f"LoRA rank must be an integer in [1, {limit}] for {name} ({out_f} x {in_f}), got {rank!r}")
    return rank


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, *, dropout: float = 0.0,
               targets: str | Iterable[str] = TARGETS, ranks: dict[str, int] | None = None,
               scalings: dict[str, float] | None = None, generator: torch.Generator | None = None,
               bias: str = "none", tokens: Sequence[int] | None = None) -> nn.Module:
    """Swap the targeted block matrices of a float GPT2 for LoRALinear, in place, and freeze every
    other parameter but the biases `bias` names (peft's option: none, all, lora_only). alpha defaults
    to rank (scaling 1). `ranks` / `scalings` give some modules (our names, "h.3.mlp.c_fc") their own
    rank or scaling (peft's rank_pattern / alpha_pattern). `tokens`: embedding rows trained beside
    them (TrainableTokens; peft's trainable_token_indices)."""
    if is_quantized(model):
        raise ValueError("LoRA on an int8-quantized model is not supported: adapt the float model (and "
                         "quantize after merging)")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters; merge them (merge_lora) before adding new ones")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    check_bias(bias)
    if tokens is not None:
        tokens = check_tokens(tokens, model.config.n_vocab)
    wanted = parse_targets(targets)
    swaps = []
    for i, block in enumerate(model.h):
        for target in wanted:
            name = f"h.{i}.{target}"
            parent, attr = block.get_submodule(target.split(".")[0]), target.split(".")[1]
            linear = getattr(parent, attr)
            r = check_rank(name, (ranks or {}).get(name, rank), linear)
            a = r if alpha is None else alpha
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
                raise ValueError(f"LoRA alpha must be a number > 0, got {a!r}")
            swaps.append((parent, attr, linear, r, (scalings or {}).get(name, a / r)))
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, attr, linear, r, scaling in swaps:
        module = LoRALinear(linear, r, scaling, dropout)
        module.reset_lora(generator)
        setattr(parent, attr, module)
    for name in bias_names(model, bias):
        model.get_parameter(name).requires_grad_(True)
    if tokens is not None:
        model.wte = TrainableTokens(model.wte, tokens)
    return model


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{our module name ("h.0.attn.c_attn"): its LoRALinear}, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state(model: nn.Module, bias: str = "none") -> dict[str, torch.Tensor]:
    """Only what a LoRA run trains: {"h.0.attn.c_attn.lora_A": (r, in), ... ".lora_B": (out, r)}, the
    biases `bias` names ({"ln_f.bias": (C,), ...}), and with TrainableTokens the rows
    ("wte.trainable_tokens": (K, C)) and which ids they are ("wte.token_indices": (K,), not trained)."""
    state = {f"{name}.{part}": getattr(m, part).detach() for name, m in lora_modules(model).items()
             for part in ("lora_A", "lora_B")}
    if isinstance(model.wte, TrainableTokens):  # the trained rows, and which rows they are
        state |= {"wte.trainable_tokens": model.wte.trainable_tokens.detach(),
                  "wte.token_indices": model.wte.token_indices}
    return state | {name: model.get_parameter(name).detach() for name in bias_names(model, bias)}


@torch.no_grad()
def merge_lora(model: nn.Module, *, unload: bool = True) -> nn.Module:
    """Swap every LoRALinear back for an nn.Linear holding W + scaling * B A, in place: a plain
    model again, every parameter trainable as load_model gives it. unload=False (peft's
    merge_adapter): the update goes into each LoRALinear's weight, which keeps lora_A / lora_B, so
    unmerge_lora takes it out again."""
    if not unload:
        for m in lora_modules(model).values():
            m.merge()
        return model
    for name, m in lora_modules(model).items():
        parent_name, attr = name.rsplit(".", 1)
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        linear.weight = nn.Parameter(m.merged_weight())
        if m.bias is not None:
            linear.bias = m.bias
        setattr(model.get_submodule(parent_name), attr, linear)
    if isinstance(model.wte, TrainableTokens):
        table = nn.Embedding(*model.wte.weight.shape, device="meta")
        table.weight = nn.Parameter(model.wte.merged_weight().detach())
        model.wte = table
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Take each merged LoRALinear's update back out of its weight (merge_lora(unload=False)'s
    inverse, W within float rounding, as peft's unmerge_adapter), in place."""
    for m in lora_modules(model).values():
        m.unmerge()
    return model
