"""Output processing: what a row's new token makes of its text (gpt2kit.engine.text: whole
characters, stop strings held back until they are known not to be one), whether it finishes the
row, and the log-probs reported for it. Scheduling (gpt2kit.engine.scheduler) calls these; it
computes none of it itself.

Legend: B rows in the batch, R rows that asked for log-probs, V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpt2kit.engine.rows import Row


def advance(row: Row, t: int) -> tuple[str, str | None]:
    """The text token t (already appended to row.tokens) makes safe to emit, and the row's finish
    reason (None: it goes on)."""
    reason = "stop" if t in row.settings.stop_token_ids else None  # not in the row's text
    piece, hit = "", False
    if row.text is not None and reason is None:
        piece, hit = row.text.feed(t)
        reason = "stop" if hit else None
    if reason is None and row.sampler is not None and row.sampler.done:  # a complete structured output
        reason = "stop"
    if reason is None and len(row.tokens) >= row.settings.max_new_tokens:
        reason = "length"
    if row.text is not None and reason is not None and not hit:
        piece += row.text.finish()  # after a stop string the rest is dropped; else release it
    return piece, reason


def token_logprobs(logits: torch.Tensor, tok: torch.Tensor, rows: list[Row]
                   ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """Batch row -> (log-prob of its token tok[r], top N (id, log-prob)) for the rows that asked
    (Row.logprobs = N), under the raw distribution: log_softmax of logits (B, V), before any warper;
    a row with a structured-output constraint, under the constrained one (the raw logits with the
    tokens its grammar bans at this step removed). Called before the rows observe tok."""
    want = [r for r, row in enumerate(rows) if row.logprobs is not None]
    if not want:
        return {}
    sel = torch.tensor(want, device=logits.device)
    picked = logits[sel].float()  # (R, V)
    for i, r in enumerate(want):
        banned = rows[r].sampler.structured_disallowed() if rows[r].sampler is not None else None
        if banned is not None:
            picked[i:i + 1] = picked[i:i + 1].masked_fill(banned, float("-inf"))
    logp = torch.log_softmax(picked, dim=-1)  # (R, V)
    chosen = logp.gather(1, tok[sel][:, None])[:, 0].tolist()
    n = max(rows[r].logprobs for r in want)
    ids = vals = [[] for _ in want]
    if n:
        top = logp.topk(min(n, logp.shape[-1]), dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
    out = {}
    for i, r in enumerate(want):
        k = rows[r].logprobs
        out[r] = (chosen[i], tuple(zip(ids[i][:k], vals[i][:k], strict=True)))
    return out
