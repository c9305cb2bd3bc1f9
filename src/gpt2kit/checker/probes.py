"""The two checks beyond one forward pass: a cache (the sequence fed in two pieces must give the
logits of the whole), and each LayerNorm on a low-variance input (where its epsilon shows).

The cache is driven the way the learner's forward signature says: a parameter named like past,
past_key_values or kv_cache gets what the first call returned after the logits; use_cache=True is
passed when there is such a flag; a cache kept inside the model is cleared before and after with its
reset_kv_cache() (or reset_cache(), clear_cache()). Legend: B batch, T tokens, P cached, C n_embd, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gpt2kit.checker.learner as lr
from gpt2kit.checker.diagnose import best_match, ln_candidates
from gpt2kit.checker.stages import StageResult, close, max_abs
from gpt2kit.trace.points import edit_hooks

CACHE_LABEL = "cache: 2 pieces = whole"
EPS_LABEL = "layernorm eps (low-variance input)"


def cache_protocol(model: nn.Module) -> tuple[str | None, str | None]:
    """(the forward's cache parameter, its use_cache flag); (None, None) when it takes no cache."""
    params = lr.forward_params(model)
    return lr.first_named(params, lr.CACHE_PARAMS), "use_cache" if "use_cache" in params else None


def _pieces(model: nn.Module, ids: torch.Tensor, k: int, label: str) -> tuple[torch.Tensor, torch.Tensor] | str:
    past, flag = cache_protocol(model)
    kw = {flag: True} if flag else {}
    lr.reset_cache(model)
    try:
        first, cache = lr.call(model, ids[:, :k], label, **kw)
        if past is not None:
            if cache is None and flag is None:
                return f"the first piece returned no cache to pass as {past}"
            if cache is not None:
                kw[past] = cache
        second, _ = lr.call(model, ids[:, k:], label, **kw)
    except lr.LearnerError as e:
        return f"not checked: {e}"
    finally:
        lr.reset_cache(model)
    return first, second


def cache_check(model: nn.Module, ids: torch.Tensor, whole: torch.Tensor, label: str, tol: float
                ) -> StageResult | None:
    """The learner's logits for ids fed in two pieces against its own for the whole (None: no cache)."""
    if cache_protocol(model) == (None, None):
        return None
    T = ids.shape[1]
    k = T - max(1, T // 3)
    got = _pieces(model, ids, k, label)
    if isinstance(got, str):
        return StageResult(CACHE_LABEL, None, None, note=got)
    first, second = got
    if whole.shape[1] == 1:  # the learner gives the last position only: compare that
        pieces, want = second[:, -1:], whole
    else:
        pieces, want = torch.cat([first, second], dim=1), whole
    if pieces.shape != want.shape:
        return StageResult(CACHE_LABEL, float("nan"), False, note=f"shape {tuple(pieces.shape)}, the whole pass "
                                                                  f"gave {tuple(want.shape)}")
    d = max_abs(pieces.float(), want.float())
    return StageResult(CACHE_LABEL, d, d <= tol, note=f"{k} + {T - k} tokens")


@torch.no_grad()
def cache_diagnosis(model: nn.Module, ref_model, ids: torch.Tensor, label: str, tol: float) -> str:
    """Why the pieces differ: the second piece compared with the reference's second piece done wrong."""
    T = ids.shape[1]
    k = T - max(1, T // 3)
    got = _pieces(model, ids, k, label)
    generic = ("fed in two pieces, the logits differ from the whole: the second piece must see the first's keys "
               "and values, at positions P .. P + T - 1")
    if isinstance(got, str):
        return generic
    first, second = got
    present = ref_model(ids[:, :k], use_cache=True).present
    wpe = ref_model.wpe.weight

    def positions(start: int):  # the reference's position embeddings replaced by those from `start` on
        return edit_hooks(ref_model, [("embed.pos", lambda x: wpe[None, start:start + T - k].expand_as(x))])

    with positions(0):
        unshifted = ref_model(ids[:, k:], past=present).logits
    with positions(k):
        alone_offset = ref_model(ids[:, k:]).logits
    alone = ref_model(ids[:, k:]).logits
    last = second.shape[1] == 1
    wanted = [
        ("positions are not offset by the cache length: the second piece's positions start at 0 again; with "
         "P tokens cached they are P, P + 1, ... (pos = torch.arange(P, P + T))", unshifted),
        ("the cache is not used: the second piece attends to its own tokens only, as if alone", alone_offset),
        ("the cache is not used: the second piece is computed as if alone, at positions from 0", alone),
    ]
    for message, logits in wanted:
        if close(second.float(), logits[:, -1:] if last else logits, tol):
            return message
    if not close(first.float(), ref_model(ids[:, :k]).logits[:, -first.shape[1]:], tol):
        return "the first piece, with an empty cache, already differs from the whole pass: " + generic
    return generic


@torch.no_grad()
def eps_probe(model: nn.Module, points: dict[str, str], state: dict[str, torch.Tensor], tol: float
              ) -> tuple[StageResult | None, str | None]:
    """Every LayerNorm of the learner's on inputs of standard deviation 1e-3 (variance 1e-6, where
    an epsilon of 1e-6 or 1e-12 gives clearly other values than GPT-2's 1e-5), against LayerNorm."""
    norms = [(key, path) for key, path in points.items() if key.endswith(("ln_1", "ln_2")) or key == "ln_f"]
    if not norms:
        return None, None
    C = state["wte.weight"].shape[1]
    g = torch.Generator().manual_seed(0)
    x = 0.5 + 1e-3 * torch.randn(1, 8, C, generator=g)  # (1, 8, C)
    worst, differing = 0.0, []
    for key, path in norms:
        w, b = state[f"{key}.weight"].float(), state[f"{key}.bias"].float()
        try:
            out = model.get_submodule(path)(x)
        except Exception:  # a norm that needs more than x: the forward pass has checked it
            continue
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            continue
        d = max_abs(out.float(), F.layer_norm(x, (C,), w, b, 1e-5))
        worst = max(worst, d)
        if d > tol:
            differing.append((path, out.float(), w, b))
    if not differing:
        return StageResult(EPS_LABEL, worst, True), None
    path, out, w, b = differing[0]  # the first in the forward pass
    why = best_match(ln_candidates(x, w, b), out, tol) or "it differs from LayerNorm(eps=1e-5) on a low-variance input"
    more = f" ({len(differing) - 1} more of your LayerNorms differ here too)" if len(differing) > 1 else ""
    return StageResult(EPS_LABEL, worst, False), f"{path}: {why}{more}"
