"""The reference weights put into the learner's model, by name.

Each learner parameter gets a target in GPT-2's names (gpt2kit's state-dict names, checkpoint/keymap.py)
plus four of the check's own: `h.{i}.attn.q|k|v.weight|bias` (the thirds of c_attn, for models with
separate query/key/value matrices) and `lm_head.weight` (the head, which in GPT-2 is wte). The target
comes from a mapping file when it names the parameter, else from its name: nanoGPT's and OpenAI's
(transformer.h.0.attn.c_attn.weight), a book chapter's (trf_blocks.0.att.W_query, norm1.scale, out_head)
and the usual synonyms, with the shape deciding what the name leaves open (a Sequential's `layers.0`,
a LayerNorm called anything). A matrix stored (in, out), as HF's Conv1D does, is transposed: told by
its shape, and for square ones by the other matrices of the same module class. What cannot be
mapped stays as the learner initialised it and is listed, with the reference tensors left unused.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from gpt2kit._io import read_bytes
from gpt2kit.checker.learner import LearnerError
from gpt2kit.checkpoint.keymap import hf_to_ours
from gpt2kit.config import GPT2Config

_LEAF = {"weight": "weight", "w": "weight", "gamma": "weight", "scale": "weight", "g": "weight", "kernel": "weight",
         "bias": "bias", "b": "bias", "beta": "bias", "shift": "bias"}

_TOP = {
    "wte": {"wte", "tok_emb", "token_emb", "token_embedding", "token_embeddings", "tok_embeddings", "tok_embedding",
            "embed_tokens", "word_embeddings", "w_e", "tokens_embed", "token_embedding_table", "tok_embed",
            "token_embed", "embed_tok"},
    "wpe": {"wpe", "pos_emb", "pos_embedding", "pos_embeddings", "position_embedding", "position_embeddings",
            "positional_embedding", "positional_embeddings", "pos_embed", "w_pos", "position_embedding_table",
            "embed_pos", "position_embed"},
    "ln_f": {"ln_f", "norm", "final_norm", "ln_final", "final_ln", "norm_f", "final_layernorm", "final_layer_norm",
             "layer_norm", "ln", "lnf", "layernorm", "norm_out", "ln_out", "out_norm", "norm_final"},
    "lm_head": {"lm_head", "out_head", "head", "output", "unembed", "w_u", "output_proj", "proj_out", "to_logits",
                "fc_out", "output_layer", "lm_proj", "output_head", "unembedding"},
}
_BLOCK = {
    "ln_1": {"ln_1", "ln1", "norm1", "norm_1", "attn_norm", "input_layernorm", "layernorm1", "layer_norm1",
             "layer_norm_1", "ln_attn", "pre_attn_norm", "attention_norm", "norm_attn", "sa_norm"},
    "ln_2": {"ln_2", "ln2", "norm2", "norm_2", "ffn_norm", "mlp_norm", "post_attention_layernorm", "layernorm2",
             "layer_norm2", "layer_norm_2", "ln_mlp", "ff_norm", "norm_ff", "norm_mlp", "pre_mlp_norm", "ln_ff"},
    "attn.c_attn": {"c_attn", "qkv", "qkv_proj", "in_proj", "w_qkv", "wqkv", "query_key_value", "to_qkv",
                    "qkv_linear", "c_qkv", "attn_qkv"},
    "attn.q": {"w_query", "wq", "q_proj", "query", "q", "to_q", "w_q", "q_lin", "q_linear", "linear_q"},
    "attn.k": {"w_key", "wk", "k_proj", "key", "k", "to_k", "w_k", "k_lin", "k_linear", "linear_k"},
    "attn.v": {"w_value", "wv", "v_proj", "value", "v", "to_v", "w_v", "v_lin", "v_linear", "linear_v"},
    "attn.c_proj": {"out_proj", "wo", "o_proj", "w_o", "to_out", "attn_out", "o", "out_lin", "o_linear", "linear_o",
                    "attn_proj"},
    "mlp.c_fc": {"c_fc", "fc1", "w1", "w_1", "fc", "up_proj", "up", "linear1", "linear_1", "lin1", "dense_h_to_4h",
                 "fc_in", "w_in", "expand", "mlp_fc"},
    "mlp.c_proj": {"fc2", "w2", "w_2", "down_proj", "down", "linear2", "linear_2", "lin2", "dense_4h_to_h", "w_out",
                   "contract", "mlp_proj", "fc_out"},
}
_PROJ = {"c_proj", "proj", "dense", "out", "output", "projection", "linear"}  # attn's or mlp's: the parent says
_ATTN = {"attn", "att", "attention", "self_attn", "sa", "mha", "self_attention", "msa", "heads"}
_MLP = {"mlp", "ff", "ffn", "feed_forward", "feedforward", "ffwd", "mlp_block", "ff_block", "mlpf"}
_QKV = ("q", "k", "v")


@dataclass
class Assignment:
    learner: str  # the learner's parameter name
    target: str  # GPT-2's name (or one of the check's four, see the module docstring)
    transpose: bool


@dataclass
class WeightMap:
    assigned: list[Assignment]
    unset: list[tuple[str, str]]  # (learner parameter, why)
    unused: list[str]  # reference tensors no learner parameter took
    notes: list[str] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)  # target -> the learner module holding it

    def learner_for(self, target: str) -> str | None:
        return next((a.learner for a in self.assigned if a.target == target), None)


def read_mapping(source: str | os.PathLike[str] | dict | None) -> dict[str, tuple[str, bool | None]]:
    """A mapping file (JSON object: learner name -> GPT-2 name, or -> {"name": ..., "transpose": bool})
    or the same dict, checked: learner name -> (target, transpose or None for "by shape")."""
    if source is None:
        return {}
    where = "the mapping"
    if not isinstance(source, dict):
        where = os.fspath(source)
        try:
            source = json.loads(read_bytes(source).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LearnerError(f"{where}: not a JSON mapping ({e})") from None
        if not isinstance(source, dict):
            raise LearnerError(f"{where}: expected a JSON object of learner name -> GPT-2 name, "
                               f"got {type(source).__name__}")
    out = {}
    for name, value in source.items():
        transpose = None
        if isinstance(value, dict):
            extra = set(value) - {"name", "transpose"}
            transpose = value.get("transpose")
            if extra or not isinstance(transpose, (bool, type(None))):
                raise LearnerError(f"{where}: {name!r}: an entry is a name or {{\"name\": ..., \"transpose\": "
                                   f"true|false}}, got {value!r}")
            value = value.get("name")
        if not isinstance(value, str):
            raise LearnerError(f"{where}: {name!r} must map to a GPT-2 tensor name, got {value!r}")
        out[name] = (hf_to_ours(value), transpose)
    return out


def targets(cfg: GPT2Config) -> list[str]:
    """Every name a learner parameter can be mapped to."""
    names = ["wte.weight", "wpe.weight", "lm_head.weight"]
    for i in range(cfg.n_layer):
        for role in ("ln_1", "attn.c_attn", "attn.q", "attn.k", "attn.v", "attn.c_proj", "ln_2", "mlp.c_fc",
                     "mlp.c_proj"):
            names += [f"h.{i}.{role}.weight", f"h.{i}.{role}.bias"]
    return [*names, "ln_f.weight", "ln_f.bias"]


def source(target: str, ref: dict[str, torch.Tensor], cfg: GPT2Config) -> torch.Tensor | None:
    """The reference values a target takes (None: GPT-2 has no such tensor, e.g. a head bias)."""
    if target in ("wte.weight", "lm_head.weight"):
        return ref["wte.weight"][: cfg.n_vocab]
    m = re.fullmatch(r"h\.(\d+)\.attn\.([qkv])\.(weight|bias)", target)
    if m:
        C, j = cfg.n_embd, _QKV.index(m.group(2))
        return ref[f"h.{m.group(1)}.attn.c_attn.{m.group(3)}"][j * C:(j + 1) * C]
    return ref.get(target)


def _split_name(name: str) -> tuple[list[str], str | None]:
    """(module path parts, "weight" | "bias" | None) of a parameter name."""
    parts = name.split(".")
    leaf = parts[-1]
    if leaf in ("in_proj_weight", "in_proj_bias"):  # nn.MultiheadAttention: q, k, v stacked as c_attn
        return [*parts[:-1], "in_proj"], leaf.rpartition("_")[2]
    if leaf.lower() in _LEAF:
        return parts[:-1], _LEAF[leaf.lower()]
    for suffix, kind in (("_weight", "weight"), ("_bias", "bias"), ("_w", "weight"), ("_b", "bias")):
        if leaf.endswith(suffix):
            return [*parts[:-1], leaf[: -len(suffix)]], kind
    return parts, "weight"  # a bare nn.Parameter named after what it is (self.wte = nn.Parameter(...))


def _is_parent(parts: list[str], names: set[str], stems: tuple[str, ...]) -> bool:
    return any(p in names or any(s in p for s in stems) for p in parts)


def _by_shape_block(shape: tuple[int, ...], linear: bool, C: int) -> str | None:
    """A block parameter's role from its shape alone (None where the shape fits several)."""
    if len(shape) == 1:
        return {3 * C: "attn.c_attn", 4 * C: "mlp.c_fc"}.get(shape[0])
    if len(shape) != 2:
        return None
    if sorted(shape) == [C, 3 * C]:
        return "attn.c_attn"
    if sorted(shape) == [C, 4 * C]:
        out_dim = shape[0] if linear else shape[1]  # nn.Linear holds (out, in); Conv1D-style (in, out)
        return "mlp.c_fc" if out_dim == 4 * C else "mlp.c_proj"
    return None


