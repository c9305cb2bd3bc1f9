"""The prefix cache for scoring: score_tokens_top through a PrefixCache gives the numbers of the
uncached forward (1e-5) while running only what no cached sequence shares through the model (a
forward hook counts the tokens), keeps to its token bound, and forgets weights that changed."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, random_model

from gpt2kit.decode import decode_tokens
from gpt2kit.prefix_cache import PrefixCache
from gpt2kit.score import score_tokens_top

EOT = 50256


@pytest.fixture()
def model():
    return random_model(SMALL, seed=3).eval()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, SMALL.n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Counted:
    """Tokens each forward of `model` ran (its idx's length)."""

    def __init__(self, model) -> None:
        self.runs: list[int] = []
        self.handle = model.register_forward_hook(lambda m, a, kw, o: self.runs.append(a[0].shape[1]),
                                                  with_kwargs=True)


def _same(got, want, atol=1e-5):
    (lps, tops), (wlps, wtops) = got, want
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(wlps), rtol=0, atol=atol)
    assert [[t for t, _ in row] for row in tops] == [[t for t, _ in row] for row in wtops]
    for row, wrow in zip(tops, wtops, strict=True):
        if row:
            torch.testing.assert_close(torch.tensor([v for _, v in row]), torch.tensor([v for _, v in wrow]),
                                       rtol=0, atol=atol)


def test_multiple_choice_endings_compute_the_shared_context_once(model):
    """lm-eval's shape: one context, four endings, each its own request. The first runs all of
    eot + context + ending; the others only their ending (plus, where the earlier prompt went on
    past the context, the context's last token again)."""
    context, endings = _ids(40, 1), [_ids(k, 10 + k) for k in (3, 5, 1, 4)]
    want = [score_tokens_top(model, context + e, 3, eot_token=EOT) for e in endings]
    reused = []
    cache = PrefixCache(1000, on_reuse=reused.append)
    seen = Counted(model)
    got = [score_tokens_top(model, context + e, 3, eot_token=EOT, cache=cache) for e in endings]
    seen.handle.remove()
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    assert seen.runs == [1 + 40 + 3] + [1 + len(e) for e in endings[1:]]  # the context ran once
    assert reused == [40] * 3  # eot + context less the token run again


def test_a_prompt_extending_a_scored_one_runs_only_its_new_tokens(model):
    first, more = _ids(20, 2), _ids(6, 3)
    cache = PrefixCache(1000)
    score_tokens_top(model, first, 2, eot_token=EOT, cache=cache)
    seen = Counted(model)
    got = score_tokens_top(model, first + more, 2, eot_token=EOT, cache=cache)
    again = score_tokens_top(model, first + more, 2, eot_token=EOT, cache=cache)  # a repeat: nothing runs
    part = score_tokens_top(model, first[:7], 2, eot_token=EOT, cache=cache)  # a prefix of it: nothing runs
    seen.handle.remove()
    assert seen.runs == [6]
    _same(got, score_tokens_top(model, first + more, 2, eot_token=EOT))
    _same(again, got, atol=0)
    _same(part, score_tokens_top(model, first[:7], 2, eot_token=EOT))
    assert len(cache) == 1 and cache.tokens == 27  # the extended entry was replaced, not kept twice


@pytest.mark.parametrize("top", [0, 1, 5])
def test_the_same_numbers_for_every_top(model, top):
    context = _ids(30, 4)
    cache = PrefixCache(1000)
    for tail in (_ids(4, 5), _ids(4, 6), []):
        _same(score_tokens_top(model, context + tail, top, eot_token=EOT, cache=cache),
              score_tokens_top(model, context + tail, top, eot_token=EOT))


def test_an_entry_with_fewer_alternatives_is_not_used_for_more(model):
    context = _ids(30, 7)
    cache = PrefixCache(1000)
    score_tokens_top(model, context, 1, eot_token=EOT, cache=cache)
    seen = Counted(model)
    got = score_tokens_top(model, context + [5], 4, eot_token=EOT, cache=cache)
    seen.handle.remove()
    assert seen.runs == [32]
    _same(got, score_tokens_top(model, context + [5], 4, eot_token=EOT))


def test_the_bound_in_tokens_evicts_the_least_recently_used(model):
    a, b, c = _ids(20, 8), _ids(20, 9), _ids(20, 10)
    cache = PrefixCache(50)  # two 21-token sequences fit, three do not
    for seq in (a, b):
        score_tokens_top(model, seq, 0, eot_token=EOT, cache=cache)
    score_tokens_top(model, a + [1], 0, eot_token=EOT, cache=cache)  # a extended: b is now the oldest
    score_tokens_top(model, c, 0, eot_token=EOT, cache=cache)
    assert cache.tokens <= 50 and len(cache) == 2
    seen = Counted(model)
    score_tokens_top(model, b, 0, eot_token=EOT, cache=cache)  # evicted: runs whole
    score_tokens_top(model, c, 0, eot_token=EOT, cache=cache)  # kept: runs nothing
    seen.handle.remove()
    assert seen.runs == [21]
    small = PrefixCache(10)
    score_tokens_top(model, a, 0, eot_token=EOT, cache=small)  # longer than the bound: not kept
    assert len(small) == 0 and small.tokens == 0


