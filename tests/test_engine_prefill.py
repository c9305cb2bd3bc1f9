"""Chunked prefill (gpt2kit.engine.prefill): a long prompt joins in chunks of prefill_chunk tokens,
one step's chunks at most prefill_chunk tokens in all, while the running rows get a token every
step; every row's tokens are the ones it gets alone. A hook on wte records each forward's shape (a
hooked model runs its own forward, so the decode steps go through the spec with the slot cache)."""

from __future__ import annotations

import pytest
from helpers import SMALL, varied_model

from gpt2kit.decode import decode_tokens
from gpt2kit.engine import Engine
from gpt2kit.engine.scheduler import DEFAULT_PREFILL_CHUNK
from gpt2kit.generation import generate
from gpt2kit.sampling import SamplingSettings
from gpt2kit.serve.engine import serve_engine
from gpt2kit.serve.options import ServeOptions

RUN = SamplingSettings(temperature=0, max_new_tokens=30, stop_token_ids=())
JOIN = SamplingSettings(max_new_tokens=5, seed=7, top_k=40, stop_token_ids=())


def _recorded():
    model = varied_model(SMALL, seed=0)
    shapes = []
    model.wte.register_forward_hook(lambda mod, inp, out: shapes.append(tuple(inp[0].shape)))
    return model, shapes


def test_running_rows_get_a_token_every_step_while_a_long_prompt_joins():
    model, shapes = _recorded()
    engine = Engine(model, prefill_chunk=4)
    running = engine.new_row([464, 2068, 7586], RUN)
    engine.submit([running])
    engine.step()
    engine.step()
    long_prompt, short_prompt = list(range(300, 330)), [11, 12, 13]  # 30 tokens: chunks 4 x 7 + 2
    long_row = engine.new_row(long_prompt, JOIN, seed=7)
    short_row = engine.new_row(short_prompt, JOIN, seed=7)
    engine.submit([long_row, short_row])
    steps = 0
    shapes.clear()
    while not long_row.tokens:
        events = engine.step()
        steps += 1
        assert [e.row for e in events].count(running) == 1  # a token for the running row, every step
    assert steps == 8 and len(running.tokens) == 2 + 8
    assert len([s for s in shapes if s[1] == 1]) == steps  # one decode forward a step
    # each chunk a forward of its own row; the short row waits, the budget of 4 spent by the long one
    assert [s for s in shapes if s[1] > 1] == [(1, 4)] * 7 + [(1, 2)]
    assert not short_row.tokens
    engine.step()
    assert short_row.tokens  # its 3 tokens: one chunk at the next step
    while engine.has_work:
        engine.step()
    assert running.tokens == generate(model, [running.prompt], RUN)[0].tokens
    assert long_row.tokens == generate(model, [long_prompt], JOIN)[0].tokens
    assert short_row.tokens == generate(model, [short_prompt], JOIN)[0].tokens


def _chunks_per_step(engine, shapes, rows):
    """The prefill chunks' lengths of each step until rows[-1] has its first token."""
    per_step = []
    while not rows[-1].tokens:
        shapes.clear()
        engine.step()
        per_step.append([s[1] for s in shapes if s[1] > 1])  # the chunks (the decode steps: 1 token)
    return per_step


def test_a_steps_chunks_share_one_budget_and_each_rows_chunks_are_its_own():
    model, shapes = _recorded()
    engine = Engine(model, prefill_chunk=4)
    running = engine.new_row([464, 2068, 7586], RUN)  # decoding while the others join: the budget is a chunk
    engine.submit([running])
    engine.step()
    rows = [engine.new_row(list(range(200, 206)), RUN), engine.new_row([5, 6, 7], RUN)]
    engine.submit(rows)
    assert _chunks_per_step(engine, shapes, rows) == [[4], [2], [3]]  # 6 as 4 + 2; 2 + 3 > 4: the 3 wait
    while engine.has_work:
        engine.step()
    for row in [running, *rows]:
        assert row.tokens == generate(model, [row.prompt], RUN)[0].tokens


