"""A preallocated key/value cache, written in place at the current position.

Generation allocates one KVCache for the whole run (prompt + new tokens), so a decode step
writes one column per layer instead of growing tensors with torch.cat. It is the network's one
cache form: the official past/present API (B, L, 2, nh, P, hs) is built on it (from_present,
to_present).

Legend: L layers, B batch, nh heads, M max length, hs head size, T new tokens, P cached tokens.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        # Keys and values side by side, so that a decode step writes both with one copy.
        # Uninitialised: positions >= length are never read, so zeroing would be a wasted pass
        # over memory (600 MB for gpt2 at 8 x 1024 tokens).
        shape = (n_layer, batch_size, 2, n_head, max_len, head_dim)  # (L, B, 2, nh, M, hs)
        self.kv = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0  # P: positions [0, P) hold keys and values

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int) -> KVCache:
        cfg = model.config
        if max_len > cfg.n_ctx:
            raise ValueError(f"KV cache length {max_len} exceeds the model's context n_ctx={cfg.n_ctx}")
        p = model.wpe.weight  # never quantized (wte may hold int8, gpt2kit.quant.modules)
        return cls(cfg.n_layer, batch_size, cfg.n_head, max_len, cfg.head_dim, device=p.device, dtype=p.dtype)

    @classmethod
    def on(cls, kv: torch.Tensor, length: int = 0) -> KVCache:
        """A cache over existing storage kv (L, B, 2, nh, M, hs), holding `length` positions: written
        in place, nothing allocated or copied (gpt2kit.engine's slot pool hands out its slots so)."""
        cache = cls.__new__(cls)
        cache.kv, cache.length = kv, length
        return cache

    @classmethod
    def from_present(cls, present: torch.Tensor, max_len: int) -> KVCache:
        """A cache of max_len positions holding the official-layout present (B, L, 2, nh, P, hs)."""
        B, L, _, nh, P, hs = present.shape
        cache = cls(L, B, nh, max_len, hs, device=present.device, dtype=present.dtype)
        cache.kv[:, :, :, :, :P] = present.transpose(0, 1)  # (L, B, 2, nh, P, hs)
        cache.length = P
        return cache

    plain = True  # a new column is written at `length` alone (engine.StepCache may write elsewhere too)

    @property
    def batch_size(self) -> int:
        return self.kv.shape[1]

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nh, T, hs) at [P, P+T) of `layer`; return views of [0, P+T)."""
        P, T = self.length, k.shape[2]
        self.kv[layer, :, 0, :, P:P + T] = k
        self.kv[layer, :, 1, :, P:P + T] = v
        return self.kv[layer, :, 0, :, :P + T], self.kv[layer, :, 1, :, :P + T]

    def update_kv(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """update() with keys and values stacked, kv (B, 2, nh, T, hs): one copy."""
        P, T = self.length, kv.shape[3]
        self.kv[layer, :, :, :, P:P + T] = kv
        return self.kv[layer, :, 0, :, :P + T], self.kv[layer, :, 1, :, :P + T]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (finished rows stop costing work)."""
        self.kv = self.kv[:, rows]

    def keep(self, rows: list[int]) -> None:
        """select() for rows in ascending order, in place: each kept row moves down into the first
        free row of the same storage and the cache becomes a view of the first len(rows) rows, so
        no new tensor is allocated (a fresh one costs a page fault per 4 KiB on CPU) and rows
        before the first dropped one are not copied at all."""
        assert all(a < b for a, b in zip(rows, rows[1:], strict=False)), "rows must ascend"
        for i, r in enumerate(rows):
            if i != r:  # i < r: row r's data has not been overwritten yet (earlier moves wrote rows < i)
                self.kv[:, i] = self.kv[:, r]
        self.kv = self.kv[:, :len(rows)]

    def to_present(self) -> torch.Tensor:
        """A copy of the cached keys and values in the official layout (B, L, 2, nh, P, hs)."""
        return self.kv[:, :, :, :, :self.length].transpose(0, 1).clone(memory_format=torch.contiguous_format)