def test_changed_weights_empty_the_cache(model):
    context = _ids(25, 11)
    cache = PrefixCache(1000)
    score_tokens_top(model, context, 2, eot_token=EOT, cache=cache)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(1.5)  # in place: the version counter moves
    seen = Counted(model)
    got = score_tokens_top(model, context + [3], 2, eot_token=EOT, cache=cache)
    assert seen.runs == [27]  # nothing reused from the old weights
    _same(got, score_tokens_top(model, context + [3], 2, eot_token=EOT))
    model.h[1].attn.c_proj.weight = torch.nn.Parameter(model.h[1].attn.c_proj.weight.detach() * 0.5)  # replaced
    seen.runs.clear()
    got = score_tokens_top(model, context + [3], 2, eot_token=EOT, cache=cache)
    assert seen.runs == [27]
    _same(got, score_tokens_top(model, context + [3], 2, eot_token=EOT))
    other = random_model(SMALL, seed=5).eval()  # another model, same shapes
    got = score_tokens_top(other, context + [3], 2, eot_token=EOT, cache=cache)
    _same(got, score_tokens_top(other, context + [3], 2, eot_token=EOT))
    seen.handle.remove()


def test_training_mode_and_a_zero_bound_keep_nothing(model):
    context = _ids(20, 12)
    off = PrefixCache(0)
    score_tokens_top(model, context, 1, eot_token=EOT, cache=off)
    assert len(off) == 0
    cache = PrefixCache(1000)
    model.train()
    score_tokens_top(model, context, 1, eot_token=EOT, cache=cache)
    assert len(cache) == 0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
        PrefixCache(-1)


def test_sequences_longer_than_the_context_bypass_the_cache(model):
    """The sliding window's contexts differ from any prefix's: such a text is neither served
    from the cache nor kept in it."""
    tokens = _ids(100, 13)  # eot + 100 > n_ctx 64
    cache = PrefixCache(10_000)
    got = score_tokens_top(model, tokens, 2, eot_token=EOT, stride=32, cache=cache)
    _same(got, score_tokens_top(model, tokens, 2, eot_token=EOT, stride=32), atol=0)
    assert len(cache) == 0
    fits = tokens[:SMALL.n_ctx - 1]  # eot + 63 = n_ctx: one window, cached
    _same(score_tokens_top(model, fits, 2, eot_token=EOT, cache=cache), score_tokens_top(model, fits, 2, eot_token=EOT))
    assert cache.tokens == SMALL.n_ctx


def test_a_model_with_a_packed_copy_scores_on_the_flat_network_with_the_same_numbers(model, monkeypatch):
    """A batching server holds a prepacked copy of the matrices (gpt2kit.decode.packed); scoring then
    runs on the flat network over it (decode_tokens, counted), through the prefix cache and through
    sliding windows, and gives the forward's numbers (1e-5); a model with a hook keeps its forward."""
    import gpt2kit.score as score
    from gpt2kit.decode import packed_weights, release

    flat = []
    monkeypatch.setattr(score, "decode_tokens", lambda m, ids, *a, **k: flat.append(ids.shape[1])
                        or decode_tokens(m, ids, *a, **k))

    context, endings = _ids(30, 1), [_ids(5, 2), _ids(9, 3)]
    want = [score_tokens_top(model, context + e, 3) for e in endings]
    want_windows = score_tokens_top(model, _ids(150, 4), 2, stride=40)
    assert packed_weights(model, 8) is not None
    try:
        cache = PrefixCache(10_000)
        got = [score_tokens_top(model, context + e, 3, cache=cache) for e in endings]
        assert flat == [31 + 5, 9 + 1]  # the second ending: only past the shared context (and its last token)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
        _same(score_tokens_top(model, _ids(150, 4), 2, stride=40), want_windows)
        assert flat[2:] == [64, 64, 64, 31]  # 151 positions: windows of 64 starting every 40
        hooked = Counted(model)  # with a hook on, the model's own forward runs (and is counted)
        _same(score_tokens_top(model, context + endings[0], 3), want[0])
        hooked.handle.remove()
        # decode_tokens hands a hooked model to its own forward (decode.path): the forward ran, once
        assert hooked.runs == [31 + 5] and flat[6:] == [31 + 5]
    finally:
        release(model)
