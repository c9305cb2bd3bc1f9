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

What an SAE reads is what its training model computed at the hook point. SAELens trains on
TransformerLens models, and `model_from_pretrained_kwargs: {"center_writing_weights": true}` (in
`metadata`, or at the top level before 6.x; the `gpt2-small-res-jb` set has it) says that model's
weights writing to the residual stream (wte, wpe, each c_proj and its bias) had their mean over the
width removed: then every vector in the stream, and each attention and MLP output, has mean 0 over
its C numbers, and LayerNorm's outputs (so everything else) are unchanged. `SAE.read` turns the
network's tensor at the hook point into that input; `SAE.features` encodes it.
Legend: T tokens, D d_in, F d_sae, K top features, nh heads, hs head size.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpt2kit.trace.points import PER_HEAD, resolve

ARCHITECTURES = ("standard", "jumprelu", "topk")
NORMS = ("none", "constant_norm_rescale", "layer_norm")
# Our names whose tensor is a sum of vectors written to the residual stream: centred writing weights
# make these mean-0 over the width (embed.tok / embed.pos are wte / wpe rows, also written).
_WRITTEN = re.compile(r"embed\.(tok|pos)|resid\.\d+|h\.\d+\.(resid_mid|attn\.out|mlp\.out)")


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
    center_writing_weights: bool = False  # its model's writing weights were centred (module docstring)

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

    @property
    def centres(self) -> bool:
        """Whether read() removes each position's mean: centred writing weights, at a written point."""
        return self.center_writing_weights and _WRITTEN.fullmatch(self.name) is not None

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """The network's tensor at the hook point as the trace names it ((..., T, D), or (..., nh, T, hs)
        for a per-head name) -> what the SAE reads: (..., T, D) float32, heads side by side as SAELens
        flattens hook_z, and each position's mean over the width removed when `centres`."""
        x = x.float()
        if self.name.split(".", 2)[-1] in PER_HEAD:
            x = x.transpose(-3, -2).flatten(-2)  # (..., nh, T, hs) -> (..., T, nh * hs)
        return x - x.mean(-1, keepdim=True) if self.centres else x

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The network's tensor at the hook point (as read() takes it) -> (..., T, F) feature activations."""
        return self.encode(self.read(x))

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(T, D) of what the SAE reads (read()) -> (T, F) feature activations."""
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
        return f, self._decode(f, state)

    def _decode(self, f: torch.Tensor, state: tuple) -> torch.Tensor:
        """(T, F) feature activations -> (T, D), undoing the input's normalisation (`state`, from _encode)."""
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            f = f / self.W_dec.norm(dim=-1)
        out = f @ self.W_dec + self.b_dec
        if state[0] == "scale":
            out = out / state[1]
        elif state[0] == "ln":
            out = out * state[2] + state[1]
        return out

    @torch.no_grad()
    def clamp_delta(self, x: torch.Tensor, features: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What clamping `features` (K,) to `values` (K,) adds to what the SAE reads, (..., T, D) (read()):
        decode(clamped) - decode(features), i.e. the clamped reconstruction with the error term
        (x - reconstruction) kept, minus x (sae-lens's use_error_term). Clamping a feature to its own
        value adds exactly 0."""
        f, state = self._encode(x)
        g = f.clone()
        g[..., features] = values.to(g)
        return self._decode(g, state) - self._decode(f, state)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true/false", type(None): "null"}


def _json_type(v) -> str:
    return _JSON_TYPES.get(type(v), "a number")


def _read_cfg(cfg_path: Path) -> dict:
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: holds {_json_type(cfg)}; expected an object of settings "
                         "(d_in, d_sae, architecture, metadata: {hook_name, ...}), as SAELens writes it")
    if not isinstance(cfg.get("metadata") or {}, dict):
        raise ValueError(f"{cfg_path}: metadata is {_json_type(cfg['metadata'])}; expected an object")
    return cfg


def _setting(cfg: dict, key: str, kind: type, default, cfg_path: Path, expected: str):
    """cfg[key] (or metadata's, where SAELens 6 keeps model settings), checked to be a `kind`."""
    meta = cfg.get("metadata") or {}
    v = meta.get(key, cfg.get(key, default)) if key in meta or key in cfg else default
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if v is not default and not ok:
        raise ValueError(f"{cfg_path}: {key} is {json.dumps(v)}; expected {expected}")
    return v


def _center_writing_weights(cfg: dict, cfg_path: Path) -> bool:
    kwargs = _setting(cfg, "model_from_pretrained_kwargs", dict, None, cfg_path,
                      'an object of TransformerLens from_pretrained arguments, e.g. {"center_writing_weights": true}')
    v = (kwargs or {}).get("center_writing_weights", False)
    if not isinstance(v, bool):
        raise ValueError(f"{cfg_path}: model_from_pretrained_kwargs.center_writing_weights is {json.dumps(v)}; "
                         "expected true or false")
    return v


def _choice(cfg: dict, key: str, default: str, choices: tuple[str, ...], cfg_path: Path) -> str:
    v = cfg.get(key, default)
    v = "none" if key == "normalize_activations" and (v is False or v is None) else v
    if v not in choices:
        raise ValueError(f"{cfg_path}: {key} {v!r} is not supported; supported: {', '.join(choices)}")
    return v


# Each tensor's shape in (D, F) terms, for checks and messages.
_SHAPES = {"W_enc": ("d_in", "d_sae"), "b_enc": ("d_sae",), "W_dec": ("d_sae", "d_in"), "b_dec": ("d_in",),
           "threshold": ("d_sae",)}


def _read_weights(w_path: Path, need: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors as float32, each floating, of its rank and finite; ValueError naming the file
    and the tensor otherwise."""
    try:
        w = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{w_path}: cannot read it as safetensors ({e}); is it truncated or corrupt?") from None
    out = {}
    for k in need:
        if k not in w:
            raise ValueError(f"{w_path}: no {k!r} tensor (has: {', '.join(sorted(w)) or 'none'})")
        t, want = w[k], _SHAPES[k]
        if not t.is_floating_point():
            raise ValueError(f"{w_path}: {k} has dtype {t.dtype}; expected a float tensor")
        if t.dim() != len(want):
            raise ValueError(f"{w_path}: {k} has shape {tuple(t.shape)}; expected {len(want)}-D "
                             f"({', '.join(want)}{',' if len(want) == 1 else ''})")
        t = t.float()
        bad = (~t.isfinite()).nonzero()
        if len(bad):
            raise ValueError(f"{w_path}: {k} holds {len(bad):,} value(s) that are not finite float32 (NaN, ±inf or "
                             f"beyond ±3.4e38), the first at {tuple(bad[0].tolist())}: every feature would be NaN")
        out[k] = t
    D, F = out["W_enc"].shape
    size = {"d_in": D, "d_sae": F}
    for k in need[1:]:
        want = tuple(size[n] for n in _SHAPES[k])
        if tuple(out[k].shape) != want:
            raise ValueError(f"{w_path}: {k} has shape {tuple(out[k].shape)}, expected {want} from W_enc {(D, F)}")
    return out


def _hook(cfg: dict, cfg_path: Path, n_layer: int, n_head: int) -> tuple[str, str]:
    """(the file's hook name, ours)."""
    hook = _setting(cfg, "hook_name", str, None, cfg_path, "a TransformerLens hook name") or \
        _setting(cfg, "hook_point", str, None, cfg_path, "a TransformerLens hook name")
    if not hook:
        raise ValueError(f"{cfg_path}: no hook_name (in metadata or at the top level): where does the SAE read?")
    if _setting(cfg, "hook_head_index", object, None, cfg_path, "") is not None:
        raise ValueError(f"{cfg_path}: an SAE of one head (hook_head_index) is not supported")
    try:
        name, _ = resolve(hook, n_layer, n_head)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: its hook_name {hook!r} is no point of this model ({e})") from None
    return hook, name


def load_sae(path, n_layer: int, n_head: int) -> SAE:
    """The SAE in a SAELens-format directory; ValueError naming the file, the setting or tensor, and what
    is expected, for anything missing, malformed or unsupported."""
    d = Path(path)
    cfg_path, w_path = d / "cfg.json", d / "sae_weights.safetensors"
    for f in (cfg_path, w_path):
        if not f.is_file():
            raise ValueError(f"{d}: no {f.name} (an SAE saved by SAELens holds cfg.json and sae_weights.safetensors)")
    cfg = _read_cfg(cfg_path)
    arch = _choice(cfg, "architecture", "standard", ARCHITECTURES, cfg_path)
    norm = _choice(cfg, "normalize_activations", "none", NORMS, cfg_path)
    flags = {key: _setting(cfg, key, bool, default, cfg_path, "true or false")
             for key, default in (("rescale_acts_by_decoder_norm", False), ("apply_b_dec_to_input", True))}
    center = _center_writing_weights(cfg, cfg_path)
    hook, name = _hook(cfg, cfg_path, n_layer, n_head)
    sizes = {key: _setting(cfg, key, int, None, cfg_path, "an integer") for key in ("d_in", "d_sae")}
    k = _setting(cfg, "k", int, None, cfg_path, "an integer")
    w = _read_weights(w_path, ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if arch == "jumprelu" else []))
    D, F = w["W_enc"].shape
    for key, n in (("d_in", D), ("d_sae", F)):
        if sizes[key] is not None and sizes[key] != n:
            raise ValueError(f"{cfg_path}: {key} {sizes[key]} disagrees with W_enc's shape {(D, F)} in {w_path.name}")
    if arch == "topk" and not (k is not None and 0 < k <= F):
        raise ValueError(f"{cfg_path}: a topk SAE needs k in [1, {F}], got {k!r}")
    return SAE(hook_name=hook, name=name, architecture=arch, W_enc=w["W_enc"], b_enc=w["b_enc"], W_dec=w["W_dec"],
               b_dec=w["b_dec"], threshold=w.get("threshold"), k=k if arch == "topk" else None,
               normalize_activations=norm, path=str(d), center_writing_weights=center, **flags)


def activations(tr, sae: SAE) -> torch.Tensor:
    """The trace's tensor at the SAE's hook point as the SAE reads it (SAE.read): (T, D)."""
    if sae.name not in tr.tensors:
        raise ValueError(f"the SAE reads {sae.hook_name!r} = {sae.name!r}, which this trace did not record "
                         "(widen --layers/--what)")
    x = sae.read(tr[sae.name])
    if x.shape[-1] != sae.d_in:
        raise ValueError(f"the SAE's d_in is {sae.d_in}, but {sae.name!r} is {x.shape[-1]} wide "
                         f"(n_embd {tr.config.n_embd}): an SAE for another model?")
    return x


@torch.no_grad()
def sae_view(tr, sae: SAE, k: int = 5, n_features: int = 10) -> dict:
    """Per token the top-k features; the features with the largest activation anywhere, each with
    the tokens that activate it most; reconstruction error and the fraction of variance explained
    (both of what the SAE reads: centred, when it centres)."""
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
            "centred": sae.centres,
            "d_in": sae.d_in, "d_sae": sae.d_sae, "top_ids": top_i.tolist(), "top_acts": top_v.tolist(),
            "l0": (f > 0).sum(-1).tolist(), "features": feats, "feature_tokens": top_tokens,
            "mse": float(err.mean() / sae.d_in), "sq_error": err.tolist(),
            "fve": float(1 - err.sum() / total) if total > 0 else None}
