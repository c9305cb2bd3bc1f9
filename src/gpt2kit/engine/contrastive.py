"""Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation"), as
transformers 4.x's ``generate(penalty_alpha=..., top_k=...)``: at each step the k most probable
tokens are candidates, each is fed once, and the row takes the candidate v maximising

    (1 - alpha) * p(v | context) - alpha * max_j cos(h_v, h_j)

h the model's last hidden states (after ln_f), h_j over the row's context (prompt and generated
tokens, padding excluded). The context's hidden states are kept from the step that computed them,
so nothing is recomputed.

A prompt is one row of the cache, whatever k: a step feeds the row's k candidates as k tokens of
one forward, each at the row's next position and seeing the row's context and itself only
(:class:`_Candidates` hands attention the cached keys and values with the candidates' appended,
without writing them; the mask keeps the candidates apart), then writes the chosen candidate's keys
and values into the row's next column. So a search holds one cache row per prompt (a server lends
it one slot of its engine's cache per prompt: :func:`contrastive_in_slots`), and the candidates'
keys and values live for their step only.

Legend: B prompts, k candidates, S context length, P cached tokens, T prompt width, C n_embd,
nh heads, hs head size, V vocab.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import attention_mask_for

if TYPE_CHECKING:
    from gpt2kit.engine.rows import Row
    from gpt2kit.model import GPT2
    from gpt2kit.sampling import SamplingSettings


def contrastive_scores(probs: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor,
                       candidates: torch.Tensor, alpha: float) -> torch.Tensor:
    """The contrastive score (B, k) of each candidate: probs (B, k) its probability, candidates
    (B, k, C) its hidden state, context (B, S, C) the row's hidden states, context_mask (B, S) 1
    where real (transformers' _ranking_fast)."""
    ctx = context / context.norm(dim=-1, keepdim=True)  # (B, S, C)
    cand = candidates / candidates.norm(dim=-1, keepdim=True)  # (B, k, C)
    cos = cand @ ctx.transpose(1, 2)  # (B, k, S)
    cos = cos.masked_fill(context_mask[:, None, :] == 0, float("-inf"))
    return (1.0 - alpha) * probs - alpha * cos.amax(dim=-1)


def contrastive_search(model: GPT2, prompts: list[list[int]], settings: SamplingSettings) -> list[list[int]]:
    """Each prompt's new tokens (up to and including a stop token, else max_new_tokens of them)."""
    steps = contrastive_steps(model, prompts, settings)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class _Candidates:
    """The cache's interface to attention (update) for one forward of k candidate tokens per row
    after the P cached ones: attention gets the cached keys and values with the candidates'
    appended (B, nh, P + k, hs); the cache itself is not written until :meth:`commit`."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.length = cache, cache.length
        self.kv = cache.kv  # the storage read (the cache's own: a server's slot)
        self.new: list[torch.Tensor] = []  # per layer: the candidates' (B, 2, nh, k, hs)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.new.append(torch.stack((k, v), 1))
        past = self.kv[layer, :, :, :, :self.length]  # (B, 2, nh, P, hs)
        return torch.cat((past[:, 0], k), 2), torch.cat((past[:, 1], v), 2)  # (B, nh, P + k, hs) each

    def commit(self, pick: torch.Tensor) -> None:
        """Each row's chosen candidate pick (B,) into the cache's column P."""
        P, rows = self.length, torch.arange(len(pick), device=pick.device)
        for layer, kv in enumerate(self.new):
            self.cache.kv[layer, :, :, :, P] = kv[rows, :, :, pick]  # (B, 2, nh, hs)
        self.cache.length = P + 1


def _hidden(model: GPT2, idx: torch.Tensor, pos: torch.Tensor, mask, cache) -> torch.Tensor:
    """The network on idx (B, T) at positions pos through cache, with SDPA's mask: the last hidden
    states (B, T, C), after ln_f (the model's forward, its own modules, without the head)."""
    x = model.drop(model.wte(idx) + model.wpe(pos))  # (B, T, C)
    for i, block in enumerate(model.h):
        x = block(x, mask, cache, i)
    return model.ln_f(x)


def _candidate_mask(context_mask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, 1, k, P + k): candidate j sees its row's real context (context_mask (B, P)) and itself."""
    B, P = context_mask.shape
    own = torch.eye(k, dtype=torch.bool, device=context_mask.device).expand(B, 1, k, k)
    return torch.cat([context_mask.bool()[:, None, None, :].expand(B, 1, k, P), own], dim=-1)


@torch.inference_mode()
def contrastive_steps(model: GPT2, prompts: list[list[int]], settings: SamplingSettings,
                      cache: KVCache | None = None) -> Generator[None, None, list[list[int]]]:
    """:func:`contrastive_search` one forward at a time: yields after the prefill and after each
    step, returns each prompt's new tokens (the server runs it between its engine's steps,
    gpt2kit.engine.EngineLoop.call_steps, so it never holds up other requests for long). cache: an
    empty one of len(prompts) rows and at least prompt width + max_new_tokens - 1 columns (a
    server's slot); default a new one."""
    alpha, k, N = settings.penalty_alpha, min(settings.top_k, model.config.n_vocab), settings.max_new_tokens
    B, T = len(prompts), max(map(len, prompts))
    device = model.wpe.weight.device
    idx = torch.full((B, T), EOT_ID % model.config.n_vocab, dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T + N, dtype=torch.long)  # (B, T + N); new columns set as they are written
    for b, p in enumerate(prompts):
        idx[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):T] = 1
    idx, mask = idx.to(device), mask.to(device)
    if cache is None:
        cache = KVCache.for_model(model, B, T + N - 1)  # the last token is never fed
    pos = (mask[:, :T].cumsum(-1) - 1).clamp_(min=0)  # (B, T), as forward counts them
    context = _hidden(model, idx, pos, attention_mask_for(mask[:, :T], 0, T, device), cache)  # (B, T, C)
    cache.length = T
    logits = model.lm_head(context[:, -1])  # (B, V)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    rows = torch.arange(B, device=device)
    for step in range(N):
        yield
        probs, ids = logits.float().softmax(-1).topk(k, dim=-1)  # (B, k)
        P = cache.length
        cand = _Candidates(cache)
        pos = mask[:, :P].sum(-1, keepdim=True).expand(B, k)  # (B, k): every candidate at its row's next position
        h = _hidden(model, ids, pos, _candidate_mask(mask[:, :P], k), cand)  # (B, k, C)
        pick = contrastive_scores(probs, context, mask[:, :P], h, alpha).argmax(-1)  # (B,)
        for b, t in enumerate(ids[rows, pick].tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t in settings.stop_token_ids
        if all(done) or step == N - 1:
            break
        cand.commit(pick)
        mask[:, P] = 1
        chosen = h[rows, pick]  # (B, C)
        logits = model.lm_head(chosen)
        context = torch.cat([context, chosen[:, None]], dim=1)
    return out


def contrastive_in_slots(model: GPT2, rows: list[Row], settings: SamplingSettings
                         ) -> Generator[None, None, list[list[int]]]:
    """:func:`contrastive_steps` for each row's prompt in the slot its lease holds (rows made by
    Engine.new_lease and submitted to that engine), the prompts' searches stepped together, each
    from the step after its row has joined: yields once per step (EngineLoop.call_steps), returns
    each prompt's new tokens. A row whose search has ended is cancelled (its slot goes back at the
    engine's next step), and so is every row when the generator is closed. A slot the engine took
    back (Engine.reset, after a failed step) is a RuntimeError."""
    runs: dict[int, Generator] = {}
    found: dict[int, list[int]] = {}
    try:
        while True:
            for i, row in enumerate(rows):
                if i in found or (i not in runs and row.lease.cache is None and not row.lease.granted):
                    continue  # ended, or still waiting for a slot
                if row.lease.cache is None:
                    raise RuntimeError("the engine took back the slot of a contrastive search (a step failed)")
                if i not in runs:
                    runs[i] = contrastive_steps(model, [row.prompt], settings, row.lease.cache)
                try:
                    next(runs[i])
                except StopIteration as end:
                    found[i] = end.value[0]
                    row.cancelled = True
            if len(found) == len(rows):
                return [found[i] for i in range(len(rows))]
            yield
    finally:
        for row in rows:
            row.cancelled = True
