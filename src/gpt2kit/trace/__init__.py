"""The forward pass made visible, exactly: `trace(model, tokenizer, text_or_ids)` -> `Trace`.

Every intermediate is recorded by forward hooks on the network's own modules (wte, wpe, drop, each
block's ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, the block itself, ln_f), so
the numbers are the ones the forward pass computed; the hooks only read. The one thing the network
does not materialise is the attention matrix (SDPA fuses it away), so scores and probabilities are
derived from the recorded q and k: q k^T / sqrt(hs), causal mask, softmax (proven equal to
transformers' eager attention in tests/test_trace.py).

Names (spec notation in docs/trace.md; one input, so no batch axis):
  embed.tok (T, C) wte[X]                      embed.pos (T, C) wpe[pos]
  resid.{l} (T, C) H^(l), l = 0..L (resid.0 = wte[X] + wpe[pos]; resid.{i+1} = block i's output)
  h.{i}.ln_1 (T, C)   h.{i}.attn.q/k/v (nh, T, hs)   h.{i}.attn.scores/probs (nh, T, T)
  h.{i}.attn.z (nh, T, hs) = P V per head      h.{i}.attn.out (T, C) A = c_proj(merge(z))
  h.{i}.resid_mid (T, C) H' = H + A            h.{i}.ln_2 (T, C)
  h.{i}.mlp.pre (T, 4C) c_fc   h.{i}.mlp.post (T, 4C) GELU   h.{i}.mlp.out (T, C) M
  ln_f (T, C)   logits (T, V)

Legend: T tokens, C n_embd, nh heads, hs head size, L layers, V vocab.
"""

from __future__ import annotations

import html
import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpt2kit._io import atomic_write
from gpt2kit.trace import views
from gpt2kit.trace.intervene import (
    Intervention,
    ablate,
    edits_for,
    hook,
    means_needed,
    replace,
    resolve_all,
    steer,
)
from gpt2kit.trace.metrics import (
    MetricSpec,
    Pair,
    make_metric,
    newline_hint,
    pairs_from_rows,
    parse_metric,
    read_pairs,
)
from gpt2kit.trace.patching import PatchResult, default_metric, patch
from gpt2kit.trace.points import ALIASES, capture_run, run_with_hooks
from gpt2kit.trace.record import (
    DEFAULT_MAX_BYTES,
    GROUPS,
    KINDS,
    attention_from_qk,
    estimate_bytes,
    parse_layers,
    parse_what,
    run_hooked,
)
from gpt2kit.trace.report import render_html, report_data, token_text
from gpt2kit.trace.sae import SAE, load_sae, sae_view
from gpt2kit.trace.sae import activations as sae_activations
from gpt2kit.trace.steering import Clamp, Interventions, clamp


