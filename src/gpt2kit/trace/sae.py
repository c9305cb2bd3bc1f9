"""Sparse autoencoders saved in SAELens's format, read at their hook point of a trace.

A directory holds `cfg.json` and `sae_weights.safetensors` (SAELens's SAE_CFG_FILENAME and
SAE_WEIGHTS_FILENAME). The names and conventions are SAELens 6's (sae_lens/saes/*.py):
W_enc (d_in, d_sae), b_enc (d_sae), W_dec (d_sae, d_in), b_dec (d_in), jumprelu's threshold (d_sae);
`hook_name` in `metadata` (6.x) or at the top level (earlier versions, also `hook_point`);
encode(x) = act((norm_in(x) - b_dec * apply_b_dec_to_input) @ W_enc + b_enc) with act ReLU
(standard), ReLU where the pre-activation exceeds the threshold (jumprelu), or ReLU of the k largest
(topk; pre-activations first scaled by ||W_dec|| rows when rescale_acts_by_decoder_norm); decode(f)
= norm_out(f @ W_dec + b_dec); norm: none, constant_norm_rescale (x * sqrt(d_in) / ||x||) or
layer_norm ((x - mean) / (std + 1e-5), std unbiased). A hook_z SAE reads the heads side by side.
Legend: T tokens, D d_in, F d_sae, K top features.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2kit.trace.points import resolve

ARCHITECTURES = ("standard", "jumprelu", "topk")
NORMS = ("none", "constant_norm_rescale", "layer_norm")


@dataclass(frozen=True)
class SAE:
    hook_name: str  # as the file names it (a TransformerLens hook name)
    name: str  # ours
    architecture: str
    W_enc: torch.Tensor  # (D, F)
    b_enc: torch.Tensor  # (F,)
    W_dec: torch.Tensor  # (F, D)
    b_dec: torch.Tensor  # (D,)
    threshold: torch.Tensor | None = None  # jumprelu (F,)
    k: int | None = None  # topk
    rescale_acts_by_decoder_norm: bool = False
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    path: str = ""

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    def _norm_in(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        if self.normalize_activations == "constant_norm_rescale":
            c = math.sqrt(self.d_in) / x.norm(dim=-1, keepdim=True)
            return x * c, ("scale", c)
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            return x / (std + 1e-5), ("ln", mu, std)
        return x, ("none",)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(T, D) activations -> (T, F) feature activations."""
        return self._encode(x)[0]

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        x, state = self._norm_in(x.float())
        pre = (x - self.b_dec * self.apply_b_dec_to_input) @ self.W_enc + self.b_enc  # (T, F)
        if self.architecture == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype), state
        if self.architecture == "topk":
            if self.rescale_acts_by_decoder_norm:
                pre = pre * self.W_dec.norm(dim=-1)
            vals, idx = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter(-1, idx, vals.relu()), state
        return torch.relu(pre), state

    @torch.no_grad()
    def reconstruct(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature activations (T, F), reconstruction (T, D)) of (T, D) activations."""
        f, state = self._encode(x)
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            f_dec = f / self.W_dec.norm(dim=-1)
        else:
            f_dec = f
        out = f_dec @ self.W_dec + self.b_dec
        if state[0] == "scale":
            out = out / state[1]
        elif state[0] == "ln":
            out = out * state[2] + state[1]
        return f, out


def _hook_name(cfg: dict) -> str | None:
    meta = cfg.get("metadata") or {}
    return meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")


def load_sae(path, n_layer: int, n_head: int) -> SAE:
    """The SAE in a SAELens-format directory; ValueError naming what is missing or unsupported."""
    d = Path(path)
    cfg_path, w_path = d / "cfg.json", d / "sae_weights.safetensors"
    for f in (cfg_path, w_path):
        if not f.is_file():
            raise ValueError(f"{d}: no {f.name} (an SAE saved by SAELens holds cfg.json and sae_weights.safetensors)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path}: not JSON ({e})") from None
    arch = cfg.get("architecture", "standard")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{cfg_path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    norm = cfg.get("normalize_activations", "none")
    norm = "none" if norm is False or norm is None else norm
    if norm not in NORMS:
        raise ValueError(f"{cfg_path}: normalize_activations {norm!r} is not supported; supported: {', '.join(NORMS)}")
    hook = _hook_name(cfg)
    if not hook:
        raise ValueError(f"{cfg_path}: no hook_name (in metadata or at the top level): where does the SAE read?")
    meta = cfg.get("metadata") or {}
    if meta.get("hook_head_index", cfg.get("hook_head_index")) is not None:
        raise ValueError(f"{cfg_path}: an SAE of one head (hook_head_index) is not supported")
    try:
        name, head = resolve(hook, n_layer, n_head)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: its hook_name {hook!r} is no point of this model ({e})") from None
    from safetensors.torch import load_file

    w = load_file(str(w_path))
    need = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if arch == "jumprelu" else [])
    missing = [k for k in need if k not in w]
    if missing:
        raise ValueError(f"{w_path}: no {missing[0]!r} tensor (has: {', '.join(sorted(w))})")
    W_enc = w["W_enc"].float()
    D, F = W_enc.shape
    for k, shape in (("b_enc", (F,)), ("W_dec", (F, D)), ("b_dec", (D,))):
        if tuple(w[k].shape) != shape:
            raise ValueError(f"{w_path}: {k} has shape {tuple(w[k].shape)}, expected {shape} from W_enc {(D, F)}")
    for key in ("d_in", "d_sae"):
        if key in cfg and int(cfg[key]) != {"d_in": D, "d_sae": F}[key]:
            raise ValueError(f"{cfg_path}: {key} {cfg[key]} disagrees with W_enc's shape {(D, F)}")
    k = cfg.get("k")
    if arch == "topk" and not (isinstance(k, int) and 0 < k <= F):
        raise ValueError(f"{cfg_path}: a topk SAE needs k in [1, {F}], got {k!r}")
    return SAE(hook_name=hook, name=name, architecture=arch, W_enc=W_enc, b_enc=w["b_enc"].float(),
               W_dec=w["W_dec"].float(), b_dec=w["b_dec"].float(),
               threshold=w["threshold"].float() if arch == "jumprelu" else None, k=k if arch == "topk" else None,
               rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
               apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)), normalize_activations=norm,
               path=str(d))


def activations(tr, sae: SAE) -> torch.Tensor:
    """The trace's tensor at the SAE's hook point as (T, D); per-head tensors side by side (hook_z)."""
    if sae.name not in tr.tensors:
        raise ValueError(f"the SAE reads {sae.hook_name!r} = {sae.name!r}, which this trace did not record "
                         "(widen --layers/--what)")
    x = tr[sae.name]
    if x.dim() == 3:  # (nh, T, hs) -> (T, nh * hs), as SAELens flattens hook_z
        x = x.transpose(0, 1).reshape(x.shape[1], -1)
    if x.shape[-1] != sae.d_in:
        raise ValueError(f"the SAE's d_in is {sae.d_in}, but {sae.name!r} is {x.shape[-1]} wide "
                         f"(n_embd {tr.config.n_embd}): an SAE for another model?")
    return x.float()


@torch.no_grad()
def sae_view(tr, sae: SAE, k: int = 5, n_features: int = 10) -> dict:
    """Per token the top-k features; the features with the largest activation anywhere, each with
    the tokens that activate it most; reconstruction error and the fraction of variance explained."""
    x = activations(tr, sae)
    f, rec = sae.reconstruct(x)
    T = x.shape[0]
    k = min(k, sae.d_sae)
    top_v, top_i = f.topk(k, dim=-1)  # (T, K)
    peak = f.max(0).values  # (F,)
    feats = [int(i) for i in peak.topk(min(n_features, sae.d_sae)).indices if peak[i] > 0]
    top_tokens = []
    for i in feats:
        v, p = f[:, i].topk(min(5, T))
        top_tokens.append([[int(a), float(b)] for a, b in zip(p, v, strict=True) if b > 0])
    err = (x - rec).pow(2).sum(-1)  # (T,)
    total = (x - x.mean(0)).pow(2).sum()
    return {"path": sae.path, "hook_name": sae.hook_name, "name": sae.name, "architecture": sae.architecture,
            "d_in": sae.d_in, "d_sae": sae.d_sae, "top_ids": top_i.tolist(), "top_acts": top_v.tolist(),
            "l0": (f > 0).sum(-1).tolist(), "features": feats, "feature_tokens": top_tokens,
            "mse": float(err.mean() / sae.d_in), "sq_error": err.tolist(),
            "fve": float(1 - err.sum() / total) if total > 0 else None}
