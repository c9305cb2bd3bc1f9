"""gpt2kit.trace: the recorded forward pass is the model's own, proven against transformers.

Tolerances: logits bit for bit against model(ids); transformers' logits and hidden states 1e-4,
eager attention probabilities 1e-5 (float32); attention rows sum to 1 within 1e-6; direct logit
attribution sums to the logit within 1e-4; patching a layer with the clean run's own residual
restores the clean logits bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, hf_from_ours, needs_real_gpt2, random_hf_model, random_model

from gpt2kit import load_model
from gpt2kit.trace import parse_layers, parse_what, trace
from gpt2kit.trace.patching import patch_residual, run_with_patches
from gpt2kit.trace.views import lens_logits

FIXTURE_TF = Path(__file__).parent / "fixtures" / "openai_tf_tiny"


def _ids(n_vocab: int, T: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n_vocab, (T,), generator=g).tolist()
    return ids[: T // 2] + ids[: T - T // 2]  # a repeat, so induction-like scores exist


def _eager(hf):
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation("eager")
    else:  # older transformers
        hf.config._attn_implementation = "eager"
    return hf


def _check_against_transformers(model, hf, ids):
    tr = trace(model, None, ids)
    idx = torch.tensor([ids])
    with torch.no_grad():
        ref = _eager(hf)(idx, output_attentions=True, output_hidden_states=True)
        own = model(idx).logits[0]
    assert torch.equal(tr.logits, own)  # the hooks only read
    assert (tr.logits - ref.logits[0]).abs().max() < 1e-4
    L = model.config.n_layer
    for layer in range(L):  # transformers' last hidden state is after ln_f
        assert (tr[f"resid.{layer}"] - ref.hidden_states[layer][0]).abs().max() < 1e-4, layer
    assert (tr["ln_f"] - ref.hidden_states[L][0]).abs().max() < 1e-4
    for i in range(L):
        probs = tr[f"h.{i}.attn.probs"]
        assert (probs - ref.attentions[i][0]).abs().max() < 1e-5, i
        assert (probs.sum(-1) - 1).abs().max() < 1e-6
        scores = tr[f"h.{i}.attn.scores"]
        assert torch.isinf(scores.triu(1)[:, torch.ones(len(ids), len(ids)).triu(1).bool()]).all()
    return tr


def test_trace_equals_model_and_transformers(tiny_model):
    tr = _check_against_transformers(tiny_model, hf_from_ours(tiny_model), _ids(TINY.n_vocab, 24))
    T, C, nh, hs = 24, TINY.n_embd, TINY.n_head, TINY.head_dim
    assert tr.shapes()["h.1.attn.q"] == (nh, T, hs) and tr.shapes()["h.0.mlp.pre"] == (T, 4 * C)
    assert tr.shapes()["h.0.attn.probs"] == (nh, T, T) and tr.shapes()["logits"] == (T, TINY.n_vocab)
    # The pieces fit together as the spec says: H' = H + A, H^(l+1) = H' + M, H^(0) = wte[X] + wpe[pos].
    assert torch.equal(tr["resid.0"], tr["embed.tok"] + tr["embed.pos"])
    for i in range(TINY.n_layer):
        assert torch.equal(tr[f"h.{i}.resid_mid"], tr[f"resid.{i}"] + tr[f"h.{i}.attn.out"])
        assert torch.equal(tr[f"resid.{i + 1}"], tr[f"h.{i}.resid_mid"] + tr[f"h.{i}.mlp.out"])
        z = tr[f"h.{i}.attn.probs"] @ tr[f"h.{i}.attn.v"]  # (nh, T, hs): P V from the derived P
        assert (z - tr[f"h.{i}.attn.z"]).abs().max() < 1e-5


@pytest.mark.parametrize("prefixed", [True, False])
def test_trace_of_saved_transformers_checkpoint(tmp_path, prefixed):
    hf = random_hf_model()
    (hf if prefixed else hf.transformer).save_pretrained(tmp_path)
    _check_against_transformers(load_model(tmp_path), hf, _ids(TINY.n_vocab, 20))


def test_trace_of_openai_tf_fixture():
    model = load_model(FIXTURE_TF)
    _check_against_transformers(model, hf_from_ours(model), _ids(model.config.n_vocab, 12))


def test_logit_lens_last_layer_is_the_logits(tiny_model):
    tr = trace(tiny_model, None, _ids(TINY.n_vocab, 16))
    assert torch.equal(lens_logits(tr, TINY.n_layer), tr.logits)  # the same modules on the same tensor
    lens = tr.logit_lens(k=3)
    assert lens["layers"] == list(range(TINY.n_layer + 1))
    last = torch.softmax(tr.logits.float(), -1)
    assert lens["top_ids"][-1] == last.topk(3, -1).indices.tolist()
    nxt = torch.tensor(tr.ids[1:])
    assert np.allclose(lens["next_prob"][-1], last[:-1].gather(-1, nxt[:, None])[:, 0].numpy(), atol=1e-7)
    # a middle layer, the long way: LayerNorm with ln_f's parameters, then the tied head
    with torch.no_grad():
        ln = tiny_model.ln_f
        h = torch.nn.functional.layer_norm(tr["resid.1"], (TINY.n_embd,), ln.weight, ln.bias, ln.eps)
        p1 = torch.softmax(h @ tiny_model.wte.weight[: TINY.n_vocab].T, -1)
    assert np.allclose(lens["next_prob"][1], p1[:-1].gather(-1, nxt[:, None])[:, 0].numpy(), atol=1e-6)
    assert lens["top_ids"][1] == p1.topk(3, -1).indices.tolist()


def test_next_token_stats(tiny_model):
    ids = _ids(TINY.n_vocab, 16)
    tr = trace(tiny_model, None, ids, top_k=4)
    s = tr.next_token_stats()
    logp = torch.log_softmax(tr.logits.float(), -1)
    for t in range(15):
        assert s["next_logprob"][t] == pytest.approx(float(logp[t, ids[t + 1]]), abs=1e-6)
        assert s["surprisal_bits"][t] == pytest.approx(-float(logp[t, ids[t + 1]]) / np.log(2), abs=1e-6)
        assert s["next_rank"][t] == int((logp[t] > logp[t, ids[t + 1]]).sum()) + 1
    assert s["top_ids"][3] == logp[3].topk(4).indices.tolist()


def test_direct_logit_attribution_sums_to_the_logit(tiny_model):
    tr = trace(tiny_model, None, _ids(TINY.n_vocab, 16))
    d = tr.direct_logit_attribution()
    n = 2 + TINY.n_layer * (TINY.n_head + 2) + 1
    assert len(d["labels"]) == n and len(d["values"]) == 16
    for t in range(16):
        assert abs(sum(d["values"][t]) - d["logit"][t]) < 1e-4
    # one head's term computed the long way: its piece of the stream, centred, through ln_f's scale
    i, h, t, hs = 1, 2, 5, TINY.head_dim
    with torch.no_grad():
        W = tiny_model.h[i].attn.c_proj.weight[:, h * hs:(h + 1) * hs].double()
        piece = tr[f"h.{i}.attn.z"][h, t].double() @ W.T
        x = tr[f"resid.{TINY.n_layer}"][t].double()
        sigma = (x.var(unbiased=False) + tiny_model.ln_f.eps).sqrt()
        direction = tiny_model.ln_f.weight.double() * tiny_model.wte.weight[tr.ids[t + 1]].double()
        want = float((piece - piece.mean()) @ direction / sigma)
    assert d["values"][t][d["labels"].index(f"h.{i}.attn.head.{h}")] == pytest.approx(want, abs=1e-10)
    one = tr.direct_logit_attribution(position=-1, token=7)
    assert abs(sum(one["values"]) - float(tr.logits[-1, 7])) < 1e-4
    with pytest.raises(ValueError, match="position 16"):
        tr.direct_logit_attribution(position=16)


def test_residual_norms_and_attention_summary(tiny_model):
    ids = _ids(TINY.n_vocab, 16)
    tr = trace(tiny_model, None, ids)
    norms = tr.residual_norms()
    assert norms.shape == (TINY.n_layer + 1, 16)
    assert torch.allclose(norms[1], tr["resid.1"].norm(dim=-1))
    summ = tr.attention_summary()
    P = tr["h.0.attn.probs"]
    assert summ["prev"][0][1] == pytest.approx(float(P[1].diagonal(-1).mean()), abs=1e-6)
    assert summ["first"][0][2] == pytest.approx(float(P[2, :, 0].mean()), abs=1e-6)
    # ids repeat after 8 tokens: query 8 + j (j >= 1) has its induction target at j + 1
    t = 9
    assert ids[t] == ids[1]
    assert summ["induction"][0] is not None
    for i in range(TINY.n_layer):  # against the definition, one (query, key) pair at a time
        P = tr[f"h.{i}.attn.probs"]
        per_query = [[float(sum(P[h, q, j] for j in range(1, q + 1) if ids[j - 1] == ids[q]))
                      for q in range(16) if any(ids[j - 1] == ids[q] for j in range(1, q + 1))]
                     for h in range(TINY.n_head)]
        assert summ["induction"][i] == pytest.approx([sum(r) / len(r) for r in per_query], abs=1e-6)


def test_one_token_has_a_lens_and_stats_with_no_next_token(tiny_model):
    tr = trace(tiny_model, None, [5])
    lens, stats = tr.logit_lens(k=3), tr.next_token_stats()
    assert lens["next_prob"] == [[]] * (TINY.n_layer + 1) and len(lens["top_ids"][0]) == 1
    assert stats["next_rank"] == [] and stats["top_ids"][0] == tr.logits[0].topk(10).indices.tolist()
    assert "lens" in tr.to_json()


def test_ranks_count_only_strictly_higher_tokens():
    model = random_model()
    ids = _ids(TINY.n_vocab, 16)
    with torch.no_grad():  # a token whose embedding is another's scores exactly as high: a tie, not ranked above
        model.wte.weight[7] = model.wte.weight[ids[5]]
    tr = trace(model, None, ids)
    ranks, lens = tr.next_token_stats()["next_rank"], tr.logit_lens()
    with torch.no_grad():
        for layer in range(TINY.n_layer + 1):
            logits = lens_logits(tr, layer)[:-1]  # (T - 1, V)
            target = logits.gather(-1, torch.tensor(ids[1:])[:, None])
            assert lens["next_rank"][layer] == ((logits > target).sum(-1) + 1).tolist()
            assert (logits[4, 7] == target[4, 0]) and lens["next_rank"][layer][4] < TINY.n_vocab
    assert ranks == lens["next_rank"][-1]


def test_report_unembeds_each_layer_and_position_once():
    """Counted through GPT2.lm_head's seam (a wte with its own lm_head is asked for the product): the
    lens unembeds each (block output, position) once, the last layer not at all (it is the logits);
    with an intervention, the clean run's lens unembeds only the layers the intervention reached."""
    from gpt2kit.trace import ablate

    model = random_model()
    ids = _ids(TINY.n_vocab, 12)
    rows: list[int] = []

    class CountingEmbedding(torch.nn.Embedding):  # an embedding that runs its own head (model.HeadEmbedding)
        def lm_head(self, x):
            rows.append(x.reshape(-1, x.shape[-1]).shape[0])
            return torch.nn.functional.linear(x, self.weight)

    wte = CountingEmbedding(*model.wte.weight.shape)
    wte.weight = model.wte.weight
    model.wte = wte
    tr = trace(model, None, ids)
    rows.clear()
    tr.to_json()
    assert sum(rows) == TINY.n_layer * 12
    tr = trace(model, None, ids, interventions=[ablate("h.1.attn.head.2")])  # block 1: resid.2 = logits changes
    rows.clear()
    data = tr.to_json()
    assert sum(rows) == TINY.n_layer * 12  # resid.0 and resid.1 are the intervened run's, bit for bit
    alone = trace(model, None, ids).logit_lens()
    assert data["intervention"]["clean_lens"]["top_ids"] == alone["top_ids"]
    assert np.allclose(data["intervention"]["clean_lens"]["next_prob"], alone["next_prob"], atol=1e-7)
    tr = trace(model, None, ids, interventions=[ablate("h.0.mlp")])  # block 0: resid.1 onwards change
    rows.clear()
    data = tr.to_json()
    assert sum(rows) == TINY.n_layer * 12 + 12
    assert data["intervention"]["clean_lens"]["top_ids"] == alone["top_ids"]