@dataclass
class Trace:
    """Every recorded intermediate of one forward pass, by name (see the module docstring)."""

    ids: list[int]
    tokens: list[str]  # each id decoded on its own (`bytes:\xNN` for a piece of a character)
    tensors: dict[str, torch.Tensor]
    model: Any = field(repr=False)  # the GPT2 (views use its ln_f, wte and c_proj)
    layers: tuple[int, ...] = ()
    what: frozenset[str] = frozenset()
    top_k: int = 10
    name: str = ""  # the model's name, for the report
    patching: PatchResult | None = None  # when patch_from was given
    clean: Trace | None = None  # with interventions: the unchanged run (residuals and logits only)
    interventions: list[str] = field(default_factory=list)  # what was changed, one line each
    sae: SAE | None = None  # a sparse autoencoder read at its hook point (gpt2kit.trace.sae)
    tokenizer: Any = field(default=None, repr=False)  # decodes the token ids views name
    _views: dict = field(default_factory=dict, repr=False)  # computed views, by name and arguments

    def _view(self, fn, *args):
        key = (fn.__name__, *args)
        if key not in self._views:
            self._views[key] = fn(self, *args)
        return self._views[key]

    # --- access ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} was not recorded (recorded: {len(self.tensors)} tensors; "
                           "widen the layers/what selection)") from None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.tensors.items()}

    @property
    def config(self):
        return self.model.config

    @property
    def logits(self) -> torch.Tensor:
        return self.tensors["logits"]

    # --- derived views (gpt2kit.trace.views) ----------------------------------------------------
    def next_token_stats(self) -> dict:
        return self._view(views.next_token_stats, self.top_k)

    def logit_lens(self, k: int = 5) -> dict:
        return self._view(views.logit_lens, k)

    def clean_logit_lens(self, k: int = 5) -> dict | None:
        """With interventions: the logit lens of the unchanged run (layers the interventions did not
        reach share this trace's rows); None without."""
        return None if self.clean is None else self._view(views.clean_lens, k)

    def direct_logit_attribution(self, position: int | None = None, token: int | None = None) -> dict:
        return self._view(views.direct_logit_attribution, position, token)

    def residual_norms(self) -> torch.Tensor:
        return views.residual_norms(self)

    def attention_summary(self) -> dict:
        return self._view(views.attention_summary)

    def sae_features(self, k: int = 5) -> dict | None:
        """The SAE's top features per token, its most active features with their tokens, the
        reconstruction error and fraction of variance explained (None without an SAE)."""
        return None if self.sae is None else self._view(sae_view, self.sae, k)

    def intervention_effect(self, k: int = 5) -> dict | None:
        """Clean vs intervened: per position KL(clean || intervened) and the actual next token's
        log-prob in both; the top-k of both at the last position (None without interventions)."""
        return None if self.clean is None else self._view(views.intervention_effect, k)

    # --- outputs --------------------------------------------------------------------------------
    def to_json(self, *, attention: bool = True) -> dict:
        """The report's data at full precision (views, not the raw tensors: those go to save_npz)."""
        return report_data(self, attention_encoding="list" if attention else None)

    def save_npz(self, path) -> None:
        """Every recorded tensor (float32) plus ids, under the trace's names."""
        arrays = {k: v.detach().float().cpu().numpy() for k, v in self.tensors.items()}
        arrays["ids"] = np.asarray(self.ids, dtype=np.int64)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        data = buf.getvalue()
        atomic_write(path, lambda f: f.write(data))

    def to_html(self) -> str:
        return render_html(self)

    def save_html(self, path) -> None:
        data = self.to_html().encode("utf-8")
        atomic_write(path, lambda f: f.write(data))

    def _repr_html_(self) -> str:
        # An iframe keeps the report's script and styles to itself inside Jupyter or VS Code.
        return (f'<iframe srcdoc="{html.escape(self.to_html(), quote=True)}" '
                'style="width:100%;height:720px;border:1px solid #ccc" sandbox="allow-scripts"></iframe>')

    def __repr__(self) -> str:
        return f"Trace({len(self.ids)} tokens, {len(self.tensors)} tensors, layers={list(self.layers)})"


def _to_ids(tokenizer, text_or_ids, prepend_eot: bool) -> list[int]:
    if isinstance(text_or_ids, str):
        if not text_or_ids:
            raise ValueError("the text is empty: nothing to trace")
        if tokenizer is None:
            raise ValueError("a text needs a tokenizer: pass one, or token ids")
        ids = tokenizer.encode(text_or_ids)
    elif isinstance(text_or_ids, torch.Tensor):
        ids = [int(i) for i in text_or_ids.reshape(-1).tolist()]
    else:
        ids = [int(i) for i in text_or_ids]
    if prepend_eot:
        ids = [tokenizer.eot_token, *ids]
    if not ids:
        raise ValueError("the input has no tokens: nothing to trace")
    return ids


def _decode_tokens(tokenizer, ids: list[int]) -> list[str]:
    return [token_text(tokenizer, i) for i in ids]


