"""Weight-only int8 quantization: the scheme, the quantized modules and quantize_model().

Decoding streams every weight once per token, so its speed is set by the weights' bytes; int8
weights are a quarter of float32's. The scheme ("int8") is symmetric and per output channel:
for a matrix W (out, in), s = max|W[o, :]| / 127 per row o, Q = round(W / s) in [-127, 127],
and W ≈ Q * s[:, None]. Activations stay in floating point (weight-only: int8 activations cost
GPT-2 real quality, weights barely any; docs/quantization.md has the measured gate).

What is quantized: the four matrices of every block (attn.c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj) and, when lm_head=True, the tied token embedding / LM head wte (31% of GPT-2 124M's
weights and the largest product of a decode step; its lookups then read dequantized rows).
Biases, LayerNorms and the position embedding stay as they are.

It is a module swap: each nn.Linear becomes a QuantLinear (an int8 `weight` buffer, a `scale`
buffer, the float `bias`) and wte a QuantEmbedding, so the model's code stays the spec and
forward hooks still fire. Products run through gpt2kit.decode.int8 (the kernel measured fastest
on the machine). A quantized model is for inference: putting it in training mode raises.

Opt-in, the same int8 modules can run with int8 activations too (`set_activations(model, "int8")`,
or through the quality gate: gpt2kit.quant.gate): each product's input rows are quantized to int8
on the fly (per-row scales) and multiplied int8 x int8 in int32 (gpt2kit.decode.int8act), as
CTranslate2 and ONNX Runtime run int8 models. It is a way of running the model, not part of it:
the weights, the state dict and a saved checkpoint are the same in both modes.

Legend: R rows, in/out the matrix's features, V embedding rows, C n_embd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kit.config import QUANT_SCALE_DTYPES, QUANT_SCHEMES, check_scheme
from gpt2kit.decode.int8 import int8_linear
from gpt2kit.decode.int8act import MAX_IN_FEATURES, int8act_linear
from gpt2kit.decode.layout import use_huge_pages

__all__ = ["ACTIVATIONS", "SCALE_DTYPES", "SCHEMES", "QuantEmbedding", "QuantLinear", "activations", "check_scheme",
           "is_quantized", "parameter_count", "quality", "quantization", "quantize_model", "quantize_weight",
           "quantized_skeleton", "set_activations", "weight_bytes"]

ACTIVATIONS = ("float", "int8")  # how an int8 model's products take their input rows

SCHEMES = QUANT_SCHEMES
SCALE_DTYPES = {name: getattr(torch, name) for name in QUANT_SCALE_DTYPES}
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _scale_dtype(scale_dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(scale_dtype, torch.dtype) and scale_dtype in SCALE_DTYPES.values():
        return scale_dtype
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale dtype {scale_dtype!r}; valid choices: {', '.join(SCALE_DTYPES)}")
    return SCALE_DTYPES[scale_dtype]


@torch.no_grad()
def quantize_weight(w: torch.Tensor, scale_dtype: str | torch.dtype = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w (out, in) float -> (q (out, in) int8, s (out,)) with w ≈ q * s[:, None].

    The scale is rounded to scale_dtype before q is computed, so q is the best int8 code for the
    scale that is actually stored. An all-zero row gets scale 1 (and zeros)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)  # (out,)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(_scale_dtype(scale_dtype))
    q = torch.round(w / s.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()  # (out, in) row-major
    return q, s


class QuantLinear(nn.Module):
    """nn.Linear with an int8 weight (out, in) and a per-output-channel scale (out,)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 scale_dtype: str | torch.dtype = "float32", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=_scale_dtype(scale_dtype), device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.training = False
        self.activations = "float"  # or "int8": set_activations

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale_dtype: str | torch.dtype = "float32") -> QuantLinear:
        q, s = quantize_weight(linear.weight, scale_dtype)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, scale_dtype=scale_dtype,
                dtype=linear.weight.dtype, device="meta")
        m.weight, m.scale = q.to(linear.weight.device), s.to(linear.weight.device)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "int8":
            return int8act_linear(x, self.weight, self.scale, self.bias)  # (..., out)
        return int8_linear(x, self.weight, self.scale, self.bias)  # (..., out)

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(weight, scale, bias) while the product is int8_linear's (float activations), else None
        (gpt2kit.decode.int8.Int8Weights)."""
        return (self.weight, self.scale, self.bias) if self.activations == "float" else None

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (out, in) these int8 values and scales stand for."""
        return self.weight.float() * self.scale.float()[:, None]

    def train(self, mode: bool = True) -> QuantLinear:
        if mode:
            raise ValueError("an int8-quantized model is for inference only; train the float model, then quantize it")
        return super().train(False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8, scale={str(self.scale.dtype).removeprefix('torch.')}"
                + (", int8 activations" if self.activations == "int8" else ""))


