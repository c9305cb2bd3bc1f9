"""Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation"), as
transformers 4.x's ``generate(penalty_alpha=..., top_k=...)``: at each step the k most probable
tokens are candidates, each is fed once (the k candidates of a row as k cache rows), and the row
takes the candidate v maximising

    (1 - alpha) * p(v | context) - alpha * max_j cos(h_v, h_j)

h the model's last hidden states (after ln_f), h_j over the row's context (prompt and generated
tokens, padding excluded). The context's hidden states are kept from the step that computed them
(read by a forward hook on ln_f, so nothing is recomputed); the chosen candidate's cache row is
kept, its logits are the next step's.

Legend: B prompts, k candidates, S context length, C n_embd, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.kv_cache import KVCache

if TYPE_CHECKING:
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


@contextlib.contextmanager
def _hidden(model: GPT2, seen: list[torch.Tensor]):
    """ln_f's outputs appended to seen while inside: the hook is held only for this search's own
    forwards, so whatever runs the model between its steps sees it unhooked."""
    hook = model.ln_f.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        yield
    finally:
        hook.remove()


@torch.inference_mode()
def contrastive_steps(model: GPT2, prompts: list[list[int]], settings: SamplingSettings
                      ) -> Generator[None, None, list[list[int]]]:
    """:func:`contrastive_search` one forward at a time: yields after the prefill and after each
    step, returns each prompt's new tokens (the server runs it between its engine's steps,
    gpt2kit.engine.EngineLoop.call_steps, so it never holds up other requests for long)."""
    alpha, k, N = settings.penalty_alpha, min(settings.top_k, model.config.n_vocab), settings.max_new_tokens
    B, T = len(prompts), max(map(len, prompts))
    device = model.wpe.weight.device
    idx = torch.full((B, T), EOT_ID % model.config.n_vocab, dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T + N, dtype=torch.long)  # (B, T + N); new columns set as they are written
    for b, p in enumerate(prompts):
        idx[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):T] = 1
    idx, mask = idx.to(device), mask.to(device)
    seen: list[torch.Tensor] = []
    cache = KVCache.for_model(model, B, T + N)
    with _hidden(model, seen):
        logits = model(idx, attention_mask=mask[:, :T], cache=cache).logits[:, -1]  # (B, V)
    context = seen.pop()  # (B, T, C)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    rows = torch.arange(B, device=device).repeat_interleave(k)  # (B * k,)
    for _ in range(N):
        yield
        probs, ids = logits.float().softmax(-1).topk(k, dim=-1)  # (B, k)
        P = cache.length
        cache.select(rows)  # each row's cache, once per candidate
        mask[:, P] = 1
        with _hidden(model, seen):
            cand_logits = model(ids.reshape(-1, 1), attention_mask=mask[rows, :P + 1], cache=cache).logits[:, -1]
        cand = seen.pop()[:, -1].view(B, k, -1)  # (B, k, C)
        pick = contrastive_scores(probs, context, mask[:, :P], cand, alpha).argmax(-1)  # (B,)
        chosen = torch.arange(B, device=device) * k + pick  # (B,)
        cache.select(chosen)
        logits = cand_logits[chosen]
        context = torch.cat([context, cand[torch.arange(B, device=device), pick][:, None]], dim=1)
        for b, t in enumerate(ids[torch.arange(B, device=device), pick].tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t in settings.stop_token_ids
        if all(done):
            break
    return out