def _check_ids(model, ids: list[int]) -> None:
    cfg = model.config
    if len(ids) > cfg.n_ctx:
        raise ValueError(f"the input has {len(ids)} tokens, more than the context n_ctx={cfg.n_ctx}")
    bad = [i for i in ids if not 0 <= i < cfg.n_vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.n_vocab})")


def trace(model, tokenizer, text_or_ids: str | Sequence[int] | torch.Tensor | None, *, top_k: int = 10,
          layers: str | Iterable[int] | None = None, what: str | Iterable[str] | None = None,
          prepend_eot: bool = False, patch_from: str | Sequence[int] | None = None,
          patch_layers: str | Iterable[int] | None = None, answer: int | None = None, foil: int | None = None,
          max_bytes: int = DEFAULT_MAX_BYTES, name: str = "",
          interventions: Sequence[Intervention] | None = None, mean_over: str | Sequence[int] | None = None,
          patch_mode: str = "resid", metric: str | MetricSpec | None = None, pairs=None,
          attribution: bool = False, sae: str | os.PathLike | SAE | None = None) -> Trace:
    """Run one input through the model and record its forward pass.

    text_or_ids: a text (encoded with tokenizer) or token ids. No <|endoftext|> is added unless
        prepend_eot. tokenizer may be None when ids are given (tokens are then shown as <id>).
    layers / what: which blocks and which kinds of tensor to keep (see KINDS, GROUPS); the
        embeddings, the final residual, ln_f and the logits are always kept.
    patch_from: a second input of the same token length, the corrupted run of an activation-
        patching experiment: each (residual layer, position) of this (clean) trace is patched
        into it, and trace.patching says how much of the clean-vs-corrupted logit difference each
        patch restores (gpt2kit.trace.patching). answer / foil: the token ids whose logit difference
        is measured at the last position (default: the clean and the corrupted top-1).
    patch_mode: resid | attn | mlp | heads | heads-pos (gpt2kit.trace.patching). metric:
        `logit-diff:A,B`, `logit:T`, `prob:T` or `loss[:T]` (gpt2kit.trace.metrics; default as above).
    pairs: a JSONL path or a list of {"clean", "corrupt", "answer", "wrong"} dicts: patching
        averaged over these pairs (one token length), instead of patch_from.
    attribution: also estimate every cell by attribution patching (gradient x difference, one
        forward and backward per pair), shown beside the exact grid with their agreement.
    sae: a directory holding an SAE in SAELens's format (or a loaded gpt2kit.trace.sae.SAE),
        encoded at its hook point (which must be recorded): trace.sae_features().
    interventions: changes made while the input runs (gpt2kit.trace.intervene: ablate, steer,
        replace, hook, or Intervention); the trace then records the intervened run, and
        trace.clean holds the unchanged one (residuals and logits) for the side-by-side views.
        mean_over: the text (or ids) whose positions a mean ablation averages over (default: the input).
    """
    if model.training:
        raise ValueError("trace records inference: call model.eval() first (dropout would change the numbers)")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if text_or_ids is None:  # the first pair's clean text
        if pairs is None:
            raise ValueError("nothing to trace: give a text or token ids (or pairs=...)")
        pairs = _load_pairs(pairs, tokenizer, prepend_eot)
        ids = list(pairs[0].clean)
    else:
        ids = _to_ids(tokenizer, text_or_ids, prepend_eot)
    _check_ids(model, ids)
    sel_layers = parse_layers(layers, model.config.n_layer)
    sel_what = parse_what(what)
    itemsize = 4  # views and saved tensors are float32
    need = estimate_bytes(model.config, len(ids), sel_what, sel_layers, itemsize)
    if need > max_bytes:
        raise ValueError(f"recording {len(sel_layers)} blocks x {sorted(sel_what)} for {len(ids)} tokens needs "
                         f"~{need / 2**30:.1f} GiB, over the limit of {max_bytes / 2**30:.1f} GiB; "
                         "select fewer with layers=/--layers or what=/--what")
    if sae is not None and not isinstance(sae, SAE):
        sae = load_sae(sae, model.config.n_layer, model.config.n_head)  # a bad SAE fails before any run
    edits, clean, labels = None, None, []
    if interventions:
        resolved = resolve_all(model, interventions, len(ids))
        ref = ids
        if mean_over is not None:
            ref = _to_ids(tokenizer, mean_over, prepend_eot)
            _check_ids(model, ref)
        edits = edits_for(resolved, capture_run(model, ref, means_needed(resolved))[0])
        every = tuple(range(model.config.n_layer))
        clean = Trace(ids=ids, tokens=_decode_tokens(tokenizer, ids), model=model, layers=every,
                      tensors=run_hooked(model, ids, every, frozenset({"resid"})), what=frozenset({"resid"}),
                      top_k=top_k, name=name, tokenizer=tokenizer)
        labels = [r.iv.label() for r in resolved]
    tensors = run_hooked(model, ids, sel_layers, sel_what, edits)
    tr = Trace(ids=ids, tokens=_decode_tokens(tokenizer, ids), tensors=tensors, model=model, layers=sel_layers,
               what=sel_what, top_k=top_k, name=name, tokenizer=tokenizer, clean=clean, interventions=labels,
               sae=sae)
    if sae is not None:
        sae_activations(tr, sae)  # its hook point recorded, its width the model's
    if patch_from is not None or pairs is not None:
        tr.patching = _patching(model, tokenizer, ids, patch_from, pairs, patch_mode, metric, answer, foil,
                                patch_layers, prepend_eot, attribution)
    return tr


