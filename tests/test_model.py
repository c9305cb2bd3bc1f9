"""The forward pass against transformers' GPT2LMHeadModel, the cache, padding, init and input checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, hf_from_ours, random_model

from gpt2kit.config import PRESETS, GPT2Config
from gpt2kit.decode import decode_step, decode_tokens, kernels_for
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2

ATOL = 1e-4  # float32 logits vs transformers


def _ids(cfg: GPT2Config, B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.n_vocab, (B, T), generator=g)


# --- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params", [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
                                         ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_preset_parameter_counts(name, params):
    with torch.device("meta"):
        assert GPT2.from_name(name).num_parameters() == params


def test_preset_sizes_are_the_papers():
    got = {k: (c.n_layer, c.n_embd, c.n_head, c.n_ctx, c.n_vocab) for k, c in PRESETS.items() if k.count("-") <= 1}
    assert got["gpt2"] == (12, 768, 12, 1024, 50257)
    assert got["gpt2-medium"] == (24, 1024, 16, 1024, 50257)
    assert got["gpt2-large"] == (36, 1280, 20, 1024, 50257)
    assert got["gpt2-xl"] == (48, 1600, 25, 1024, 50257)


@pytest.mark.parametrize("kwargs,needle", [
    ({"n_embd": 100, "n_head": 12}, "divisible"),
    ({"n_layer": 0}, "n_layer"),
    ({"n_ctx": -1}, "n_ctx"),
    ({"n_vocab": 0}, "n_vocab"),
    ({"dropout": 1.5}, "dropout"),
    ({"n_vocab_padded": 10}, "n_vocab_padded"),
])
def test_invalid_config_names_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        GPT2Config(**kwargs)


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="gpt2-medium"):
        GPT2Config.from_name("gpt3")
    with pytest.raises(ValueError, match="valid fields"):
        GPT2Config.from_name("gpt2", n_layers=3)
    assert GPT2Config.from_name("openai-community/gpt2-xl", n_layer=2).n_layer == 2


def test_config_from_hf_and_openai(tmp_path):
    from helpers import hf_config

    hf = hf_config(TINY)
    hf.save_pretrained(tmp_path)
    assert GPT2Config.from_hf(tmp_path) == TINY
    assert GPT2Config.from_openai(TINY.to_openai()) == TINY
    assert GPT2Config.from_hf(TINY.to_hf()) == TINY
    with pytest.raises(ValueError, match="activation_function"):
        GPT2Config.from_hf(TINY.to_hf() | {"activation_function": "relu"})
    with pytest.raises(ValueError, match="n_layer"):
        GPT2Config.from_openai({"n_vocab": 5, "n_ctx": 5, "n_embd": 4, "n_head": 2})


# --- exactness against transformers --------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, GPT2Config(n_vocab=300, n_ctx=40, n_embd=48, n_head=3, n_layer=3)])
def test_logits_match_transformers(cfg):
    model = random_model(cfg, seed=1)
    hf = hf_from_ours(model)
    x = _ids(cfg, 3, cfg.n_ctx)
    with torch.no_grad():
        ours, ref = model(x).logits, hf(x).logits
    assert ours.shape == ref.shape == (3, cfg.n_ctx, cfg.n_vocab)
    assert (ours - ref).abs().max().item() < ATOL


def test_logits_match_transformers_full_gpt2_size():
    cfg = GPT2Config.from_name("gpt2")
    model = random_model(cfg, seed=2)
    hf = hf_from_ours(model)
    x = _ids(cfg, 1, 1024)
    with torch.no_grad():
        diff = (model(x).logits - hf(x).logits).abs().max().item()
    assert diff < ATOL, diff


def test_loss_matches_transformers_and_ignores_index():
    model = random_model()
    hf = hf_from_ours(model)
    x = _ids(TINY, 2, 30)
    with torch.no_grad():
        ours = model(x[:, :-1], targets=x[:, 1:]).loss
        ref = hf(x, labels=x).loss
        assert abs(ours.item() - ref.item()) < 1e-5
        t = x[:, 1:].clone()
        t[:, :10] = -100
        logits = model(x[:, :-1]).logits
        manual = F.cross_entropy(logits[:, 10:].reshape(-1, TINY.n_vocab), x[:, 11:].reshape(-1))
        assert abs(model(x[:, :-1], targets=t).loss.item() - manual.item()) < 1e-6


def test_dropout_is_off_in_eval():
    model = random_model(TINY.replace(dropout=0.3))
    x = _ids(TINY, 1, 16)
    with torch.no_grad():
        assert torch.equal(model(x).logits, model(x).logits)
    model.train()
    assert not torch.equal(model(x).logits, model(x).logits)


# --- KV cache -------------------------------------------------------------------------------

def test_past_in_pieces_equals_one_pass():
    model = random_model()
    x = _ids(TINY, 2, 40)
    with torch.no_grad():
        full = model(x).logits
        pieces, past = [], None
        for a, b in [(0, 7), (7, 8), (8, 25), (25, 40)]:
            out = model(x[:, a:b], past=past, use_cache=True)
            pieces.append(out.logits)
            past = out.present
            # the official layout: [B, L, 2, h, T, d_h]
            assert past.shape == (2, TINY.n_layer, 2, TINY.n_head, b, TINY.head_dim)
    assert (torch.cat(pieces, 1) - full).abs().max().item() < 1e-5


def test_present_matches_transformers_keys_and_values():
    model = random_model()
    hf = hf_from_ours(model)
    x = _ids(TINY, 1, 12)
    with torch.no_grad():
        present = model(x, use_cache=True).present
        cache = hf(x, use_cache=True).past_key_values
    for i in range(TINY.n_layer):
        k = cache.layers[i].keys if hasattr(cache, "layers") else cache[i][0]
        v = cache.layers[i].values if hasattr(cache, "layers") else cache[i][1]
        assert (present[:, i, 0] - k).abs().max() < 1e-5
        assert (present[:, i, 1] - v).abs().max() < 1e-5


def test_preallocated_cache_equals_one_pass_and_present():
    model = random_model()
    x = _ids(TINY, 2, 30)
    cache = KVCache.for_model(model, batch_size=2, max_len=30)
    with torch.no_grad():
        full = model(x, use_cache=True)
        pieces = [model(x[:, :10], cache=cache).logits]
        pieces += [model(x[:, t:t + 1], cache=cache).logits for t in range(10, 30)]
    assert cache.length == 30
    assert (torch.cat(pieces, 1) - full.logits).abs().max().item() < 1e-5
    assert (cache.to_present() - full.present).abs().max().item() < 1e-6


def test_present_is_a_copy_not_a_view_of_the_cache():
    model = random_model()
    cache = KVCache.for_model(model, batch_size=1, max_len=4)
    with torch.no_grad():
        model(_ids(TINY, 1, 4), cache=cache)
    present = cache.to_present()
    assert present.shape == (1, TINY.n_layer, 2, TINY.n_head, 4, TINY.head_dim)
    cache.kv.zero_()
    assert present.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_decode_step_equals_forward(dtype, padded):
    model = random_model().to(dtype)
    x = _ids(TINY, 3, 9)
    mask = torch.ones(3, 10, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
        mask[2, :8] = 0
    caches = [KVCache.for_model(model, 3, 10) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            model(x, cache=c, attention_mask=mask[:, :9] if padded else None)
        tok = _ids(TINY, 3, 1)
        want = model(tok, cache=caches[0], attention_mask=mask if padded else None, last_logits_only=True)
        got = decode_step(model, tok, caches[1], mask if padded else None)
    assert caches[1].length == 10
    if dtype == torch.float32:
        assert torch.equal(got, want.logits[:, -1])  # the same kernels on the same values
        assert torch.equal(caches[0].kv, caches[1].kv)
    else:  # half-precision few-row products may take W @ x^T (decode.plain): equal to bf16 rounding
        torch.testing.assert_close(got.float(), want.logits[:, -1].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(caches[0].kv.float(), caches[1].kv.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="eval"):
        decode_step(model.train(), tok, caches[1])


@pytest.mark.parametrize("rows", [[0, 2, 3], [1, 2, 3, 4], [0, 1], [4], [0, 1, 2, 3, 4]])
def test_cache_keep_is_select_in_place(rows):
    """keep(rows) leaves the cache select() leaves, in the same storage (nothing allocated)."""
    a, b = KVCache(2, 5, 3, 7, 4), KVCache(2, 5, 3, 7, 4)
    a.kv.copy_(torch.randn(a.kv.shape))
    b.kv.copy_(a.kv)
    ptr = b.kv.data_ptr()
    a.select(torch.tensor(rows))
    b.keep(rows)
    assert torch.equal(a.kv, b.kv) and b.batch_size == len(rows) and b.kv.data_ptr() == ptr
    k, _ = b.update_kv(1, torch.ones(len(rows), 2, 3, 1, 4))  # the view is written and read as a cache
    assert torch.equal(k[:, :, 0], torch.ones(len(rows), 3, 4))


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_decode_step_without_head_writes_the_same_cache(pack):
    """head=False (a draft's last token) writes the cache decode_step writes and returns no logits."""
    model = random_model()
    x, tok = _ids(TINY, 2, 6), _ids(TINY, 2, 1, seed=1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    kernels = kernels_for(model, 2, pack)
    caches = [KVCache.for_model(model, 2, 7) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            model(x, cache=c, attention_mask=mask[:, :6])
        assert decode_step(model, tok, caches[0], mask, kernels) is not None
        assert decode_step(model, tok, caches[1], mask, kernels, head=False) is None
        assert decode_step(model, tok, KVCache.for_model(model, 2, 7), None, None, head=False) is None
    assert caches[1].length == 7 and torch.equal(caches[0].kv, caches[1].kv)


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("case", ["unpadded", "padded", "holes"])
def test_decode_tokens_equals_forward(pack, case):
    """The few-token flat step (a speculative verify) gives forward's logits at every position and
    writes the same cache, with left padding and with masked-out columns (dropped drafts) too."""
    model = random_model()
    B, P, T = 3, 9, 4
    x = _ids(TINY, B, P)
    mask = torch.ones(B, P + T, dtype=torch.long)
    if case != "unpadded":
        mask[0, :3] = 0
        mask[2, :8] = 0
    if case == "holes":
        mask[1, 5:7] = 0  # columns a row dropped earlier
    use = None if case == "unpadded" else mask
    caches = [KVCache.for_model(model, B, P + T) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            model(x, cache=c, attention_mask=None if use is None else use[:, :P])
        tok = _ids(TINY, B, T, seed=1)
        want = model(tok, cache=caches[0], attention_mask=use).logits  # (B, T, V)
        got = decode_tokens(model, tok, caches[1], use, kernels_for(model, B * T, pack))
    assert got.shape == want.shape and caches[1].length == P + T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].kv, caches[0].kv, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # from an empty cache: the causal fast path
        c = KVCache.for_model(model, B, T)
        torch.testing.assert_close(decode_tokens(model, tok, c, None, kernels_for(model, B * T, pack)),
                                   model(tok).logits, atol=1e-5, rtol=1e-5)


# --- padding --------------------------------------------------------------------------------

def test_left_padding_gives_unpadded_logits():
    model = random_model()
    x = _ids(TINY, 3, 20)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    mask[2, :19] = 0
    padded = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = model(padded, attention_mask=mask).logits
        for row, n_pad in [(0, 0), (1, 5), (2, 19)]:
            alone = model(x[row:row + 1, n_pad:]).logits[0]
            assert (out[row, n_pad:] - alone).abs().max().item() < 1e-5
    assert torch.isfinite(out).all()


def test_left_padding_with_cache_continues_exactly():
    model = random_model()
    x = _ids(TINY, 2, 16)
    mask = torch.ones_like(x)
    mask[0, :6] = 0
    with torch.no_grad():
        first = model(x[:, :10], attention_mask=mask[:, :10], use_cache=True)
        second = model(x[:, 10:], attention_mask=mask, past=first.present).logits
        alone = model(x[:1, 6:]).logits[0]
    assert (second[0] - alone[4:]).abs().max().item() < 1e-5


@pytest.mark.parametrize("pattern", ["all", "middle", "right", "random"])
def test_no_nan_for_any_padding_pattern(pattern):
    model = random_model()
    x = _ids(TINY, 4, 12)
    mask = torch.ones_like(x)
    if pattern == "all":
        mask[:] = 0
    elif pattern == "middle":
        mask[:, 3:8] = 0
    elif pattern == "right":
        mask[:, 6:] = 0
    else:
        mask = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(x, attention_mask=mask)
        loss = model(x, attention_mask=mask, targets=x).loss
    assert torch.isfinite(out.logits).all() and torch.isfinite(loss)


# --- vocab padding, init --------------------------------------------------------------------

def test_padded_vocab_logits_are_cut_back():
    cfg = TINY.replace(n_vocab_padded=1024)
    model = random_model(cfg)
    assert model.wte.weight.shape[0] == 1024
    plain = GPT2(TINY).eval()
    plain.load_state_dict({k: v[:1000] if k == "wte.weight" else v for k, v in model.state_dict().items()})
    x = _ids(cfg, 2, 8)
    with torch.no_grad():
        model.wte.weight[1000:] = 100.0  # would win every argmax if it leaked into the logits
        out = model(x, targets=x)
        want = plain(x, targets=x)
    assert out.logits.shape[-1] == 1000
    torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-6)


def test_gpt2_initialisation():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=8, n_embd=256, n_head=4, n_vocab=4000, n_ctx=512))
    sd = model.state_dict()
    assert abs(sd["wte.weight"].std().item() - 0.02) < 1e-3
    assert abs(sd["wpe.weight"].std().item() - 0.01) < 1e-3
    assert abs(sd["h.0.attn.c_attn.weight"].std().item() - 0.02) < 1e-3
    resid = 0.02 / math.sqrt(2 * 8)
    for k in ("h.3.attn.c_proj.weight", "h.5.mlp.c_proj.weight"):
        assert abs(sd[k].std().item() - resid) < 3e-4
    assert all(sd[k].abs().max() == 0 for k in sd if k.endswith("bias"))
    assert torch.equal(sd["ln_f.weight"], torch.ones(256))


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("make,needle", [
    (lambda: torch.tensor([[1, 2, 1000]]), "1000.*1000"),
    (lambda: torch.tensor([[1, -3]]), "-3"),
    (lambda: torch.tensor([1, 2, 3]), "shape"),
    (lambda: torch.tensor([[1.0, 2.0]]), "dtype"),
    (lambda: torch.zeros(1, 65, dtype=torch.long), "65.*n_ctx=64"),
    (lambda: [[1, 2]], "torch.Tensor"),
])
def test_bad_input_raises_value_error(make, needle):
    model = random_model()
    with pytest.raises(ValueError, match=needle):
        model(make())


