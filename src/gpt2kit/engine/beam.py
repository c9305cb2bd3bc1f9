"""Beam search, step for step as transformers' ``generate(num_beams=...)`` (its vectorised
``_beam_search`` of 4.5x/5.x): the same candidates, the same finished-beam bookkeeping, the same
length penalty and early-stopping rules, so the returned sequences, their order and their scores
are transformers'.

Beams are rows: a batch of prompts with nb beams each is one left-padded KVCache of B * nb rows
(positions from the mask, as everywhere in the engine); each step the rows are reordered to the
surviving beams by one index_select of the cache, then fed their new tokens in one decode step.

Per step, with the running beams' summed log-probs s (B, nb) and the new log-probs (B, nb, V):
the best K = max(2, 1 + n_stop) * nb continuations over all beams; those ending in a stop token
(or at max_new_tokens) are candidates for the finished set (only the top nb of the K), scored
sum_logprobs / generated_length ** length_penalty; the best nb that did not end keep running.
early_stopping: True stops a prompt once nb beams have finished; False stops once the best running
beam, at its current length, cannot beat the worst finished one; "never" (with length_penalty > 0)
assumes the running beams reach max_new_tokens, else as False.

Legend: B prompts, nb beams, K candidates, N max new tokens, T prompt width, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.decode import decode_step, kernels_for, prefill
from gpt2kit.kv_cache import KVCache

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.sampling import SamplingSettings

NEG = -1.0e9  # transformers' "never chosen" score


@dataclass(frozen=True)
class Beam:
    """One returned sequence: its new tokens (a stop token included), its score and why it ended."""

    tokens: list[int]
    score: float | None  # sum of the tokens' log-probs / len(tokens) ** length_penalty (None: contrastive)
    finish_reason: str  # "stop" | "length"


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, n, ...) at beams idx (B, k) -> (B, k, ...)."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


@torch.inference_mode()
def beam_search(model: GPT2, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Beam]]:
    """For each prompt (valid token ids), its settings.num_return_sequences best beams, best first."""
    s, nb, N = settings, settings.num_beams, settings.max_new_tokens
    B, T = len(prompts), max(map(len, prompts))
    device = model.wpe.weight.device
    stop = torch.tensor(s.stop_token_ids, dtype=torch.long, device=device)
    K = max(2, 1 + len(s.stop_token_ids)) * nb
    top_nb = torch.arange(K, device=device) < nb  # (K,): only these may finish a step

    idx = torch.full((B, T), EOT_ID % model.config.n_vocab, dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T + N, dtype=torch.long)  # (B, T + N): new columns preset to 1 below
    for b, p in enumerate(prompts):
        idx[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    padded = any(len(p) < T for p in prompts)
    idx, mask = idx.to(device), mask.to(device)
    cache = KVCache.for_model(model, B, T + N)
    logits = prefill(model, idx, mask[:, :T] if padded else None, cache)  # (B, V)
    rows = torch.arange(B, device=device).repeat_interleave(nb)  # (B * nb,): every beam starts from its prompt
    cache.select(rows)
    mask, logits = mask[rows], logits[rows]  # (B * nb, T + N), (B * nb, V)
    kernels = kernels_for(model, B * nb, s.pack_weights)

    running_seq = torch.full((B, nb, N), -1, dtype=torch.long, device=device)
    running_src = torch.full((B, nb, N), -1, dtype=torch.long, device=device)  # flat source beam per step
    running_scores = torch.zeros(B, nb, device=device)
    running_scores[:, 1:] = NEG  # only the first beam's tokens at the first step
    seqs, srcs = running_seq.clone(), running_src.clone()
    scores = torch.full((B, nb), NEG, device=device)
    finished = torch.zeros(B, nb, dtype=torch.bool, device=device)
    open_ = torch.ones(B, 1, dtype=torch.bool, device=device)  # the finished set can still improve
    offset = torch.arange(B, device=device)[:, None] * nb  # (B, 1)
    for cur in range(N):
        V = logits.shape[-1]
        logp = torch.log_softmax(logits.float(), dim=-1).view(B, nb, V) + running_scores[:, :, None]
        top_lp, top_i = torch.topk(logp.view(B, nb * V), K)  # (B, K)
        src = top_i // V
        top_seq, top_src = _gather(running_seq, src), _gather(running_src, src)  # (B, K, N)
        ids = top_i % V
        top_seq[:, :, cur] = ids
        top_src[:, :, cur] = src + offset
        hits = torch.isin(ids, stop) | (cur + 1 >= N)  # (B, K): ends at a stop token or the length

        # the best nb that go on
        go_on = top_lp + hits.float() * NEG
        keep = torch.topk(go_on, nb)[1]  # (B, nb)
        running_seq, running_scores, running_src = _gather(top_seq, keep), _gather(go_on, keep), _gather(top_src, keep)

        # the finished set: merge the top nb that just ended, keep the best nb
        just = hits & top_nb[None, :]
        fin_lp = top_lp / ((cur + 1) ** s.length_penalty)
        fin_lp = fin_lp + (finished.all(-1, keepdim=True) & (s.early_stopping is True)).float() * NEG
        fin_lp = fin_lp + (~open_).float() * NEG
        fin_lp = fin_lp + (~just).float() * NEG
        m_scores = torch.cat([scores, fin_lp], dim=1)
        best = torch.topk(m_scores, nb)[1]
        seqs = _gather(torch.cat([seqs, top_seq], dim=1), best)
        srcs = _gather(torch.cat([srcs, top_src], dim=1), best)
        scores = _gather(m_scores, best)
        finished = _gather(torch.cat([finished, just], dim=1), best)

        # can the running beams still beat the worst finished one?
        length = N if (s.early_stopping == "never" and s.length_penalty > 0) else cur + 1
        best_running = running_scores[:, :1] / (length ** s.length_penalty)
        worst = torch.where(finished, scores.min(dim=1, keepdim=True)[0], NEG)
        open_ = open_ & (best_running > worst).any(dim=-1, keepdim=True)
        if not (open_.any() and not (finished.all() and s.early_stopping is True) and not hits.all()):
            break
        beam_rows = running_src[:, :, cur].reshape(-1)  # (B * nb,): each new beam's source row
        cache.select(beam_rows)  # the one reorder of the step; a prompt's beams share its mask
        tok = running_seq[:, :, cur].reshape(-1, 1)  # (B * nb, 1)
        P = cache.length
        logits = decode_step(model, tok, cache, mask[:, :P + 1] if padded else None, kernels)
    return _results(seqs, srcs, scores, s)


def _results(seqs: torch.Tensor, srcs: torch.Tensor, scores: torch.Tensor, s: SamplingSettings) -> list[list[Beam]]:
    n = s.num_return_sequences
    lengths = (srcs[:, :n] >= 0).sum(-1).tolist()  # (B, n): tokens each returned beam generated
    seqs, scores = seqs[:, :n].tolist(), scores[:, :n].tolist()
    out = []
    for b in range(len(seqs)):
        beams = []
        for k in range(n):
            toks = seqs[b][k][:lengths[b][k]]
            reason = "stop" if toks and toks[-1] in s.stop_token_ids else "length"
            beams.append(Beam(toks, scores[b][k], reason))
        out.append(beams)
    return out