def _load_pairs(pairs, tokenizer, prepend_eot: bool) -> list[Pair]:
    if isinstance(pairs, str | os.PathLike):
        return read_pairs(pairs, tokenizer, prepend_eot)
    if pairs and all(isinstance(p, Pair) for p in pairs):
        return list(pairs)
    return pairs_from_rows(list(enumerate(pairs, 1)), tokenizer, prepend_eot)


def _patching(model, tokenizer, ids, patch_from, pairs, mode, metric, answer, foil, layers, prepend_eot, attribution):
    spec = parse_metric(metric) if isinstance(metric, str) else metric
    if pairs is not None:
        got = _load_pairs(pairs, tokenizer, prepend_eot)
        if spec is None:
            spec = MetricSpec("logit-diff" if got[0].wrong is not None else "prob")
        items = []
        for p in got:
            _check_ids(model, p.clean)
            _check_ids(model, p.corrupt)
            where = f"line {p.line}: "
            items.append((p.clean, p.corrupt, make_metric(spec, tokenizer, p.answer, p.wrong, where)))
    else:
        corrupt = _to_ids(tokenizer, patch_from, prepend_eot)
        _check_ids(model, corrupt)
        if len(corrupt) != len(ids):
            hint = "" if tokenizer is None else \
                newline_hint(tokenizer.decode(ids), tokenizer.decode(corrupt), tokenizer.encode)
            raise ValueError(f"patching needs inputs of equal token length: the text has {len(ids)} tokens, "
                             f"the comparison {len(corrupt)}{hint}")
        mt = default_metric(model, ids, corrupt, answer, foil) if spec is None else \
            make_metric(spec, tokenizer, answer, foil)
        items = [(ids, corrupt, mt)]
    return patch(model, items, mode=mode, layers=layers, tokens=_decode_tokens(tokenizer, items[0][1]),
                 describe=lambda i: token_text(tokenizer, i), attribution=attribution)


__all__ = ["ALIASES", "GROUPS", "KINDS", "Clamp", "Intervention", "Interventions", "Trace", "ablate",
           "attention_from_qk", "clamp", "hook", "parse_layers", "parse_what", "replace", "run_hooked",
           "run_with_hooks", "steer", "trace"]