def strong_model():
    """A tiny random model with its matrices scaled up, so one token's change moves the last logits
    well above float noise (the unscaled one's patching differences are ~1e-4: see test_trace_patching)."""
    m = random_model()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return m


def test_patching_with_clean_activations_restores_clean_logits_exactly():
    tiny_model = strong_model()
    clean = _ids(TINY.n_vocab, 12)
    corrupt = list(clean)
    corrupt[3] = (corrupt[3] + 1) % TINY.n_vocab
    tr_clean = trace(tiny_model, None, clean)
    want = tiny_model(torch.tensor([clean])).logits
    for layer in range(TINY.n_layer + 1):
        patches = [(0, layer, p, tr_clean[f"resid.{layer}"][p]) for p in range(12)]
        assert torch.equal(run_with_patches(tiny_model, corrupt, patches), want), layer
    res = patch_residual(tiny_model, clean, corrupt)
    assert res.layers == list(range(TINY.n_layer + 1))
    # before the corrupted token nothing differs; the corrupted token at layer 0 and the last
    # position at the last layer carry everything
    assert all(res.restored[r][p] is None for r in range(len(res.layers)) for p in range(3))
    assert res.restored[0][3] == pytest.approx(1.0, abs=1e-5)
    assert res.restored[-1][-1] == pytest.approx(1.0, abs=1e-5)
    tr = trace(tiny_model, None, clean, patch_from=corrupt, patch_layers="0,2")
    assert tr.patching.layers == [0, 2]
    with pytest.raises(ValueError, match="equal token length"):
        trace(tiny_model, None, clean, patch_from=corrupt[:-1])


