"""The batch's cache: a pool of per-row slots, each row's keys and values in its own slot, in place.

The pool is one tensor (L, S, 2, nh, M, hs): S slots of M columns, made once. A row that joins
takes the lowest free slot and is prefilled into it (columns [0, n), through a KVCache view of that
slot, or, for first chunks in slots apart, FirstChunkCache: nothing copied); each decode step
writes every row's new key and value at that row's own column; a row that leaves frees its slot; a
row whose context fills is prefilled again in its own slot. No join, leave or step copies, moves or
reads another row's keys and values: only :meth:`SlotPool.grow` (an engine without max_batch that
runs out of slots) copies, and counts what it copied in ``copied_bytes``. A beam group's slots
(gpt2kit.engine.beam_rows) copy only among themselves: :meth:`SlotPool.copy` gives each the beam it
continues (and, at the group's join, the one prefill of its prompt), one gather of that group's
slots, counted in ``beam_bytes``. A row whose prompt starts with blocks a prefix cache holds
(gpt2kit.prefix_cache) starts from them: :meth:`SlotPool.fill` writes them at its slot's first
columns, counted in ``cached_bytes``, and only the rest of its prompt is prefilled.

A decode step runs over the slots [0, hi), a view of the pool (hi: one past the highest slot a
decoding row holds). Rows have their own lengths n; P, the step's width, is the longest. A row's
mask is 1 over its own columns [0, n) and at column P, where its new key and value are written for
this step's attention (the spec's forward and decode_step let each query see column P, and count
its position as sum(mask) - 1 = n), and also at its own column n, where the next steps find them.
A row of length P writes once. Slots in [0, hi) without a decoding row (free, or a row still being
prefilled) ride along: their outputs are dropped, and a prefilling row's columns are never written.
A step of T tokens a row (a speculative verify, gpt2kit.engine.speculate) writes them at [P, P + T)
for its rows, and :meth:`SlotPool.settle` then keeps each row's accepted ones, moved to its own
columns [n, n + kept) in its own slot: its length is what it kept.

The columns a row reads masked ([n, P)) must be finite (a masked key's weight 0 times NaN is NaN):
the pool keeps, per slot, how far its columns are known clean (written for this row, or zeroed),
and zeroes the rest of [0, P) before a step. The storage is torch.empty, never zeroed whole, so on
CPU its pages are committed as columns are first written: memory follows the columns rows use,
not S x M.

Legend: L layers, S slots, B rows of a step (hi), nh heads, M columns per slot, P the step's width,
hs head size, T new tokens.
"""

from __future__ import annotations

import torch

from gpt2kit.kv_cache import KVCache


