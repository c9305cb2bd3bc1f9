"""Scoring: how likely a text is under the model (per-token log-probabilities, NLL, perplexity).

<|endoftext|> is prepended as context, so every token of the text is scored, the first one too.
Texts longer than the context are scored with a sliding window as in transformers' documented
strided perplexity: windows of n_ctx tokens start every `stride` tokens, and each window scores only
the tokens that no earlier window scored, with up to n_ctx - stride tokens of context before them.

score_tokens_top can take a PrefixCache (gpt2kit.prefix_cache): a sequence that fits in n_ctx
then reuses the keys, values and log-probs of the longest prefix it shares with a sequence scored
before, runs only the rest through the model, and is kept for the next ones. A longer sequence
(the sliding window) bypasses the cache: its windows' contexts differ from any prefix's.

Where the model holds a prepacked copy of its matrices (gpt2kit.decode.packed: a batching server
makes one at start-up), the forwards run on the flat network over those products (decode_tokens:
the same numbers to float rounding, faster); otherwise, and for a model with hooks or in training,
on the model's own forward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import decode_tokens, is_packed, kernels_for
from gpt2kit.kv_cache import KVCache
from gpt2kit.prefix_cache import PrefixCache, Scored


@dataclass(frozen=True)
class ScoreResult:
    tokens: list[int]  # the text's tokens (without the <|endoftext|> context)
    logprobs: list[float]  # logprobs[i] = ln p(tokens[i] | <|endoftext|>, tokens[:i]) within its window
    n_bytes: int  # UTF-8 bytes of the text

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per token, in nats."""
        return -math.fsum(self.logprobs) / len(self.logprobs)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def bits_per_byte(self) -> float:
        return -math.fsum(self.logprobs) / math.log(2) / max(self.n_bytes, 1)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "nll": self.nll, "ppl": self.ppl}


def score_tokens(model, tokens: list[int], *, eot_token: int = EOT_ID, stride: int | None = None,
                 interventions=None) -> list[float]:
    """ln p(tokens[i] | eot, tokens[:i]) for every i, with the strided sliding window. interventions:
    the trace's ablations, steering vectors, replacements and SAE clamps (gpt2kit.trace), applied at
    every position of every window."""
    return _score(model, tokens, eot_token, stride, 0, edits=_edits(model, interventions))[0]


def _edits(model, interventions):
    if not interventions:
        return None
    from gpt2kit.trace.steering import prepare  # the trace wing loads only for a call that intervenes

    return prepare(model, interventions)