def test_selection_records_only_what_was_asked(tiny_model):
    tr = trace(tiny_model, None, _ids(TINY.n_vocab, 10), layers="1", what="probs,mlp_out")
    assert set(tr.names()) == {"h.1.attn.probs", "h.1.mlp.out", "logits", "ln_f", f"resid.{TINY.n_layer}"}
    assert parse_layers("0-1", 2) == (0, 1) and parse_layers("-1", 3) == (2,)
    assert parse_what("attn") == frozenset({"qkv", "scores", "probs", "z", "attn_out"})
    with pytest.raises(ValueError, match="unknown --what value 'bogus'"):
        parse_what("bogus")
    with pytest.raises(ValueError, match="layer 5 is outside"):
        parse_layers("5", 2)
    with pytest.raises(ValueError, match="unknown --layers value 'x'"):
        parse_layers("x", 2)
    with pytest.raises(ValueError, match="over the limit"):
        trace(tiny_model, None, _ids(TINY.n_vocab, 10), max_bytes=1000)
    with pytest.raises(ValueError, match="direct logit attribution needs"):
        tr.direct_logit_attribution()


def test_bad_inputs(tiny_model):
    from gpt2kit.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="empty"):
        trace(tiny_model, Tokenizer.default(), "")
    with pytest.raises(ValueError, match="more than the context n_ctx=64"):
        trace(tiny_model, None, [1] * 65)
    with pytest.raises(ValueError, match="token id 5000 is outside"):
        trace(tiny_model, None, [1, 5000])
    with pytest.raises(ValueError, match="eval"):
        trace(random_model().train(), None, [1, 2])


