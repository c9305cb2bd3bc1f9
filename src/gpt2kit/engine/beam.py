"""Beam search, step for step as transformers' ``generate(num_beams=...)`` (its vectorised
``_beam_search`` of 4.5x/5.x): the same candidates, the same finished-beam bookkeeping, the same
length penalty and early-stopping rules, so the returned sequences, their order and their scores
are transformers'.

:class:`BeamState` is the search itself (no model): given the beams' next-token log-probs it picks
each beam's next token and the beam it continues. The engine feeds it (gpt2kit.engine.beam_rows:
one prompt's beams as rows of the shared batch, each beam a slot, beside other rows), for
gpt2kit.generation.generate and the server alike.

Per step, with the running beams' summed log-probs s (B, nb) and the new log-probs (B, nb, V):
the best K = max(2, 1 + n_stop) * nb continuations over all beams; those ending in a stop token
(or at max_new_tokens) are candidates for the finished set (only the top nb of the K), scored
sum_logprobs / generated_length ** length_penalty; the best nb that did not end keep running.
Where transformers marks "never chosen" with -1e9 and divides in float32, here it is -inf and the
finished scores are float64: with an extreme length_penalty (-5 at 200 tokens, +100 at 8) a real
score falls below -1e9 or length ** length_penalty leaves float32's range, and transformers then
returns empty slots (score -1e9) or scores of -0.0. The running beams' sums are float32 as
transformers' (the same candidates step for step); SamplingSettings keeps max_new_tokens **
|length_penalty| within float64.
early_stopping: True stops a prompt once nb beams have finished; False stops once the best running
beam, at its current length, cannot beat the worst finished one; "never" (with length_penalty > 0)
assumes the running beams reach max_new_tokens, else as False.

Legend: B prompts, nb beams, K candidates, N max new tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpt2kit.sampling import SamplingSettings
    from gpt2kit.tokenizer import Tokenizer

NEG = float("-inf")  # "never chosen" (transformers: -1e9, which real scores can fall below)


@dataclass(frozen=True)
class Beam:
    """One returned sequence: its new tokens (a stop token included), its score and why it ended."""

    tokens: list[int]
    score: float | None  # sum of the tokens' log-probs / len(tokens) ** length_penalty (None: contrastive)
    finish_reason: str  # "stop" | "length"

    def text(self, tokenizer: Tokenizer) -> str:
        """Its text, up to (not including) a stop token."""
        return tokenizer.decode(self.tokens[:-1] if self.finish_reason == "stop" else self.tokens)


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, n, ...) at beams idx (B, k) -> (B, k, ...)."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


class BeamState:
    """The search of B prompts with settings.num_beams beams each (tensors on device), one
    :meth:`step` per generated token; :meth:`results` once a step returns None."""

    def __init__(self, B: int, settings: SamplingSettings, device: torch.device) -> None:
        s, nb, N = settings, settings.num_beams, settings.max_new_tokens
        self.s, self.B, self.nb, self.N, self.cur = s, B, nb, N, 0
        self.stop = torch.tensor(s.stop_token_ids, dtype=torch.long, device=device)
        self.K = max(2, 1 + len(s.stop_token_ids)) * nb
        self.top_nb = torch.arange(self.K, device=device) < nb  # (K,): only these may finish a step
        self.running_seq = torch.full((B, nb, N), -1, dtype=torch.long, device=device)
        self.running_src = torch.full((B, nb, N), -1, dtype=torch.long, device=device)  # flat source beam per step
        self.running_scores = torch.zeros(B, nb, device=device)
        self.running_scores[:, 1:] = NEG  # only the first beam's tokens at the first step
        self.seqs, self.srcs = self.running_seq.clone(), self.running_src.clone()
        self.scores = torch.full((B, nb), NEG, dtype=torch.float64, device=device)  # the finished set's
        self.finished = torch.zeros(B, nb, dtype=torch.bool, device=device)
        self.open_ = torch.ones(B, 1, dtype=torch.bool, device=device)  # the finished set can still improve
        self.offset = torch.arange(B, device=device)[:, None] * nb  # (B, 1)

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The beams' next-token logits (B * nb, V), prompt-major -> the tokens to feed (B * nb,)
        and each new beam's source row (B * nb,: the row whose cache it continues), or None when
        every prompt's search has ended."""
        s, B, nb, K, cur = self.s, self.B, self.nb, self.K, self.cur
        V = logits.shape[-1]
        logp = torch.log_softmax(logits.float(), dim=-1).view(B, nb, V) + self.running_scores[:, :, None]
        top_lp, top_i = torch.topk(logp.view(B, nb * V), K)  # (B, K)
        src = top_i // V
        top_seq, top_src = _gather(self.running_seq, src), _gather(self.running_src, src)  # (B, K, N)
        ids = top_i % V
        top_seq[:, :, cur] = ids
        top_src[:, :, cur] = src + self.offset
        hits = torch.isin(ids, self.stop) | (cur + 1 >= self.N)  # (B, K): ends at a stop token or the length

        # the best nb that go on
        go_on = top_lp.masked_fill(hits, NEG)
        keep = torch.topk(go_on, nb)[1]  # (B, nb)
        self.running_seq, self.running_scores = _gather(top_seq, keep), _gather(go_on, keep)
        self.running_src = _gather(top_src, keep)

        # the finished set: merge the top nb that just ended, keep the best nb
        just = hits & self.top_nb[None, :]
        closed = (self.finished.all(-1, keepdim=True) & (s.early_stopping is True)) | ~self.open_  # (B, 1)
        fin_lp = (top_lp.double() / self._penalty(cur + 1)).masked_fill(closed | ~just, NEG)  # (B, K)
        m_scores = torch.cat([self.scores, fin_lp], dim=1)
        best = torch.topk(m_scores, nb)[1]
        self.seqs = _gather(torch.cat([self.seqs, top_seq], dim=1), best)
        self.srcs = _gather(torch.cat([self.srcs, top_src], dim=1), best)
        self.scores = _gather(m_scores, best)
        self.finished = _gather(torch.cat([self.finished, just], dim=1), best)

        # can the running beams still beat the worst finished one?
        length = self.N if (s.early_stopping == "never" and s.length_penalty > 0) else cur + 1
        best_running = self.running_scores[:, :1].double() / self._penalty(length)
        worst = torch.where(self.finished, self.scores.min(dim=1, keepdim=True)[0], NEG)
        self.open_ = self.open_ & (best_running > worst).any(dim=-1, keepdim=True)
        self.cur = cur + 1
        if not (self.open_.any() and not (self.finished.all() and s.early_stopping is True) and not hits.all()):
            return None
        return self.running_seq[:, :, cur].reshape(-1), self.running_src[:, :, cur].reshape(-1)

    def _penalty(self, length: int) -> float:
        """length ** length_penalty in float64 (finite: SamplingSettings bounds the exponent)."""
        return float(length) ** self.s.length_penalty

    def running(self) -> list[list[int]]:
        """Each running beam's tokens so far (B * nb lists, prompt-major)."""
        return self.running_seq[:, :, :self.cur].reshape(self.B * self.nb, -1).tolist()

    def results(self) -> list[list[Beam]]:
        """For each prompt, its settings.num_return_sequences best beams, best first."""
        s, n = self.s, self.s.num_return_sequences
        lengths = (self.srcs[:, :n] >= 0).sum(-1).tolist()  # (B, n): tokens each returned beam generated
        seqs, scores = self.seqs[:, :n].tolist(), self.scores[:, :n].tolist()
        out = []
        for b in range(len(seqs)):
            beams = []
            for k in range(n):
                toks = seqs[b][k][:lengths[b][k]]
                reason = "stop" if toks and toks[-1] in s.stop_token_ids else "length"
                beams.append(Beam(toks, scores[b][k], reason))
            out.append(beams)
        return out
