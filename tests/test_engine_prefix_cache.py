"""Prefix caching for generation (gpt2kit.prefix_cache blocks, gpt2kit.engine.prefill): a row whose
prompt starts with blocks an earlier row left in the cache starts from their keys and values and
prefills only the rest, and gets the tokens and log-probs it gets without the cache (greedy tokens
identical, float32 log-probs and top alternatives within 1e-5 absolute and relative: the
rounding of a prefill cut at other points), alone, beside rows that share nothing, joining while
others decode, sampled with a seed, and as beams. A hook on wte records each forward's shape, so
the tests see what was prefilled."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, varied_model

from gpt2kit.config import GPT2Config
from gpt2kit.engine import Engine
from gpt2kit.generation import generate
from gpt2kit.prefix_cache import PrefixCache
from gpt2kit.sampling import SamplingSettings

CFG = GPT2Config(n_vocab=SMALL.n_vocab, n_ctx=128, n_embd=32, n_head=4, n_layer=2)
GREEDY = SamplingSettings(temperature=0, max_new_tokens=12, stop_token_ids=())
SAMPLED = SamplingSettings(max_new_tokens=12, seed=5, top_k=50, stop_token_ids=())


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _ids(50, 1)  # a shared prefix: 3 whole blocks of 16 and 2 tokens


@pytest.fixture()
def model():
    m = varied_model(CFG, seed=0)
    m.prefill_shapes = []
    m.wte.register_forward_hook(lambda mod, inp, out: m.prefill_shapes.append(tuple(inp[0].shape)))
    return m


def _run(model, batches, settings=GREEDY, cache=None, **engine):
    """Each batch of prompts submitted at its own step (after the earlier ones' rows are running);
    every row's tokens and log-probs (top 3), once all have finished."""
    eng = Engine(model, prefix_cache=cache, **engine)
    rows, events = [], []
    for batch in batches:
        new = [eng.new_row(p, settings, seed=settings.seed, logprobs=3) for p in batch]
        eng.submit(new)
        rows += new
        events += eng.step() + eng.step()  # the batch joins; the rows before it go on decoding
    while eng.has_work:
        events += eng.step()
    events = {r: [e for e in events if e.row is r] for r in rows}
    return [(r.tokens, [e.logprob for e in events[r]], [e.top_logprobs for e in events[r]]) for r in rows]


def _same(got, want):
    for (tok, lps, tops), (wtok, wlps, wtops) in zip(got, want, strict=True):
        assert tok == wtok and len(lps) == len(tok)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(wlps), rtol=1e-5, atol=1e-5)
        assert [[t for t, _ in row] for row in tops] == [[t for t, _ in row] for row in wtops]
        torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in tops]),
                                   torch.tensor([[v for _, v in row] for row in wtops]), rtol=1e-5, atol=1e-5)


def _prefilled(model) -> int:
    """Prompt tokens the recorded forwards prefilled (forwards of more than one token per row)."""
    return sum(b * t for b, t in model.prefill_shapes if t > 1)


def test_a_prompt_sharing_blocks_with_an_earlier_one_prefills_only_the_rest(model):
    first, second = SYSTEM + _ids(9, 2), SYSTEM + _ids(7, 3)
    want = _run(model, [[first], [second]])
    model.prefill_shapes.clear()
    cache = PrefixCache(4096)
    got = _run(model, [[first], [second]], cache=cache)
    _same(got, want)
    # the first prompt whole; the second from its 48 cached tokens on (3 blocks of 16)
    assert _prefilled(model) == len(first) + len(second) - 48
    assert got[1][0] == generate(model, [second], GREEDY)[0].tokens


def test_rows_sharing_a_prefix_and_not_batch_together_exactly(model):
    """A batch after a warm row: two rows sharing its prefix, one sharing nothing, one equal to it
    (its last token still runs: the row needs its logits); also with sampling and a seed."""
    warm = SYSTEM + _ids(20, 4)
    batch = [SYSTEM + _ids(5, 5), _ids(40, 6), SYSTEM[:33] + _ids(3, 7), list(warm)]
    for settings in (GREEDY, SAMPLED):
        want = _run(model, [[warm], batch], settings)
        model.prefill_shapes.clear()
        got = _run(model, [[warm], batch], settings, cache=PrefixCache(4096))
        _same(got, want)
        reused = 48 + 0 + 32 + 64  # whole blocks, and never a prompt's last token
        assert _prefilled(model) == len(warm) + sum(len(p) for p in batch) - reused


def test_rows_join_from_the_cache_while_others_decode(model):
    """Rows join one at a time while the earlier ones decode (chunked prefill of 8 tokens a step),
    each starting from what the rows before it left."""
    prompts = [[SYSTEM + _ids(k + 3, 10 + k)] for k in range(4)]
    want = _run(model, prompts, prefill_chunk=8)
    got = _run(model, prompts, cache=PrefixCache(4096), prefill_chunk=8)
    _same(got, want)


def test_beams_start_from_the_cache(model):
    settings = SamplingSettings(num_beams=3, max_new_tokens=8, stop_token_ids=())
    prompt = SYSTEM + _ids(6, 20)
    want = generate(model, [prompt], settings)[0]
    cache = PrefixCache(4096)
    _run(model, [[SYSTEM + _ids(4, 21)]], cache=cache)
    eng = Engine(model, prefix_cache=cache)
    rows = eng.new_beam_rows(prompt, settings)
    eng.submit(rows)
    model.prefill_shapes.clear()
    events = []
    while eng.has_work:
        events += eng.step()
    assert _prefilled(model) == len(prompt) - 48
    assert list(events[-1].beams[0].tokens) == want.tokens


