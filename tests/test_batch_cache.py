"""The slot pool (gpt2kit.engine.SlotPool): every row's keys and values in a slot of its own; rows
join, decode at their own lengths and leave without another row's storage moving or any of its
columns changing; a step's view, mask and positions are each row's own; the engine on it copies
nothing at a join, a leave or a step.

The geometry tests simulate the writes: a prefill writes a row's history through the slot's
KVCache view, a decode step writes through StepCache.update_kv as decode_step does."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, varied_model

from gpt2kit.engine import Engine, SlotPool
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings

L, NH, HS = 2, 2, 3  # layers, heads, head size
GEN = torch.Generator().manual_seed(0)


def _pool(slots: int = 4, cols: int = 16) -> SlotPool:
    return SlotPool(L, slots, NH, cols, HS)


def _join(pool: SlotPool, n: int) -> tuple[int, torch.Tensor]:
    """A row of n tokens prefilled into a free slot (through its KVCache view); (slot, history)."""
    slot = pool.take()
    cache = pool.row_cache(slot)
    history = torch.randn(L, 2, NH, n, HS, generator=GEN)  # (L, 2, nh, n, hs)
    for layer in range(L):
        cache.update_kv(layer, history[layer][None])
    cache.length = n
    pool.prefilled(slot, n)
    return slot, history


def _step(pool: SlotPool, rows: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """One decode step of the rows {slot: history}: new keys/values written as decode_step writes
    them; checks what each row's attention sees; returns the step's mask."""
    slots = sorted(rows)
    cache, mask = pool.step_cache(slots)
    P, B = cache.length, cache.batch_size
    assert B == slots[-1] + 1 and P == max(pool.lengths[s] for s in slots)
    new = torch.randn(B, L, 2, NH, 1, HS, generator=GEN)
    for layer in range(L):
        k, v = cache.update_kv(layer, new[:, layer])  # (B, nh, P + 1, hs)
        for s in slots:
            n = pool.lengths[s]
            seen = torch.arange(P + 1) if mask is None else mask[s].nonzero()[:, 0]
            assert seen.tolist() == list(range(n)) + [P]  # its own columns, then itself at P
            assert torch.equal(k[s, :, seen], torch.cat([rows[s][layer, 0], new[s, layer, 0]], dim=1))
            assert torch.equal(v[s, :, seen], torch.cat([rows[s][layer, 1], new[s, layer, 1]], dim=1))
            if mask is not None:
                assert torch.isfinite(k[s]).all() and torch.isfinite(v[s]).all()  # masked columns too
    if mask is not None:
        assert (mask.sum(-1) - 1)[slots].tolist() == [pool.lengths[s] for s in slots]  # positions
    cache.length = P + 1
    pool.advance(slots, P)
    for s in slots:
        rows[s] = torch.cat([rows[s], new[s]], dim=3)
    return mask


def _check(pool: SlotPool, rows: dict[int, torch.Tensor]) -> None:
    """Each row's columns [0, n) of its own slot are its history, exactly."""
    for s, h in rows.items():
        assert pool.lengths[s] == h.shape[3]
        assert torch.equal(pool.kv[:, s, :, :, :h.shape[3]], h)


def test_rows_join_decode_and_leave_in_their_own_slots_and_nothing_else_moves():
    pool = _pool()
    ptr = pool.kv.data_ptr()
    rows = dict([_join(pool, 3)])
    for _ in range(2):
        assert _step(pool, rows) is None  # one row at its own length: no mask
    _check(pool, rows)
    before = {s: pool.kv[:, s, :, :, :h.shape[3]].clone() for s, h in rows.items()}
    for n in (6, 1):  # longer and shorter than the running row
        s, h = _join(pool, n)
        rows[s] = h
    assert sorted(rows) == [0, 1, 2]
    for s, old in before.items():  # the running row's columns untouched by the joins
        assert torch.equal(pool.kv[:, s, :, :, :old.shape[3]], old)
    for _ in range(3):
        assert _step(pool, rows) is not None  # rows of three lengths: each sees its own
    _check(pool, rows)
    pool.release(1)  # the 9-token row leaves; slots 0 and 2 stay where they are
    left = rows.pop(1)
    before = {s: pool.kv[:, s, :, :, :h.shape[3]].clone() for s, h in rows.items()}
    _step(pool, rows)  # slot 1 rides along, free (its output would be dropped)
    for s, old in before.items():
        assert torch.equal(pool.kv[:, s, :, :, :old.shape[3]], old)
    _check(pool, rows)
    s, h = _join(pool, 2)  # the lowest free slot is taken again
    assert s == 1 and left.shape[3] == 9
    rows[s] = h
    _step(pool, rows)
    _check(pool, rows)
    assert pool.kv.data_ptr() == ptr and pool.copied_bytes == 0


def test_a_prefilling_row_inside_the_step_range_is_never_written():
    """Slot 1 holds a row still being prefilled (8 tokens, more than the step's width) between two
    decoding rows: the steps over slots [0, 3) never write any of its columns."""
    pool = _pool()
    rows = dict([_join(pool, 2)])
    prefilling, _ = _join(pool, 8)
    rows.update([_join(pool, 1)])
    assert sorted(rows) == [0, 2] and prefilling == 1
    snapshot = pool.kv[:, prefilling].clone()
    for _ in range(3):
        assert _step(pool, rows) is not None
    # bit for bit: the slot's columns past its 8 tokens were never written, and uninitialised memory may hold NaN
    assert torch.equal(pool.kv[:, prefilling].view(torch.int32), snapshot.view(torch.int32))
    _check(pool, rows)