def score_tokens_top(model, tokens: list[int], top: int, *, eot_token: int = EOT_ID, stride: int | None = None,
                     cache: PrefixCache | None = None) -> tuple[list[float], list[tuple[tuple[int, float], ...]]]:
    """score_tokens, plus at every position the top `top` (id, log-prob) alternatives under the
    same distribution, from the same forward pass (one per window). With `cache`, eot + tokens, if
    it fits in n_ctx, runs through the model only past the longest prefix it shares with a
    sequence the cache holds (the same numbers, within float rounding), and is kept in it."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an int >= 0, got {top!r}")
    return _score(model, tokens, eot_token, stride, top, cache)


@torch.inference_mode()
def _score(model, tokens: list[int], eot_token: int, stride: int | None, top: int, cache: PrefixCache | None = None,
           edits=None) -> tuple[list[float], list[tuple[tuple[int, float], ...]]]:
    n_ctx = model.config.n_ctx
    stride = n_ctx // 2 if stride is None else stride
    if not 1 <= stride < n_ctx:
        # Each window needs one token of context before the first token it scores.
        raise ValueError(f"stride must be in [1, n_ctx - 1 = {n_ctx - 1}], got {stride}")
    if not tokens:
        raise ValueError("the text has no tokens to score")
    if not 0 <= eot_token < model.config.n_vocab:
        raise ValueError(f"context token {eot_token} is outside the vocabulary [0, {model.config.n_vocab})")
    if cache is not None and len(tokens) < n_ctx:  # eot + tokens fit in one window
        return _score_cached(model, (eot_token, *tokens), top, cache)
    device = model.wte.weight.device
    seq = torch.tensor([eot_token, *tokens], device=device)  # targets are seq[1:]
    out: list[float] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    scored_to = 1  # seq positions < scored_to have been scored (position 0 is the context)
    begin = 0
    while scored_to < len(seq):
        end = min(begin + n_ctx, len(seq))
        window = seq[begin:end]
        with _applied(model, edits, len(window)):
            logits = _forward(model, window, None, present=False)[0].float()  # (W, V): row k -> seq[begin + k + 1]
        logp = torch.log_softmax(logits[:-1], dim=-1)  # (W - 1, V)
        targets = window[1:]
        first = scored_to - begin - 1  # the row that predicts the first unscored position
        picked = logp[first:].gather(1, targets[first:, None])[:, 0]
        out.extend(picked.tolist())
        if top:
            best = logp[first:].topk(min(top, logp.shape[-1]), dim=-1)
            tops.extend(tuple(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(), best.values.tolist(),
                                                                     strict=True))
        scored_to = end
        begin += stride
    return out, tops if top else [() for _ in out]


def _score_cached(model, seq: tuple[int, ...], top: int, cache: PrefixCache
                  ) -> tuple[list[float], list[tuple[tuple[int, float], ...]]]:
    """_score of one window through `cache`: position j's distribution scores seq[j + 1]."""
    n, hit = len(seq), cache.lookup(model, seq, top)
    lps: list[float] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    P, first, past = 0, None, None  # P positions reused; first: position P - 1's log-probs, if kept
    if hit is not None:
        entry, m = hit.entry, hit.shared
        lps, tops = list(entry.logprobs[:m - 1]), [t[:top] for t in entry.tops[:m - 1]]
        if m == n:  # seq is a prefix of what was scored
            cache.reused(n)
            return lps, tops
        # Keys and values of the shared positions are reused; the distribution at position m - 1
        # is kept only at an entry's end, else position m - 1 runs again.
        P = m if m == len(entry.tokens) else m - 1
        first = entry.last_logp if P == m else None
        past = entry.present[:, :, :, :, :P] if P else None  # (1, L, 2, nh, P, hs)
    device = model.wte.weight.device
    run = torch.tensor(seq[P:], device=device)
    logits, present = _forward(model, run, past)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (n - P, V): row k is position P + k
    rows = logp[:-1] if first is None else torch.cat([first[None], logp[:-1]])  # positions len(lps) .. n - 2
    targets = torch.tensor(seq[len(lps) + 1:], device=device)
    lps.extend(rows.gather(1, targets[:, None])[:, 0].tolist())
    if top:
        best = rows.topk(min(top, rows.shape[-1]), dim=-1)
        tops.extend(tuple(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(), best.values.tolist(),
                                                                 strict=True))
    else:
        tops = [() for _ in lps]
    cache.reused(P)
    cache.store(model, Scored(seq, present, logp[-1].clone(), tuple(lps), tuple(tops), top))
    return lps, tops


def _forward(model, ids: torch.Tensor, past: torch.Tensor | None, *, present: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits (T, V) of ids (T,) after `past` (1, L, 2, nh, P, hs) or nothing, and (present=True)
    the present of all P + T positions: on the packed kernels where the model holds a packed copy
    (module doc), else by the model's own forward."""
    k_set = kernels_for(model, 8) if is_packed(model) else None  # None too for hooks or training
    if k_set is None:
        out = model(ids[None], past=past, use_cache=present)
        return out.logits[0], out.present
    P = 0 if past is None else past.shape[4]
    cache = KVCache.from_present(past, P + len(ids)) if past is not None else KVCache.for_model(model, 1, len(ids))
    logits = decode_tokens(model, ids[None], cache, None, k_set)[0]  # (T, V)
    return logits, cache.to_present() if present else None


def _applied(model, edits, n: int):
    if edits is None:
        return contextlib.nullcontext()
    from gpt2kit.trace.steering import applied

    return applied(model, edits, n)


def score_text(model, tokenizer, text: str, *, stride: int | None = None, interventions=None) -> ScoreResult:
    tokens = tokenizer.encode(text)
    logprobs = score_tokens(model, tokens, eot_token=tokenizer.eot_token, stride=stride, interventions=interventions)
    return ScoreResult(tokens, logprobs, len(text.encode("utf-8")))