class QuantEmbedding(nn.Module):
    """The tied token embedding / LM head with int8 rows (V, C) and a scale per row (V,).

    forward(idx) looks rows up and dequantizes them (the embedding); `lm_head(x)` is the tied head's
    product x @ (W * s)^T by the int8 kernels (GPT2.lm_head calls it). `weight` stays the int8
    table, so code that multiplies by ``wte.weight`` directly fails loudly instead of computing garbage."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale_dtype: str | torch.dtype = "float32",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype or torch.get_default_dtype()  # the float dtype lookups return
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(num_embeddings, dtype=_scale_dtype(scale_dtype), device=device))
        self.training = False
        self.activations = "float"  # or "int8" (the head's product; lookups are dequantized rows either way)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, scale_dtype: str | torch.dtype = "float32") -> QuantEmbedding:
        q, s = quantize_weight(emb.weight, scale_dtype)
        m = cls(emb.num_embeddings, emb.embedding_dim, scale_dtype=scale_dtype, dtype=emb.weight.dtype,
                device="meta")
        m.weight, m.scale = q.to(emb.weight.device), s.to(emb.weight.device)
        return m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(idx, self.weight)  # (..., C) int8
        return rows.to(self.dtype) * self.scale[idx].to(self.dtype)[..., None]

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """The tied head's product, which GPT2.lm_head asks its wte for: x (..., C) -> (..., V) over
        every row (GPT2.lm_head cuts padded rows, as for the float table)."""
        if self.activations == "int8":
            return int8act_linear(x, self.weight, self.scale)
        return int8_linear(x, self.weight, self.scale)

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """The head's (weight, scale, None) while it is int8_linear's (float activations), else None
        (gpt2kit.decode.int8.Int8Weights)."""
        return (self.weight, self.scale, None) if self.activations == "float" else None

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]

    def train(self, mode: bool = True) -> QuantEmbedding:
        if mode:
            raise ValueError("an int8-quantized model is for inference only; train the float model, then quantize it")
        return super().train(False)

    def _apply(self, fn, recurse: bool = True):
        # model.to(dtype) casts floating tensors only; keep the lookup dtype in step with the scale's
        # neighbours (it follows the float tensors of the model, read from a probe).
        out = super()._apply(fn, recurse)
        probe = fn(torch.zeros((), dtype=self.dtype))
        if probe.dtype.is_floating_point:
            self.dtype = probe.dtype
        return out

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, int8, "
                f"scale={str(self.scale.dtype).removeprefix('torch.')}"
                + (", int8 activations" if self.activations == "int8" else ""))


def quantization(model: nn.Module) -> dict | None:
    """The model's quantization as config.json records it, or None for a float model:
    {"scheme": "int8", "lm_head": bool, "scale_dtype": "float32" | "bfloat16"}."""
    quant = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if not quant:
        return None
    return {"scheme": "int8", "lm_head": isinstance(model.wte, QuantEmbedding),
            "scale_dtype": str(quant[0].scale.dtype).removeprefix("torch.")}


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())


def activations(model: nn.Module) -> str | None:
    """How an int8 model's products take their inputs: "float" (weight-only, the default) or "int8";
    None for a float model."""
    quant = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if not quant:
        return None
    return "int8" if all(m.activations == "int8" for m in quant) else "float"


def set_activations(model: nn.Module, mode: str) -> nn.Module:
    """Run an int8 model's products on float activations ("float", weight-only: the default) or on
    int8 ones ("int8": gpt2kit.decode.int8act), in place; returns the model. This applies the mode
    as asked, with no quality check: gpt2kit.quant.gate.use_int8_activations measures the gate first.
    ValueError for another mode, a float model, or in_features beyond the int32 sums' range."""
    if mode not in ACTIVATIONS:
        raise ValueError(f"unknown activation mode {mode!r}; valid choices: {', '.join(ACTIVATIONS)}")
    quant = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if not quant:
        raise ValueError(f"{mode} activations apply to an int8 model; this one is not quantized "
                         "(quantize_model, or --quantize int8)")
    widest = max(m.weight.shape[1] for m in quant)
    if mode == "int8" and widest > MAX_IN_FEATURES:
        raise ValueError(f"int8 activations take in_features up to {MAX_IN_FEATURES} (int32 sums), "
                         f"this model has {widest}")
    for m in quant:
        m.activations = mode
    return model