def test_the_masked_columns_a_new_row_reads_are_finite_though_its_slot_held_nan():
    pool = _pool(slots=2)
    s, _ = _join(pool, 5)
    pool.kv[:, s].fill_(float("nan"))  # a row whose model gave NaN held this slot
    pool.release(s)
    rows = dict([_join(pool, 2)])  # slot 0 again, 2 tokens, NaN beyond them
    rows.update([_join(pool, 6)])
    assert _step(pool, rows) is not None  # _step checks every column it reads is finite
    _check(pool, rows)


def test_growing_copies_the_held_rows_and_counts_the_bytes():
    pool = _pool(slots=1)
    rows = dict([_join(pool, 4)])
    _step(pool, rows)
    pool.grow(3)
    assert pool.n_slots == 3 and pool.copied_bytes == L * 2 * NH * 5 * HS * 4
    _check(pool, rows)
    rows.update([_join(pool, 2)])
    _step(pool, rows)
    _check(pool, rows)


def test_the_engine_copies_no_other_rows_keys_and_values_when_rows_join_and_leave():
    """A running row's slot: the pool's storage never moves and the row's columns never change
    while rows join (prefilled into their own slots), decode beside it and leave; and every row
    gets the tokens it gets alone."""
    model = varied_model(SMALL, seed=0)
    s = SamplingSettings(temperature=0, max_new_tokens=24, stop_token_ids=())
    short = SamplingSettings(temperature=0, max_new_tokens=3, stop_token_ids=())
    engine = Engine(model, max_batch=3)
    first = engine.new_row([464, 2068, 7586], s)
    engine.submit([first])
    for _ in range(3):
        engine.step()
    pool = engine.pool
    ptr, slot = pool.kv.data_ptr(), 0
    joiners = [engine.new_row(list(range(300, 300 + n)), short) for n in (9, 2, 5)]
    seen = []
    for k in range(12):
        n = pool.lengths[slot]
        mine = pool.kv[:, slot, :, :, :n].clone()
        if k in (1, 2, 6):
            engine.submit([joiners[(1, 2, 6).index(k)]])
        engine.step()
        assert torch.equal(pool.kv[:, slot, :, :, :n], mine)  # nothing of the running row moved
        seen.append(engine.n_running)
    assert engine.pool is pool and pool.kv.data_ptr() == ptr and pool.copied_bytes == 0
    assert max(seen) == 3  # the joiners ran beside it
    while engine.has_work:
        engine.step()
    assert first.tokens == generate(model, [first.prompt], s)[0].tokens
    for row in joiners:
        assert row.tokens == generate(model, [row.prompt], short)[0].tokens


def test_a_beam_groups_copy_moves_only_its_own_slots_and_counts_them_apart():
    """SlotPool.copy (a beam group's reorder): each destination slot takes its source's columns and
    length, sources read before any is overwritten (a swap), the other slots untouched; the bytes
    go to beam_bytes, never copied_bytes."""
    pool = _pool()
    rows = dict([_join(pool, n) for n in (4, 3, 3, 3)])  # slot 0 another row's; slots 1-3 a group's
    other = pool.kv[:, 0].clone()
    pool.copy([1, 2, 3], [2, 1, 1])  # slot 1 takes 2's, slots 2 and 3 take 1's
    moved = {0: rows[0], 1: rows[2], 2: rows[1], 3: rows[1]}
    _check(pool, moved)
    assert torch.equal(pool.kv[:, 0], other)
    assert pool.beam_bytes == 3 * L * 2 * NH * 3 * HS * 4 and pool.copied_bytes == 0
    _step(pool, moved)  # the moved slots decode on from what they took
    _check(pool, moved)


def test_beam_rows_beside_a_row_copy_only_among_their_own_slots():
    """A beam group running beside a greedy row: the row's slot never changes under the group's
    reorders; the group's copies are counted in beam_bytes, copied_bytes stays 0."""
    model = varied_model(SMALL, seed=0)
    s = SamplingSettings(temperature=0, max_new_tokens=16, stop_token_ids=())
    beams = SamplingSettings(max_new_tokens=8, num_beams=3, stop_token_ids=())
    engine = Engine(model, max_batch=4)
    first = engine.new_row([464, 2068, 7586], s)
    engine.submit([first])
    engine.step()
    pool = engine.pool
    engine.submit(engine.new_beam_rows([15496, 11], beams))
    while engine.has_work:
        n = pool.lengths[0]
        mine = pool.kv[:, 0, :, :, :n].clone()
        engine.step()
        assert torch.equal(pool.kv[:, 0, :, :, :n], mine)
    assert pool.beam_bytes > 0 and pool.copied_bytes == 0
    assert first.tokens == generate(model, [first.prompt], s)[0].tokens


def test_a_pool_that_cannot_be_allocated_is_a_value_error_naming_max_batch():
    engine = Engine(varied_model(SMALL, seed=0), max_batch=10**12)  # 30 PB of slots
    with pytest.raises(ValueError, match=r"a cache of 1000000000000 slots x 64 columns .* lower max_batch"):
        engine.reserve()