def _block_role(inner: list[str], shape: tuple[int, ...], linear: bool, C: int) -> str | None:
    low = [p.lower() for p in inner]
    last, parents = (low[-1], low[:-1]) if low else ("", [])
    for role, names in _BLOCK.items():
        if last in names:
            return role
    by_shape = _by_shape_block(shape, linear, C)
    if last in _PROJ or last.isdigit():
        if _is_parent(parents, _ATTN, ("attn", "attention")):
            return by_shape if by_shape == "attn.c_attn" else "attn.c_proj"  # its output projection
        if _is_parent(parents, _MLP, ("mlp", "ffn", "feed")) or last.isdigit():  # a Sequential's Linears
            if by_shape in ("mlp.c_fc", "mlp.c_proj"):
                return by_shape
            return "mlp.c_proj" if shape == (C,) else None
        if shape == (C, C):
            return "attn.c_proj"  # a block's only (C, C) projection: the MLP's are (C, 4C) and (4C, C)
    return by_shape


def _top_role(parts: list[str], shape: tuple[int, ...], module: nn.Module, cfg: GPT2Config) -> str | None:
    last = parts[-1].lower() if parts else ""
    for role, names in _TOP.items():
        if last in names:
            return role
    rows = {cfg.n_vocab: "wte", cfg.n_ctx: "wpe"}
    if isinstance(module, nn.Embedding) and len(shape) == 2 and cfg.n_vocab != cfg.n_ctx:
        return rows.get(shape[0])
    if last in ("embedding", "embeddings", "embed", "emb") and len(shape) == 2 and cfg.n_vocab != cfg.n_ctx:
        return rows.get(shape[0])
    return None


