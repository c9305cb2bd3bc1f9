"""Speculative decoding's two pure parts: where drafts come from (prompt lookup) and which of them
the target model accepts.

Acceptance (Leviathan et al. 2023, Chen et al. 2023): draft token d_i, drawn from the draft's
distribution q_i, is kept with probability min(1, p_i(d_i) / q_i(d_i)) under the target's
distribution p_i; at the first rejection the token is drawn from the residual norm(max(p_i - q_i, 0))
and the rest is dropped; when every draft is kept, one more token is drawn from p_{k+1}. Each
token so produced is distributed exactly as the target's. Prompt lookup's drafts are not drawn
from any distribution: they are point masses (q_i = 1 at d_i), for which the rule reads "keep d_i
with probability p_i(d_i), else draw from p_i with d_i removed" — still exactly the target's
distribution. Greedy decoding needs no randomness: a draft is kept while it is the target's argmax.

Legend: k drafts, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_NGRAM = 3  # prompt lookup matches the row's last 3, then 2, then 1 tokens


def lookup_drafts(seq: Sequence[int], n: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """n tokens that followed the most recent earlier occurrence of seq's last tokens (the longest
    suffix of at most max_ngram tokens that occurs before); [] when none does.

    A match close to the end overlaps the tail, and its continuation runs into the end of seq after
    fewer than n tokens; it is then continued with its own period, as an LZ77 copy is (inside a run
    of spaces the match one token back drafts more of the run, not one space a step)."""
    seq = list(seq)
    L = len(seq)
    for size in range(min(max_ngram, L - 1), 0, -1):
        tail = seq[L - size:]
        for j in range(L - size - 1, -1, -1):  # most recent first; never the tail itself
            if seq[j:j + size] == tail:
                out = seq[j + size:j + size + n]  # short only when it reaches the end: then it is one period
                return out if len(out) == n else (out * n)[:n]
    return []


def accept_drafts(p: torch.Tensor, q: torch.Tensor | None, drafts: Sequence[int],
                  generator: torch.Generator) -> tuple[int, int]:
    """The rejection rule on given distributions: (how many drafts are kept, the token after them).

    p (k + 1, V): the target's probabilities at each draft's position and after the last; q (k, V):
    the draft's, from which drafts[i] was drawn, or None for point-mass drafts (prompt lookup).
    Draws from generator: one uniform per draft examined, one categorical draw for the last token."""
    k = len(drafts)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k)
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if qd > 0 and u * qd < pd:
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0
        else:
            residual = (p[i] - q[i]).clamp_(min=0)
        if not float(residual.sum()) > 0:  # p_i == q_i on the support: then d was kept anyway
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def greedy_accept(argmax: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
    """Greedy acceptance: drafts are kept while they equal the target's argmax at their position
    (argmax has k + 1 entries); the token after them is the argmax where the first one differs."""
    for i, d in enumerate(drafts):
        if argmax[i] != d:
            return i, argmax[i]
    return len(drafts), argmax[len(drafts)]
