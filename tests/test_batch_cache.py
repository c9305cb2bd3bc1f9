"""The batch cache's geometry (gpt2kit.engine.BatchCache): rows that join, leave, and are trimmed
keep every cached key and value and every position exactly, right-aligned over left padding.

Each row's history is random keys/values, one column per token; a decode step is simulated by
writing one column at the cache's length, as decode_step does."""

from __future__ import annotations

import torch

from gpt2kit.engine import BatchCache

L, NH, HS = 2, 2, 3  # layers, heads, head size
GEN = torch.Generator().manual_seed(0)


def _history(n: int) -> torch.Tensor:
    return torch.randn(L, 2, NH, n, HS, generator=GEN)  # one row's keys and values (L, 2, nh, n, hs)


def _prefill(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """What a prefill of these rows leaves: kv (L, b, 2, nh, w, hs) left-padded (the padding
    columns hold whatever the padding tokens computed: here random), mask (b, w), lengths."""
    w = max(h.shape[3] for h in rows)
    kv = torch.randn(L, len(rows), 2, NH, w, HS, generator=GEN)
    mask = torch.ones(len(rows), w, dtype=torch.long)
    for b, h in enumerate(rows):
        n = h.shape[3]
        kv[:, b, :, :, w - n:] = h
        mask[b, : w - n] = 0
    return kv, mask, [h.shape[3] for h in rows]


def _check(bc: BatchCache, history: list[torch.Tensor]) -> None:
    """Every row's keys and values are its history, in its last columns of [0, P), at positions
    0..n-1 (cumsum of the mask - 1); the columns before them are masked."""
    P = bc.cache.length
    assert bc.lengths == [h.shape[3] for h in history] and bc.batch_size == len(history)
    assert bc.cache.batch_size == len(history) and bc.mask.shape[0] == len(history)
    for b, h in enumerate(history):
        n = h.shape[3]
        m = bc.mask[b, :P]
        assert m[: P - n].eq(0).all() and m[P - n:].eq(1).all()
        assert (m.cumsum(0) - 1)[P - n:].tolist() == list(range(n))
        assert torch.equal(bc.cache.kv[:, b, :, :, P - n:P], h)


def _step(bc: BatchCache, history: list[torch.Tensor], room: int = 4) -> None:
    """One decode step: trim if full, then each row's new key/value written at column P."""
    if bc.full:
        bc.trim(room)
    P, B = bc.cache.length, bc.batch_size
    mask = bc.step_mask()
    if any(h.shape[3] < P for h in history):
        assert mask.shape == (B, P + 1) and mask[:, P].eq(1).all() and torch.equal(mask[:, :P], bc.mask[:, :P])
    else:
        assert mask is None
    new = torch.randn(L, B, 2, NH, 1, HS, generator=GEN)
    bc.cache.kv[:, :, :, :, P:P + 1] = new
    bc.cache.length = P + 1
    bc.advance()
    for b in range(B):
        history[b] = torch.cat([history[b], new[:, b]], dim=3)


def test_join_leave_and_trim_keep_each_rows_keys_values_and_positions():
    bc = BatchCache(n_ctx=64)
    history = [_history(3)]
    bc.join(*_prefill(history), room=5)
    _check(bc, history)
    assert bc.cache.max_len == 3 + 5
    for _ in range(2):
        _step(bc, history)
        _check(bc, history)
    joining = [_history(6), _history(1)]  # left-padded among themselves, then beside the running row
    bc.join(*_prefill(joining), room=4)
    history += joining
    _check(bc, history)
    # The running row (5 tokens) right-aligned to width 6: its new padding column is zeros (finite:
    # a masked key's weight 0 never meets 0 * NaN).
    assert bc.cache.kv[:, 0, :, :, 0].eq(0).all()
    assert bc.cache.length == 6  # the widest row: no column that every row pads
    for _ in range(3):
        _step(bc, history)
        _check(bc, history)
    sel = bc.keep([0, 2])  # the 6-token row leaves
    assert sel.tolist() == [0, 2]
    history = [history[0], history[2]]
    _check(bc, history)
    bc.trim(room=2)  # its leading columns were padding in every row that is left
    _check(bc, history)
    assert bc.cache.length == max(h.shape[3] for h in history) and bc.cache.max_len == bc.cache.length + 2
    assert bc.keep([0, 1]) is None  # all kept: nothing to select
    assert bc.keep([1]).tolist() == [1]
    history = [history[1]]
    _check(bc, history)
    assert bc.step_mask() is not None  # the row that left held columns this one pads
    bc.trim(room=1)
    _check(bc, history)
    assert bc.step_mask() is None  # one row, unpadded


def test_a_full_cache_is_rebuilt_with_room_and_rows_unchanged():
    bc = BatchCache(n_ctx=64)
    history = [_history(2), _history(5)]
    bc.join(*_prefill(history), room=1)
    assert bc.cache.max_len == 6
    sizes = []
    for _ in range(7):  # full after the first step, then every third (room 3)
        _step(bc, history, room=3)
        _check(bc, history)
        sizes.append(bc.cache.max_len)
    assert sizes == [6, 9, 9, 9, 12, 12, 12]


def test_the_padded_width_is_trimmed_at_n_ctx_though_every_row_fits():
    bc = BatchCache(n_ctx=10)
    long, short = _history(9), _history(1)
    bc.join(*_prefill([long, short]), room=256)
    history = [long, short]
    _step(bc, history)  # width 10 = n_ctx
    assert bc.full and bc.cache.length == 10
    bc.keep([1])  # the long row leaves; the short one holds 2 tokens under 8 columns of padding
    history = [history[1]]
    _step(bc, history)  # trimmed before it is fed: the width stays within n_ctx
    _check(bc, history)
    assert bc.cache.length == 3


def test_every_row_leaving_empties_it_and_it_takes_new_rows():
    bc = BatchCache(n_ctx=64)
    bc.join(*_prefill([_history(4)]), room=3)
    assert bc.keep([]) is None and bc.batch_size == 0 and bc.cache is None
    history = [_history(2)]
    bc.join(*_prefill(history), room=3)
    _check(bc, history)
    bc.clear()
    assert bc.batch_size == 0 and bc.cache is None and bc.mask is None