def test_npz_and_json(tiny_model, tmp_path):
    import json

    tr = trace(tiny_model, None, _ids(TINY.n_vocab, 8))
    tr.save_npz(tmp_path / "t.npz")
    z = np.load(tmp_path / "t.npz")
    assert np.array_equal(z["h.1.attn.probs"], tr["h.1.attn.probs"].numpy())
    assert z["ids"].tolist() == tr.ids
    data = json.loads(json.dumps(tr.to_json()))
    assert data["ids"] == tr.ids and len(data["lens"]["layers"]) == TINY.n_layer + 1


@needs_real_gpt2
def test_real_gpt2_has_its_known_previous_token_and_induction_heads():
    """GPT-2 small: head 4.11 attends to the previous token (Wang et al. 2022, IOI); on a repeated
    random sequence, heads 5.1, 5.5 and 6.9 attend to the token after the earlier copy (Olsson et
    al. 2022). Conservative thresholds: these heads score far above them on the real weights."""
    from helpers import cached_real_gpt2

    from gpt2kit import load_tokenizer

    name = cached_real_gpt2()
    model = load_model(name)
    g = torch.Generator().manual_seed(0)
    half = torch.randint(1000, 20000, (30,), generator=g).tolist()
    tr = trace(model, load_tokenizer(name), half + half, what="probs")
    s = tr.attention_summary()
    assert s["prev"][4][11] > 0.5
    assert max(s["induction"][5][1], s["induction"][5][5], s["induction"][6][9]) > 0.4