def test_an_idle_engine_prefills_every_joining_rows_chunk_in_one_step():
    model, shapes = _recorded()
    engine = Engine(model, max_batch=4, prefill_chunk=4)  # nothing decodes: nothing to protect
    rows = [engine.new_row(list(range(200, 206)), RUN), engine.new_row([5, 6, 7], RUN),
            engine.new_row([8, 9, 10, 11], RUN)]
    engine.submit(rows)
    engine.step()  # each row's first chunk, at cache length 0 in slots 0-2: one forward
    assert [s for s in shapes if s[1] > 1] == [(3, 4)]
    assert [len(r.tokens) for r in rows] == [0, 1, 1]  # the 6-token row has 2 to go (its own chunks: 4 + 2)
    shapes.clear()
    engine.step()  # rows decode now: the budget is one chunk again
    assert [s for s in shapes if s[1] > 1] == [(1, 2)]
    while engine.has_work:
        engine.step()
    for row in rows:
        assert row.tokens == generate(model, [row.prompt], RUN)[0].tokens
    capped = Engine(model, prefill_chunk=4, prefill_idle_budget=4)  # the budget of a decoding engine
    rows = [capped.new_row(list(range(200, 206)), RUN), capped.new_row([5, 6, 7], RUN)]
    capped.submit(rows)
    assert _chunks_per_step(capped, shapes, rows) == [[4], [2], [3]]
    budget7 = Engine(model, prefill_chunk=4, prefill_idle_budget=7)  # 4 + 3 fit; a third chunk would not
    rows = [budget7.new_row(list(range(200, 206)), RUN), budget7.new_row([5, 6, 7], RUN),
            budget7.new_row([1, 2], RUN)]
    budget7.submit(rows)
    assert _chunks_per_step(budget7, shapes, rows) == [[4], [2, 2]]
    while budget7.has_work:
        budget7.step()
    for row in rows:
        assert row.tokens == generate(model, [row.prompt], RUN)[0].tokens


def test_prefill_chunk_and_max_len_are_checked_and_reach_the_servers_engine():
    model = varied_model(SMALL, seed=0)
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1, got 0"):
        Engine(model, prefill_chunk=0)
    with pytest.raises(ValueError, match=r"max_len must be an integer in \[1, n_ctx=64\], got 65"):
        Engine(model, max_len=65)
    engine = Engine(model, max_len=10)
    with pytest.raises(ValueError, match="needs 12 cache columns; this engine's slots hold max_len=10"):
        engine.new_row([1, 2, 3], SamplingSettings(temperature=0, max_new_tokens=10))
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1, got 0"):
        ServeOptions(prefill_chunk=0)
    assert ServeOptions().prefill_chunk == DEFAULT_PREFILL_CHUNK
    assert serve_engine(model, None, max_batch=2, pack_weights=None, prefill_chunk=7).prefill_chunk == 7
    with pytest.raises(ValueError, match="prefill_idle_budget must be an integer >= prefill_chunk=8, got 7"):
        Engine(model, prefill_chunk=8, prefill_idle_budget=7)
    with pytest.raises(ValueError, match="ServeOptions.prefill_idle_budget must be an integer >= prefill_chunk=128"):
        ServeOptions(prefill_idle_budget=100)
    assert ServeOptions().prefill_idle_budget is None
    assert serve_engine(model, None, max_batch=2, pack_weights=None, prefill_chunk=7,
                        prefill_idle_budget=20).prefill_idle_budget == 20


def test_a_row_cancelled_mid_prefill_frees_its_slot_and_the_others_go_on():
    model = varied_model(SMALL, seed=0)
    engine = Engine(model, max_batch=2, prefill_chunk=4)
    running = engine.new_row([464, 2068, 7586], RUN)
    engine.submit([running])
    engine.step()
    long_row = engine.new_row(list(range(300, 330)), JOIN, seed=7)
    waiting = engine.new_row([11, 12, 13], JOIN, seed=7)
    engine.submit([long_row, waiting])
    engine.step()
    engine.step()
    assert engine.n_prefilling == 1 and engine.n_running == 2 and engine.n_waiting == 1  # both slots held
    engine.cancel(long_row)
    engine.step()  # its slot is free at once: the waiting row takes it and joins in one chunk
    assert not long_row.tokens and engine.pool.taken(1) and waiting.tokens
    while engine.has_work:
        engine.step()
    assert running.tokens == generate(model, [running.prompt], RUN)[0].tokens
    assert waiting.tokens == generate(model, [waiting.prompt], JOIN)[0].tokens