def test_the_cache_keeps_to_its_bound_and_evicts_a_chains_tail_first(model):
    cache = PrefixCache(64)  # 4 blocks
    _run(model, [[_ids(70, 30)]], cache=cache)
    assert cache.tokens == 64 and len(cache) == 4  # the first 4 of its blocks
    _run(model, [[_ids(40, 31)]], cache=cache)  # 2 blocks: the other chain's last 2 go
    assert cache.tokens == 64
    model.prefill_shapes.clear()
    _run(model, [[_ids(70, 30)[:40]]], cache=cache)  # its head is still there
    assert _prefilled(model) == 40 - 32


def test_changed_weights_int8_and_a_namespace_miss(model):
    """An in-place edit of the weights or an int8 swap empties the cache (the outputs are the new
    model's); blocks stored under one namespace (e.g. an adapter) serve only it."""
    cache = PrefixCache(4096)
    prompt = SYSTEM + _ids(5, 40)
    _run(model, [[SYSTEM + _ids(3, 41)]], cache=cache)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(1.5)
    model.prefill_shapes.clear()
    got = _run(model, [[prompt]], cache=cache)
    assert _prefilled(model) == len(prompt)  # nothing from the old weights
    assert got[0][0] == generate(model, [prompt], GREEDY)[0].tokens
    from gpt2kit.quant import quantize_model

    quantize_model(model)
    model.wte.register_forward_hook(lambda mod, inp, out: model.prefill_shapes.append(tuple(inp[0].shape)))
    model.prefill_shapes.clear()
    got = _run(model, [[prompt]], cache=cache)
    assert _prefilled(model) == len(prompt)
    assert got[0][0] == generate(model, [prompt], GREEDY)[0].tokens
    kv = torch.zeros(CFG.n_layer, 2, CFG.n_head, 64, CFG.head_dim)
    cache.store_blocks(model, prompt, kv, namespace="a")
    assert len(cache.lookup_blocks(model, prompt, 64, namespace="a")) == 3
    assert cache.lookup_blocks(model, prompt, 64, namespace="b") == []


def test_lookups_are_reported():
    seen, reused = [], []
    model = varied_model(CFG, seed=1)
    cache = PrefixCache(4096, on_reuse=reused.append, on_lookup=seen.append)
    _run(model, [[SYSTEM], [SYSTEM + [5]]], cache=cache)
    assert seen == [0, 48] and reused == [48]


def test_generate_takes_a_prefix_cache(model):
    """generate's opt-in: the second call starts from the first's blocks; the same tokens."""
    cache = PrefixCache(4096)
    prompts = [SYSTEM + _ids(6, 50), SYSTEM + _ids(4, 51)]
    want = [c.tokens for c in generate(model, prompts, SAMPLED)]
    generate(model, [SYSTEM + _ids(3, 52)], SAMPLED, prefix_cache=cache)
    model.prefill_shapes.clear()
    assert [c.tokens for c in generate(model, prompts, SAMPLED, prefix_cache=cache)] == want
    assert model.prefill_shapes[0] == (2, 56 - 48)  # one forward of both rows' rest, padded to the longer
    with pytest.raises(ValueError, match="beam"):
        generate(model, prompts, SamplingSettings(num_beams=2), prefix_cache=cache)
    with pytest.raises(ValueError, match="speculative"):
        generate(model, prompts, SamplingSettings(prompt_lookup=2), prefix_cache=cache)


def test_the_documented_example_runs_and_reuses_the_system_prompt(model):
    """docs/serving.md's example, run as written on a small model: the second call prefills only
    past the system prompt's whole blocks, and gives the tokens it gives without the cache."""
    import re
    from pathlib import Path

    from gpt2kit.tokenizer import Tokenizer

    text = (Path(__file__).parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    code = re.search(r"## Prefix cache\n.*?```python\n(.*?)```", text, re.S).group(1)
    code = code.replace('model, tokenizer = load_model("gpt2"), load_tokenizer("gpt2")', "")  # this test's own
    tokenizer = Tokenizer.default()
    scope = {"model": model, "tokenizer": tokenizer}
    exec(code, scope)
    system = scope["system"]
    rest = len(system) + len(tokenizer.encode("Hi")) - len(system) // 16 * 16
    assert [t for s in model.prefill_shapes for t in s[1:] if t > 1][-1] == rest
    prompt = system + tokenizer.encode("Hi")
    assert scope["again"][0].tokens == generate(model, [prompt], scope["settings"])[0].tokens


def test_rows_with_interventions_neither_read_nor_leave_blocks(model):
    """An intervened row's keys and values are not the model's own: a plain row after it prefills as
    without the cache, and an intervened row after a plain one equals it run with no cache."""
    from gpt2kit.trace import steer

    prompt = SYSTEM + _ids(9, 4)
    vec = torch.randn(CFG.n_embd, generator=torch.Generator().manual_seed(3))
    steered = [steer("h.0.resid", vec, 4.0)]
    cache = PrefixCache(4096)
    want_plain = generate(model, [prompt], GREEDY)[0].tokens
    want_steered = generate(model, [prompt], GREEDY, interventions=steered)[0].tokens
    assert want_plain != want_steered
    assert generate(model, [prompt], GREEDY, interventions=steered, prefix_cache=cache)[0].tokens == want_steered
    assert generate(model, [prompt], GREEDY, prefix_cache=cache)[0].tokens == want_plain
    assert generate(model, [prompt], GREEDY, interventions=steered, prefix_cache=cache)[0].tokens == want_steered