def test_bad_cache_and_mask_shapes():
    model = random_model()
    x = _ids(TINY, 2, 10)
    with torch.no_grad():
        past = model(x, use_cache=True).present
    with pytest.raises(ValueError, match="past must have shape"):
        model(x[:1], past=past)
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(2, 60, dtype=torch.long), past=past)
    with pytest.raises(ValueError, match="attention_mask"):
        model(x, attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match="targets"):
        model(x, targets=x[:, :5])


def test_narrow_integer_ids_give_the_int64_logits():
    model = random_model()
    x = _ids(TINY, 2, 9) % 250
    with torch.no_grad():
        want = model(x).logits
        for dtype in (torch.uint8, torch.int16, torch.int32):
            assert torch.equal(model(x.to(dtype)).logits, want), dtype
        assert torch.equal(model(x, targets=x.to(torch.int16)).loss, model(x, targets=x).loss)


@pytest.mark.parametrize("value", [2, 0.5, -1])
def test_attention_mask_values_other_than_0_and_1_are_refused(value):
    model = random_model()
    mask = torch.ones(1, 4)
    mask[0, 1] = value
    with pytest.raises(ValueError, match=f"attention_mask must hold only 0.*{value}"):
        model(_ids(TINY, 1, 4), attention_mask=mask)
    model(_ids(TINY, 1, 4), attention_mask=torch.tensor([[False, True, True, True]]))  # bool masks are fine


def test_past_of_another_dtype_is_refused_naming_both():
    model = random_model()
    x = _ids(TINY, 1, 6)
    with torch.no_grad():
        past = model(x, use_cache=True).present
    with pytest.raises(ValueError, match="float64.*float32"):
        model(x[:, :1], past=past.double())


def test_targets_outside_the_vocabulary_or_all_ignored_are_refused():
    model = random_model()
    x = _ids(TINY, 1, 6)
    with pytest.raises(ValueError, match="target id 1000 is outside"):
        model(x, targets=torch.full_like(x, 1000))
    with pytest.raises(ValueError, match="target id -5"):
        model(x, targets=torch.full_like(x, -5))
    with pytest.raises(ValueError, match="every target is ignore_index=-100"):
        model(x, targets=torch.full_like(x, -100))
    t = torch.full_like(x, -100)
    t[0, 2] = 7
    assert torch.isfinite(model(x, targets=t).loss)