def _swap(model: nn.Module, lm_head: bool, make_linear, make_embedding) -> None:
    for block in model.h:
        block.attn.c_attn = make_linear(block.attn.c_attn)
        block.attn.c_proj = make_linear(block.attn.c_proj)
        block.mlp.c_fc = make_linear(block.mlp.c_fc)
        block.mlp.c_proj = make_linear(block.mlp.c_proj)
    if lm_head:
        model.wte = make_embedding(model.wte)  # GPT2.lm_head then asks it for the head's product


def quantize_model(model: nn.Module, scheme: str = "int8", *, lm_head: bool = True,
                   scale_dtype: str = "float32") -> nn.Module:
    """Swap a float GPT2's block matrices (and, with lm_head, the tied wte) for int8 modules, in
    place; returns the model, in eval mode. Quantizing an already quantized model raises."""
    check_scheme(scheme)
    _scale_dtype(scale_dtype)
    have = quantization(model)
    if have is not None:
        raise ValueError(f"the model is already {have['scheme']}-quantized; quantize its float checkpoint instead")
    model.eval()
    _swap(model, lm_head, lambda m: QuantLinear.from_linear(m, scale_dtype),
          lambda m: QuantEmbedding.from_embedding(m, scale_dtype))
    return use_huge_pages(model)  # the int8 matrices on huge pages where the system has them (CPU)


def quantized_skeleton(model: nn.Module, lm_head: bool, scale_dtype: str = "float32") -> nn.Module:
    """Swap in empty int8 modules of the right shapes (on the model's device, e.g. meta): what a
    quantized checkpoint is loaded into."""
    model.eval()

    def linear(m: nn.Linear) -> QuantLinear:
        return QuantLinear(m.in_features, m.out_features, m.bias is not None, scale_dtype=scale_dtype,
                           dtype=m.weight.dtype, device=m.weight.device)

    def embedding(m: nn.Embedding) -> QuantEmbedding:
        return QuantEmbedding(m.num_embeddings, m.embedding_dim, scale_dtype=scale_dtype, dtype=m.weight.dtype,
                              device=m.weight.device)
    _swap(model, lm_head, linear, embedding)
    return model


def parameter_count(model: nn.Module) -> int:
    """The parameters the model stands for, as its float model counts them: an int8 code is the
    weight it stands for, a scale is not a parameter (for a float model: num_parameters())."""
    codes = sum(m.weight.numel() for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    return sum(p.numel() for p in model.parameters()) + codes


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (int8 weights, scales, float tensors)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@torch.inference_mode()
def quality(float_model: nn.Module, quant_model: nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """How much quantization changes a model on held-out text windows (N, T) of token ids:
    perplexity of each model (next-token, every position of every window), its relative rise, the
    share of positions whose greedy next token (argmax) is the same, and the mean per-position
    KL(float || quantized) in nats."""
    nll_f = nll_q = agree = kl = n = 0.0
    for w in windows:
        ids = w[None]  # (1, T)
        lp_f = torch.log_softmax(float_model(ids).logits.float(), -1)[0, :-1]  # (T - 1, V)
        lp_q = torch.log_softmax(quant_model(ids).logits.float(), -1)[0, :-1]
        targets = w[1:, None]  # (T - 1, 1)
        nll_f -= lp_f.gather(-1, targets).sum().item()
        nll_q -= lp_q.gather(-1, targets).sum().item()
        agree += (lp_f.argmax(-1) == lp_q.argmax(-1)).sum().item()
        kl += (lp_f.exp() * (lp_f - lp_q)).sum().item()
        n += len(targets)
    ppl_f, ppl_q = math.exp(nll_f / n), math.exp(nll_q / n)
    return {"ppl_float": ppl_f, "ppl_int8": ppl_q, "ppl_rise": ppl_q / ppl_f - 1, "agree": agree / n,
            "kl_mean": kl / n, "positions": int(n)}