def test_a_burst_of_prompts_is_one_forward_and_each_row_gets_its_own_tokens():
    model, shapes = _recorded()
    engine = Engine(model, prefill_chunk=16)
    prompts = [[5, 6, 7], [8, 9, 10, 20, 21, 22], [11, 12, 13, 14], [15, 16]]  # slots 0-3
    rows = [engine.new_row(p, RUN) for p in prompts]
    engine.submit(rows)
    engine.step()
    assert [s for s in shapes if s[1] > 1] == [(4, 6)]  # one forward, right-padded to the longest
    while engine.has_work:
        engine.step()
    for row in rows:
        assert row.tokens == generate(model, [row.prompt], RUN)[0].tokens


def test_a_burst_into_slots_apart_is_one_forward_and_exact():
    model, shapes = _recorded()
    engine = Engine(model, max_batch=4, prefill_chunk=16)
    once = SamplingSettings(temperature=0, max_new_tokens=1, stop_token_ids=())
    first = [engine.new_row([5, 6], RUN), engine.new_row([7, 8], once), engine.new_row([9, 10], RUN),
             engine.new_row([11, 12], once)]
    engine.submit(first)
    engine.step()  # the rows in slots 1 and 3 finish: holes between the running rows in 0 and 2
    burst = [engine.new_row([13, 14, 15], JOIN, seed=7), engine.new_row([16, 17, 18, 19], JOIN, seed=7)]
    engine.submit(burst)
    shapes.clear()
    engine.step()  # their first chunks, in slots 1 and 3: one forward, not one per slot
    assert [s for s in shapes if s[1] > 1] == [(2, 4)]
    while engine.has_work:
        engine.step()
    for row in first:
        assert row.tokens == generate(model, [row.prompt], row.settings)[0].tokens
    for row in burst:
        assert row.tokens == generate(model, [row.prompt], JOIN)[0].tokens


def test_rows_joining_beside_a_row_mid_prompt_are_apart_and_exact():
    model, shapes = _recorded()
    engine = Engine(model, prefill_chunk=6)
    long_row = engine.new_row(list(range(300, 309)), RUN)  # 9 tokens: chunks of 6 and 3
    engine.submit([long_row])
    engine.step()
    short = [engine.new_row([5, 6], JOIN, seed=7), engine.new_row([7], JOIN, seed=7)]
    engine.submit(short)
    shapes.clear()
    engine.step()  # the long row's last 3 (at cache length 6) and the two short rows (at 0): two forwards
    assert sorted(s for s in shapes if s[1] > 1 or s[0] > 1) == [(1, 3), (2, 2)]
    while engine.has_work:
        engine.step()
    assert long_row.tokens == generate(model, [long_row.prompt], RUN)[0].tokens
    for row in short:
        assert row.tokens == generate(model, [row.prompt], JOIN)[0].tokens


# -- the flat prefill: a batching engine's prompts run on its kernel set (prepacked where packing applies) --


def _flat_engine_rows(engine):
    """A burst of prompts of different lengths, a long prompt in chunks beside running rows, and a
    burst into slots left apart: the shapes every prefill path takes."""
    first = [engine.new_row([5, 6, 7], RUN), engine.new_row([8, 9], SamplingSettings(
        temperature=0, max_new_tokens=1, stop_token_ids=())), engine.new_row(list(range(300, 313)), JOIN, seed=7),
        engine.new_row([11, 12, 13, 14], SamplingSettings(temperature=0, max_new_tokens=1, stop_token_ids=()))]
    engine.submit(first)
    engine.step()
    engine.step()
    later = [engine.new_row([13, 14, 15], JOIN, seed=7), engine.new_row([16, 17, 18, 19, 20], RUN)]
    engine.submit(later)
    while engine.has_work:
        engine.step()
    return first + later