class StepCache:
    """KVCache's interface (update, update_kv, length, batch_size, max_len, kv) for one decode step
    over the pool's slots [0, hi): the new column goes to P for every row (but prefilling ones) and
    to each shorter row's own column; the views returned are columns [0, P + 1) of every slot."""

    def __init__(self, kv: torch.Tensor, P: int, write: torch.Tensor | None,
                 home: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.kv = kv  # (L, B, 2, nh, M, hs): a view of the pool
        self.length = P
        self._write = write  # (b,) the rows written at column P; None: all
        self._home = home  # (rows (k,), their columns (k,)): rows shorter than P; None: none

    @property
    def batch_size(self) -> int:
        return self.kv.shape[1]

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    @property
    def plain(self) -> bool:
        """Whether this step writes every row's new column at P alone, as KVCache does (no row left
        out, none shorter): what a writer of kv that bypasses update_kv may assume (decode.native_step)."""
        return self._write is None and self._home is None

    def update_kv(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write kv (B, 2, nh, T, hs) as described above; return views (B, nh, P + T, hs)."""
        P, T = self.length, kv.shape[3]
        assert T == 1 or self._home is None, "a StepCache of several tokens a row writes them at P only"
        if self._write is None:
            self.kv[layer, :, :, :, P:P + T] = kv
        else:
            self.kv[layer, :, :, :, P:P + T][self._write] = kv[self._write]
        if self._home is not None:
            rows, cols = self._home
            self.kv[layer][rows, :, :, cols] = kv[rows, :, :, 0]  # (k, 2, nh, hs) at each row's own column
        return self.kv[layer, :, 0, :, :P + T], self.kv[layer, :, 1, :, :P + T]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.update_kv(layer, torch.stack((k, v), 1))  # (B, 2, nh, 1, hs)


class FirstChunkCache:
    """KVCache's interface for one prefill forward of first chunks (no cached tokens) into slots
    anywhere in the pool: each row's keys and values are written to columns [0, T) of its own
    slot, and attention takes the new ones (there is nothing before them), so rows whose slots
    are not consecutive (holes left by rows that finished apart) are still one forward."""

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        self.kv = kv  # (L, S, 2, nh, M, hs): the whole pool
        self.slots = slots  # (b,) the rows' slots
        self.length = 0

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (b, nh, T, hs) at columns [0, T) of each row's slot; return them."""
        assert self.length == 0, "a FirstChunkCache takes a first chunk only"
        self.kv[layer][self.slots, :, :, :k.shape[2]] = torch.stack((k, v), 1)  # (b, 2, nh, T, hs)
        return k, v

    def update_kv(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """update() with keys and values stacked, kv (b, 2, nh, T, hs) (the flat prefill's form)."""
        assert self.length == 0, "a FirstChunkCache takes a first chunk only"
        self.kv[layer][self.slots, :, :, :kv.shape[3]] = kv
        return kv[:, 0], kv[:, 1]


class SlotPool:
    """S slots of M columns, one per row; lengths[s] tokens cached in slot s (0 when free)."""

    def __init__(self, n_layer: int, n_slots: int, n_head: int, n_cols: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        shape = (n_layer, n_slots, 2, n_head, n_cols, head_dim)  # (L, S, 2, nh, M, hs)
        self.kv = torch.empty(shape, device=device, dtype=dtype)  # never zeroed whole (module doc)
        self.lengths = [0] * n_slots
        self.copied_bytes = 0  # keys and values copied from one storage to another (grow only)
        self.beam_bytes = 0  # keys and values copied among a beam group's own slots (copy)
        self.cached_bytes = 0  # keys and values written from a prefix cache (fill)
        self._taken = [False] * n_slots
        self._clean = [0] * n_slots  # columns [0, clean) of a slot hold its row's values or zeros

    @classmethod
    def for_model(cls, model: torch.nn.Module, n_slots: int, n_cols: int) -> SlotPool:
        cfg = model.config
        if n_cols > cfg.n_ctx:
            raise ValueError(f"slot length {n_cols} exceeds the model's context n_ctx={cfg.n_ctx}")
        p = model.wpe.weight  # never quantized
        try:
            return cls(cfg.n_layer, n_slots, cfg.n_head, n_cols, cfg.head_dim, device=p.device, dtype=p.dtype)
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError)
            size = cfg.n_layer * n_slots * 2 * cfg.n_embd * n_cols * p.element_size()
            raise ValueError(f"a cache of {n_slots} slots x {n_cols} columns ({size / 2**30:.1f} GiB) cannot be "
                             f"allocated on {p.device}: lower max_batch (--max-batch) ({e})") from e

    @property
    def n_slots(self) -> int:
        return self.kv.shape[1]

    @property
    def n_cols(self) -> int:
        return self.kv.shape[4]

    @property
    def n_free(self) -> int:
        return self._taken.count(False)

    def taken(self, slot: int) -> bool:
        return self._taken[slot]

    def take(self) -> int:
        """The lowest free slot, now held (length 0)."""
        if all(self._taken):
            raise ValueError(f"every one of the {self.n_slots} slots is held")
        slot = self._taken.index(False)
        self._taken[slot] = True
        self.restart(slot)
        return slot

    def release(self, slot: int) -> None:
        """Free a slot in place (its columns are left as they are; nothing else moves)."""
        self._taken[slot] = False
        self.lengths[slot] = 0

    def release_all(self) -> None:
        for s in range(self.n_slots):
            self.release(s)

    def restart(self, slot: int) -> None:
        """Empty a held slot, to prefill its row again from column 0."""
        self.lengths[slot] = self._clean[slot] = 0

    def row_cache(self, slot: int) -> KVCache:
        """A KVCache over one slot (a view: a forward through it writes the slot in place) at its length."""
        return self.rows_cache(slot, 1)

    def rows_cache(self, slot: int, n: int) -> KVCache:
        """A KVCache over slots [slot, slot + n) (a view, written in place), all of slot's length."""
        assert all(self.lengths[s] == self.lengths[slot] for s in range(slot, slot + n))
        return KVCache.on(self.kv[:, slot:slot + n], self.lengths[slot])

    def first_chunk_cache(self, slots: list[int]) -> FirstChunkCache:
        """A cache for one forward of first chunks into these empty slots, anywhere in the pool."""
        assert all(self.lengths[s] == 0 for s in slots)
        return FirstChunkCache(self.kv, torch.tensor(slots, dtype=torch.long, device=self.kv.device))

    def fill(self, slot: int, blocks: list[torch.Tensor]) -> int:
        """Write blocks of keys and values (each (L, 2, nh, b, hs): a prefix cache's) at the columns
        [0, n) of an empty slot, one after another; the slot now holds those n tokens (returned)."""
        assert self.lengths[slot] == 0
        n = 0
        for part in blocks:
            b = part.shape[3]
            self.kv[:, slot, :, :, n:n + b] = part
            n += b
        self.cached_bytes += n * (self.kv[:, 0, :, :, 0].numel() * self.kv.element_size())
        self.prefilled(slot, n)
        return n

    def prefilled(self, slot: int, length: int) -> None:
        """The slot's row now holds `length` tokens (a forward through :meth:`row_cache` wrote them)."""
        self.lengths[slot] = self._clean[slot] = length

    def step_cache(self, slots: list[int], T: int = 1) -> tuple[StepCache, torch.Tensor | None]:
        """The cache and mask (B, P + T) (None: every slot of [0, hi) decodes at length P) of a
        decode step of T tokens a row for the rows in `slots` (ascending); zeroes the masked columns
        not yet clean. With T > 1 (a speculative verify) every row's tokens go to columns [P, P + T),
        and :meth:`settle` moves a shorter row's kept ones home after the step."""
        hi, lengths, clean = slots[-1] + 1, self.lengths, self._clean
        lens = [lengths[s] for s in slots]
        P = max(lens)
        for s in slots:
            if clean[s] < P:
                self.kv[:, s, :, :, clean[s]:P].zero_()
                clean[s] = P
        kv = self.kv if hi == self.kv.shape[1] else self.kv[:, :hi]
        dense = len(slots) == hi  # no slot rides along
        if dense and lens.count(P) == hi:
            return StepCache(kv, P, None, None), None
        device = kv.device
        write = None  # a prefilling row's slot inside [0, hi) is never written
        if not dense:
            decoding = set(slots)
            if any(self._taken[s] and s not in decoding for s in range(hi)):
                write = torch.tensor(slots, device=device)
        short = [(s, n) for s, n in zip(slots, lens, strict=True) if n < P]
        home = None
        if short and T == 1:
            home = (torch.tensor([s for s, _ in short], device=device),
                    torch.tensor([n for _, n in short], device=device))
        n = torch.zeros(hi, dtype=torch.long, device=device)  # (B,): riders own no column
        n[torch.tensor(slots, device=device)] = torch.tensor(lens, device=device)
        mask = torch.arange(P + T, device=device)[None, :] < n[:, None]  # (B, P + T)
        mask[:, P:] = True
        return StepCache(kv, P, write, home), mask

    def advance(self, slots: list[int], P: int) -> None:
        """Every row in `slots` took one token at the step of width P (column P is now clean too)."""
        lengths, clean = self.lengths, self._clean
        for s in slots:
            lengths[s] += 1
            if clean[s] <= P:
                clean[s] = P + 1

    def settle(self, slots: list[int], P: int, T: int, kept: list[int]) -> None:
        """After a step of T tokens a row at columns [P, P + T) (step_cache): each row in `slots` keeps
        its first kept[i] of them, moved to its own columns [n, n + kept[i]) when it was shorter than P
        (its own slot's columns only); its length is then n + kept[i]. The rest are dropped."""
        lengths, clean = self.lengths, self._clean
        for s, k in zip(slots, kept, strict=True):
            n = lengths[s]
            if n < P and k:
                self.kv[:, s, :, :, n:n + k] = self.kv[:, s, :, :, P:P + k].clone()
            lengths[s] = n + k
            clean[s] = max(clean[s], P + T)  # every column up to P + T holds this row's values or zeros

    def hold(self, slot: int) -> None:
        """Hold a given slot (a pool that mirrors another's slots: a draft model's, beside its target's)."""
        self._taken[slot] = True
        self.restart(slot)

    def copy(self, dst: list[int], src: list[int]) -> None:
        """Slot dst[i] takes slot src[i]'s keys, values and length (a beam group's slots, moving
        to the beams they continue): one gather of the sources' columns [0, longest), written to
        the destinations; no other slot is read or written. Sources overwritten here are read first."""
        moves = [(d, s) for d, s in zip(dst, src, strict=True) if d != s]
        if not moves:
            return
        lengths, clean = self.lengths, self._clean
        W = max(lengths[s] for _, s in moves)
        frm = [s for _, s in moves]
        to = torch.tensor([d for d, _ in moves], device=self.kv.device)
        part = self.kv[:, torch.tensor(frm, device=self.kv.device), :, :, :W]  # a copy: (L, k, 2, nh, W, hs)
        self.kv[:, to, :, :, :W] = part
        self.beam_bytes += part.numel() * part.element_size()
        new = [(lengths[s], min(clean[s], W)) for s in frm]  # clean >= length still holds
        for (d, _), (n, c) in zip(moves, new, strict=True):
            lengths[d], clean[d] = n, c

    def grow(self, n_slots: int) -> None:
        """More slots: a new storage, the held slots' clean columns copied over (counted)."""
        L, S, _, nh, M, hs = self.kv.shape
        kv = torch.empty((L, n_slots, 2, nh, M, hs), device=self.kv.device, dtype=self.kv.dtype)
        for s in range(S):
            if self._taken[s] and self._clean[s]:
                part = self.kv[:, s, :, :, :self._clean[s]]
                kv[:, s, :, :, :self._clean[s]] = part
                self.copied_bytes += part.numel() * part.element_size()
        self.kv = kv
        extra = n_slots - S
        self.lengths += [0] * extra
        self._taken += [False] * extra
        self._clean += [0] * extra
