"""The speculative engine's cache geometry (gpt2kit.engine.speculative): how many columns its
left-padded caches get, how rows' real columns are packed right-aligned into new ones, and the batch
once prefilled rows join the running ones.

Legend: B rows, b rows of one part, T prompt columns, P cache columns written, M cache size, W the
longest row's real columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpt2kit.kv_cache import KVCache

if TYPE_CHECKING:
    from gpt2kit.engine.rows import Row

ROOM = 128  # cache columns added past the widest row when the cache is (re)built

Batch = tuple[list[KVCache], torch.Tensor, int]  # caches (one per model), mask (B, M), columns written


def cache_columns(W: int, rows: Sequence[Row], n_ctx: int, drafting: bool, lookup: int | None) -> int:
    """Cache columns for rows whose longest holds W: room for every step they may still take (a step
    writes its drafts + 1 columns and gives a row at least one token), at least ROOM, at most n_ctx.
    Columns past those written are never touched: on CPU their pages are not committed, so the room
    costs no memory until it is used, and no repack while it lasts."""
    per_step = [(row.settings.draft_tokens if drafting else lookup or row.settings.prompt_lookup) + 1 for row in rows]
    need = max((k * (row.settings.max_new_tokens - len(row.tokens)) for k, row in zip(per_step, rows, strict=True)),
               default=0)
    return min(n_ctx, W + 1 + max(ROOM, need))


def joined(running: Batch | None, caches: list[KVCache], mask: torch.Tensor, M: int,
           columns: Callable[[int], int]) -> Batch:
    """The batch once prefilled rows (their caches of M columns and mask (b, T), real columns
    right-aligned) join the running ones (None: none run): alone, their caches as they are; else both
    parts' real columns packed into new caches of columns(W) columns."""
    if running is None:
        out = torch.zeros(mask.shape[0], M, dtype=mask.dtype, device=mask.device)  # (b, M)
        out[:, :mask.shape[1]] = mask
        return caches, out, mask.shape[1]
    parts = [(running[0], running[1][:, :running[2]]), (caches, mask)]
    return pack_columns(parts, columns(max(int(m.sum(-1).max()) for _, m in parts)))


def pack_columns(parts: list[tuple[list[KVCache], torch.Tensor]], M: int
                 ) -> tuple[list[KVCache], torch.Tensor, int]:
    """New caches of M columns holding the rows of every part (its caches, one per model, and its
    mask (b, P), 1 where real), each row's real columns right-aligned, zeros before them; returns
    them, their mask (B, M) and their width W (the longest row)."""
    lengths = [n for _, mask in parts for n in mask.sum(-1).tolist()]
    W, B = max(lengths), len(lengths)
    out = torch.zeros(B, M, dtype=torch.long, device=parts[0][1].device)  # (B, M)
    for r, n in enumerate(lengths):
        out[r, W - n:W] = 1
    packed = []
    for i, first in enumerate(parts[0][0]):
        L, _, _, nh, _, hs = first.kv.shape
        new = KVCache(L, B, nh, M, hs, device=first.kv.device, dtype=first.kv.dtype)
        new.kv[:, :, :, :, :W].zero_()  # the padding before short rows; the columns past W are written before read
        b = 0
        for caches, mask in parts:
            real = mask.bool()  # (b, P)
            for r in range(mask.shape[0]):
                cols = real[r].nonzero()[:, 0]
                new.kv[:, b, :, :, W - len(cols):W] = caches[i].kv[:, r, :, :, cols]
                b += 1
        new.length = W
        packed.append(new)
    return packed, out, W
