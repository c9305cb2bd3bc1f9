"""The batch's cache geometry: rows of different lengths right-aligned in one left-padded KVCache.

Row b's cached tokens are the last lengths[b] columns of [0, P) (P the cache's length); the columns
before them are padding (mask 0, keys and values zeros: finite, so a masked key's weight 0 never
meets 0 * NaN). Positions come from the mask (cumsum - 1), so padding shifts nothing and each row
computes what it would alone. Rows join (their prefilled keys and values added beside the running
ones), leave (dropped from the batch), move (a beam group's slots take the beams they continue:
reorder), and the cache is rebuilt (rows concatenated, columns that are
padding in every row trimmed, room for the next tokens added) when rows join or it fills, or when
its padded width reaches n_ctx (every row fits, but rows that left held the leading columns: the
trim keeps a model's own forward, which checks the width against n_ctx, from refusing them).

Legend: L layers, B rows, b rows of one part, nh heads, P cached length, M cache size, w a part's
width, hs head size.
"""

from __future__ import annotations

import torch

from gpt2kit.kv_cache import KVCache

MAX_ROOM = 256  # columns added past the widest row at a rebuild; rebuilt again if it fills


class BatchCache:
    """One left-padded KVCache for the running rows, and each row's cached length."""

    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.cache: KVCache | None = None
        self.mask: torch.Tensor | None = None  # (B, M) long: 1 real, 0 padding; columns >= P preset to 1
        self.lengths: list[int] = []  # tokens of each row in the cache (its real, unpadded columns)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def clear(self) -> None:
        self.cache = self.mask = None
        self.lengths = []

    def join(self, kv: torch.Tensor, mask: torch.Tensor, lengths: list[int], room: int) -> None:
        """Add rows after the running ones: kv (L, b, 2, nh, w, hs) and mask (b, w) as a prefill
        left them (left-padded among themselves), lengths their real tokens; room: the most tokens
        a row may still feed (the rebuilt cache has min(room, MAX_ROOM) columns to spare, at least 1)."""
        parts = [(kv, mask)]
        if self.lengths:
            parts.insert(0, self._used())
        self.lengths = self.lengths + list(lengths)
        self._rebuild(parts, room)

    def keep(self, keep: list[int]) -> torch.Tensor | None:
        """Keep only batch rows `keep` (in that order); returns their index tensor for the caller's
        own per-row tensors (None: all kept, nothing to select)."""
        if len(keep) == len(self.lengths):
            return None
        self.lengths = [self.lengths[r] for r in keep]
        if not keep:
            self.cache = self.mask = None
            return None
        sel = torch.tensor(keep, device=self.mask.device)
        self.cache.select(sel)
        self.mask = self.mask[sel]
        return sel

    def reorder(self, src: list[int]) -> None:
        """Row r's cached keys, values, mask and length become row src[r]'s (a beam group's slots
        moving to the beams they continue, gpt2kit.engine.beam_rows): one gather and scatter of the
        rows that change; the others are not touched."""
        moved = [r for r, s in enumerate(src) if s != r]
        if not moved:
            return
        dst = torch.tensor(moved, device=self.mask.device)
        frm = torch.tensor([src[r] for r in moved], device=self.mask.device)
        kv = self.cache.kv
        kv[:, dst] = kv[:, frm]  # the right side is a copy, so sources overwritten here are read first
        self.mask[dst] = self.mask[frm]
        self.lengths = [self.lengths[s] for s in src]

    @property
    def full(self) -> bool:
        """No column left for the next token, or the padded width at n_ctx: :meth:`trim` first."""
        return self.cache.length == self.cache.max_len or self.cache.length >= self.n_ctx

    def trim(self, room: int) -> None:
        """Rebuild: the columns some row uses, right-aligned, with room (as in :meth:`join`)."""
        self._rebuild([self._used()], room)

    def step_mask(self) -> torch.Tensor | None:
        """The attention mask of the next one-token step (B, P + 1), or None when no row is padded."""
        P = self.cache.length
        padded = any(n < P for n in self.lengths)
        return self.mask[:, : P + 1] if padded else None

    def advance(self) -> None:
        """Every row's newest token was written at column P (the step moved the cache's length)."""
        self.lengths = [n + 1 for n in self.lengths]

    def _used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache and mask columns some row still uses: [c0, P), leading all-padding cut off."""
        P = self.cache.length
        c0 = P - max(self.lengths)
        return self.cache.kv[:, :, :, :, c0:P], self.mask[:, c0:P]

    def _rebuild(self, parts: list[tuple[torch.Tensor, torch.Tensor]], room: int) -> None:
        """One cache from parts (kv (L, b, 2, nh, w, hs), mask (b, w)), right-aligned, with room
        for the next tokens; padding is zeros."""
        W = max(m.shape[1] for _, m in parts)
        M = W + max(1, min(room, MAX_ROOM))
        L, _, _, nh, _, hs = parts[0][0].shape
        device, B = parts[0][0].device, len(self.lengths)
        cache = KVCache(L, B, nh, M, hs, device=device, dtype=parts[0][0].dtype)
        cache.kv.zero_()
        mask = torch.ones(B, M, dtype=torch.long, device=device)  # (B, M)
        b = 0
        for kv, m in parts:
            n, w = m.shape
            cache.kv[:, b:b + n, :, :, W - w:W] = kv
            mask[b:b + n, : W - w] = 0
            mask[b:b + n, W - w:W] = m
            b += n
        cache.length = W
        self.cache, self.mask = cache, mask