@pytest.mark.parametrize("pack", [None, False])
def test_a_batching_engines_flat_prefill_gives_each_row_its_own_tokens(pack, monkeypatch):
    import gpt2kit.decode.step as step
    from gpt2kit.decode import PackedWeights, PlainKernels

    model = varied_model(SMALL, seed=0).eval()  # no hooks: the flat network runs the prompts
    engine = Engine(model, max_batch=4, prefill_chunk=8, pack_weights=pack)
    assert isinstance(engine.kernels.prefill().kernel_set, PackedWeights if pack is None else PlainKernels)
    flat = []
    monkeypatch.setattr(step, "decode_tokens", lambda m, ids, *a, **k: flat.append(tuple(ids.shape))
                        or decode_tokens(m, ids, *a, **k))
    rows = _flat_engine_rows(engine)
    # every prompt chunk went through the flat network: the burst's first chunks (4 rows, right-padded
    # to 8), the long prompt's second chunk (at cache length 8, beside the running rows), the later
    # burst into slots 1 and 3, apart (FirstChunkCache)
    assert flat == [(4, 8), (1, 5), (2, 5)]
    for row in rows:  # against one row alone, prefilled by the model's own forward
        alone = generate(model, [row.prompt], row.settings)[0].tokens
        assert row.tokens == alone


def test_flat_prefill_logits_and_cache_equal_the_models_forward():
    import torch

    from gpt2kit.decode import kernels_for
    from gpt2kit.decode.step import prefill_ragged
    from gpt2kit.kv_cache import KVCache

    model = varied_model(SMALL, seed=1).eval()
    idx = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 0, 0, 0, 0]])
    last = [4, 2, 0]
    for k_set in (kernels_for(model, 8), kernels_for(model, 8, False)):
        for P in (0, 3):  # a first chunk, and a later one after P cached tokens
            ref, got = KVCache.for_model(model, 3, 16), KVCache.for_model(model, 3, 16)
            if P:
                head = torch.tensor([[1, 2, 3]] * 3)
                prefill_ragged(model, head, [2, 2, 2], ref)
                prefill_ragged(model, head, [2, 2, 2], got)
            want = prefill_ragged(model, idx, last, ref)  # the modules' forward
            have = prefill_ragged(model, idx, last, got, k_set)  # (3, V)
            assert have.shape == want.shape == (3, model.config.n_vocab)
            # the project's float32 logits bound: oneDNN's packed products on an AVX-512 Xeon round
            # differently from the model's F.linear (1.9e-5 on logits up to 52, 4e-7 relative)
            assert torch.allclose(have, want, atol=1e-4, rtol=1e-5)
            assert got.length == ref.length == P + 5
            for b, n in enumerate(last):  # each row's real columns (the padding's are never read)
                cols = P + n + 1
                assert torch.allclose(got.kv[:, b, :, :, :cols], ref.kv[:, b, :, :, :cols], atol=1e-5)


def test_a_one_row_engine_keeps_the_models_forward_and_the_server_warms_up():
    from gpt2kit.decode import is_packed, release

    model = varied_model(SMALL, seed=2).eval()
    release(model)
    assert Engine(model, max_batch=1).kernels.prefill() is None  # no second copy for one row's prompts
    assert not is_packed(model)
    serve_engine(model, None, max_batch=4, pack_weights=None)  # the server's: kernels chosen at start-up
    assert is_packed(model)


def test_ragged_rows_on_the_models_forward_fire_each_hook_once_and_equal_each_row_alone():
    """prefill_ragged without a kernel set (a model with hooks, or training) runs the model's own forward,
    the final norm and head at each row's own last token: every module once, its hooks with it."""
    import torch

    from gpt2kit.decode.step import prefill_ragged
    from gpt2kit.kv_cache import KVCache

    model = varied_model(SMALL, seed=3).eval()
    idx = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 0, 0, 0, 0]])
    last = [4, 2, 0]
    fired: dict[str, list[tuple]] = {}
    names = ["h.0", f"h.{len(model.h) - 1}", "ln_f", "wte", ""]
    def hook(name):
        def record(module, args, out):
            fired.setdefault(name, []).append(tuple((out if torch.is_tensor(out) else out.logits).shape))
        return record

    handles = [dict(model.named_modules())[n].register_forward_hook(hook(n)) for n in names]
    try:
        got = prefill_ragged(model, idx, last, KVCache.for_model(model, 3, 8))
    finally:
        for h in handles:
            h.remove()
    assert {n: len(v) for n, v in fired.items()} == dict.fromkeys(names, 1)
    assert fired["ln_f"] == [(3, 1, model.config.n_embd)]  # the rows' own last positions, not the last column
    with torch.inference_mode():
        for b, n in enumerate(last):
            alone = model(idx[b:b + 1, :n + 1]).logits[0, -1]
            assert torch.allclose(got[b], alone, atol=1e-4, rtol=1e-5)  # other GEMM shapes: float32 rounding