def _owner(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    path = name.rpartition(".")[0]
    return path, model.get_submodule(path) if path else model


def _auto_target(model: nn.Module, name: str, p: torch.Tensor, cfg: GPT2Config) -> str | None:
    parts, kind = _split_name(name)
    _, module = _owner(model, name)
    linear = isinstance(module, nn.Linear)
    layer = next((j for j, part in enumerate(parts) if part.isdigit()), None)
    if layer is None:
        role = _top_role(parts, tuple(p.shape), module, cfg)
        return None if role is None else f"{role}.{kind}"
    if int(parts[layer]) >= cfg.n_layer:
        return None
    role = _block_role(parts[layer + 1:], tuple(p.shape), linear, cfg.n_embd)
    return None if role is None else f"h.{parts[layer]}.{role}.{kind}"


def _norm_fallback(model: nn.Module, pending: dict[str, str | None], cfg: GPT2Config) -> None:
    """LayerNorms named nothing known: in a block the first is ln_1, the second ln_2; outside, ln_f."""
    seen: dict[str, list[str]] = defaultdict(list)  # block prefix -> norm module paths in order
    for name, target in pending.items():
        path, module = _owner(model, name)
        if target is not None or "norm" not in type(module).__name__.lower():
            continue
        parts, kind = _split_name(name)
        layer = next((j for j, part in enumerate(parts) if part.isdigit()), None)
        if layer is None:
            pending[name] = f"ln_f.{kind}"
            continue
        prefix = ".".join(parts[: layer + 1])
        if path not in seen[prefix]:
            seen[prefix].append(path)
        order = seen[prefix].index(path)
        if order < 2 and int(parts[layer]) < cfg.n_layer:
            pending[name] = f"h.{parts[layer]}.ln_{order + 1}.{kind}"


def _bias_follows_weight(pending: dict[str, str | None]) -> None:
    """A bias no name placed goes where its module's weight went (a Linear the shape placed)."""
    for name, target in pending.items():
        path, _, leaf = name.rpartition(".")
        weight = pending.get(f"{path}.weight") if leaf == "bias" else None
        if target is None and weight is not None and weight.endswith(".weight"):
            pending[name] = weight.removesuffix(".weight") + ".bias"


def _transposes(model: nn.Module, chosen: dict[str, tuple[str, bool | None]], params: dict[str, torch.Tensor],
                ref: dict[str, torch.Tensor], cfg: GPT2Config) -> tuple[dict[str, bool], list[tuple[str, str]]]:
    """Whether each mapped parameter takes its tensor transposed; and those whose shape fits neither way."""
    decided: dict[str, bool] = {}
    bad: list[tuple[str, str]] = []
    square: list[str] = []
    votes: dict[type, set[bool]] = defaultdict(set)
    for name, (target, forced) in chosen.items():
        src, shape = source(target, ref, cfg), tuple(params[name].shape)
        if src is None:
            bad.append((name, f"GPT-2 has no {target}" + (" (its head has no bias)" if target == "lm_head.bias"
                                                           else "")))
            continue
        want = tuple(src.shape)
        if forced is not None:
            fits = (want[::-1] if forced else want) == shape
            if fits:
                decided[name] = forced
            else:
                bad.append((name, f"shape {shape} does not fit {target} {want}"
                                  + (" transposed" if forced else "")))
            continue
        cls = type(_owner(model, name)[1])
        if shape == want and (len(want) != 2 or want[0] != want[1]):
            decided[name] = False
            if len(want) == 2:
                votes[cls].add(False)
        elif len(want) == 2 and shape == want[::-1] and want[0] != want[1]:
            decided[name] = True
            votes[cls].add(True)
        elif shape == want:
            square.append(name)
        else:
            bad.append((name, f"shape {shape} does not fit {target} {want}"))
    for name in square:  # (C, C): the layout the same module class showed on its other matrices
        cls = type(_owner(model, name)[1])
        decided[name] = votes[cls] == {True} and cls is not nn.Linear
    return decided, bad


def map_weights(model: nn.Module, ref: dict[str, torch.Tensor], cfg: GPT2Config,
                mapping: dict[str, tuple[str, bool | None]]) -> WeightMap:
    """Decide every learner parameter's target and layout (nothing is written)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(mapping) - set(params))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(params), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise LearnerError(f"the mapping names {', '.join(unknown)}, which the learner's model does not have{hint}")
    valid = set(targets(cfg)) | set(ref)
    wrong = sorted(t for t, _ in mapping.values() if t not in valid)
    if wrong:
        close = difflib.get_close_matches(wrong[0], sorted(valid), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise LearnerError(f"the mapping maps to {', '.join(wrong)}, which GPT-2 does not have{hint}")
    pending = {n: mapping[n][0] if n in mapping else _auto_target(model, n, p, cfg) for n, p in params.items()}
    _norm_fallback(model, pending, cfg)
    _bias_follows_weight(pending)
    unset = [(n, "no GPT-2 tensor has this name or shape") for n, t in pending.items() if t is None]
    chosen: dict[str, tuple[str, bool | None]] = {}
    taken: dict[str, str] = {}
    for name, target in pending.items():
        if target is None:
            continue
        if target in taken:
            unset.append((name, f"{target} already went to {taken[target]}"))
            continue
        taken[target] = name
        chosen[name] = (target, mapping[name][1] if name in mapping else None)
    decided, bad = _transposes(model, chosen, params, ref, cfg)
    unset += bad
    assigned = [Assignment(n, chosen[n][0], decided[n]) for n in chosen if n in decided]
    owners = {a.target: _owner(model, a.learner)[0] for a in assigned}
    return WeightMap(assigned, unset, _unused(assigned, ref, cfg), _notes(assigned, params), owners)


def _unused(assigned: list[Assignment], ref: dict[str, torch.Tensor], cfg: GPT2Config) -> list[str]:
    used = {a.target for a in assigned}
    out = []
    for name in ref:
        if name in used or (name == "wte.weight" and "lm_head.weight" in used):
            continue
        m = re.fullmatch(r"(h\.\d+)\.attn\.c_attn\.(weight|bias)", name)
        if m:
            missing = [x for x in _QKV if f"{m.group(1)}.attn.{x}.{m.group(2)}" not in used]
            if len(missing) < 3:
                if missing:
                    out.append(f"{name} (the {', '.join(missing)} part{'s' if len(missing) > 1 else ''})")
                continue
        out.append(name)
    return out


def _notes(assigned: list[Assignment], params: dict[str, torch.Tensor]) -> list[str]:
    by_target = {a.target: a.learner for a in assigned}
    head, wte = by_target.get("lm_head.weight"), by_target.get("wte.weight")
    notes = []
    if head and wte and params[head] is not params[wte]:
        notes.append(f"{head} is a parameter of its own, not {wte}: both were given wte's values; GPT-2 ties "
                     f"its head to the token embedding (e.g. `self.{head.rpartition('.')[0]}.weight = "
                     f"self.{wte.rpartition('.')[0]}.weight`)")
    return notes


@torch.no_grad()
def load_weights(model: nn.Module, ref: dict[str, torch.Tensor], cfg: GPT2Config,
                 mapping: dict[str, tuple[str, bool | None]]) -> WeightMap:
    """Map (map_weights, mapping as read_mapping gives it) and copy the reference values into the
    learner's parameters."""
    wm = map_weights(model, ref, cfg, mapping)
    params = dict(model.named_parameters())
    for a in wm.assigned:
        src = source(a.target, ref, cfg)
        params[a.learner].copy_(src.t() if a.transpose else src)
    return wm
