"""gpt2kit.trace patching and attribution patching, against substitution by hand and TransformerLens.

Tolerances: a patched cell's metric equals the corrupted run with the clean tensor substituted by
a hook written here within 1e-6 (float32 logits); TransformerLens's patching utilities on the same
weights, pair and metric within 1e-5; attribution patching equals gradient x difference computed
here with autograd on a hand-hooked network (1e-6) and TransformerLens's
attribution_patch node scores (1e-5).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY, error_lines, hf_from_ours, random_model

from gpt2kit.cli import main
from gpt2kit.config import GPT2Config
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import trace
from gpt2kit.trace.attribution import agreement
from gpt2kit.trace.metrics import Metric, make_metric, one_token, parse_metric
from gpt2kit.trace.patching import patch

L, NH, HS, C = TINY.n_layer, TINY.n_head, TINY.head_dim, TINY.n_embd
CLEAN = [5, 17, 3, 99, 250, 17, 3, 42]
CORRUPT = [5, 17, 3, 400, 250, 17, 3, 42]


def strong(cfg: GPT2Config = TINY):
    """Random weights with the matrices scaled up, so one token's change moves the last logits
    far above float noise (the plain random model's differences are ~1e-4)."""
    m = random_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return m


@pytest.fixture(scope="module")
def model():
    return strong()


def _metric(model) -> Metric:
    with torch.no_grad():
        last = model(torch.tensor([CLEAN, CORRUPT])).logits[:, -1]
    # the clean top-1 against the token the corruption raises most: a difference far from zero
    return Metric("logit-diff", int(last[0].argmax()), int((last[1] - last[0]).argmax()))


def _hand(model, hooks, mt) -> float:
    """The corrupted run with module hooks written here: (module, pre?, fn) -> the metric."""
    handles = [(m.register_forward_pre_hook(fn) if pre else m.register_forward_hook(fn)) for m, pre, fn in hooks]
    try:
        with torch.no_grad():
            return float(mt(model(torch.tensor([CORRUPT])).logits[:, -1])[0])
    finally:
        for h in handles:
            h.remove()


def _clean_tensor(model, module, pre: bool) -> torch.Tensor:
    got = {}
    fn = (lambda m, a: got.setdefault("x", a[0].clone())) if pre else (lambda m, a, o: got.setdefault("x", o.clone()))
    h = module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
    with torch.no_grad():
        model(torch.tensor([CLEAN]))
    h.remove()
    return got["x"][0]  # (T, C)


def test_every_mode_equals_substitution_by_hand(model):
    mt = _metric(model)

    def rows(module, p, pre=False, cols=None):
        clean = _clean_tensor(model, module, pre)

        def sub(x):
            x = x.clone()
            if cols is None:
                x[0, p] = clean[p]
            else:
                sel = slice(None) if p is None else p
                x[0, sel, cols] = clean[sel, cols]
            return x
        if pre:
            return _hand(model, [(module, True, lambda m, a: (sub(a[0]),))], mt)
        return _hand(model, [(module, False, lambda m, a, o: sub(o))], mt)

    h = 2
    heads = slice(h * HS, (h + 1) * HS)
    want = {("resid", 2, 5): rows(model.h[1], 5), ("resid", 0, 3): rows(model.drop, 3),
            ("attn", 1, 5): rows(model.h[1].attn.c_proj, 5), ("mlp", 0, 3): rows(model.h[0].mlp.c_proj, 3),
            ("heads", 1, h): rows(model.h[1].attn.c_proj, None, pre=True, cols=heads),
            ("heads-pos", 1 * NH + h, 6): rows(model.h[1].attn.c_proj, 6, pre=True, cols=heads)}
    for mode in ("resid", "attn", "mlp", "heads", "heads-pos"):
        res = patch(model, [(CLEAN, CORRUPT, mt)], mode=mode)
        assert res.warning is None and res.shown == "restored"
        for (m, r, c), v in want.items():
            if m == mode:
                assert abs(res.metric[r][c] - v) < 1e-6, (mode, r, c)
                assert res.restored[r][c] == pytest.approx((v - res.corrupt_metric) /
                                                           (res.clean_metric - res.corrupt_metric), abs=1e-9)
        assert all(res.metric[r][c] is None for r in range(len(res.rows)) for c in range(len(res.columns))
                   if mode != "heads" and c < 3)  # before the changed token both runs agree: blank, not run


def test_a_tiny_denominator_warns_and_falls_back_to_the_change():
    m = random_model()  # unscaled: the clean and corrupted last logits differ by ~1e-4
    res = patch(m, [(CLEAN, CORRUPT, Metric("logit", 7))], mode="resid")
    assert res.shown == "change" and "amplified noise" in res.warning and "logit of" in res.warning
    assert all(v is None for row in res.restored for v in row)
    # the fallback is stated and exact: patching the last position of the last layer is the clean run
    assert res.change[-1][-1] == pytest.approx(res.clean_metric - res.corrupt_metric, abs=1e-6)
    page = trace(m, None, CLEAN, patch_from=CORRUPT, answer=7).to_html()
    assert "amplified noise" in page


@pytest.fixture(scope="module")
def tl_bridge(tmp_path_factory, model):
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import GPT2TokenizerFast

    d = tmp_path_factory.mktemp("tl")
    hf = hf_from_ours(model)
    hf.save_pretrained(d)
    Tokenizer.default().save(d)
    GPT2TokenizerFast(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt")).save_pretrained(d)
    br = TransformerBridge.boot_transformers(str(d), hf_model=hf, tokenizer=GPT2TokenizerFast.from_pretrained(d),
                                             device="cpu")
    with torch.no_grad():
        assert (br(torch.tensor([CLEAN])) - model(torch.tensor([CLEAN])).logits).abs().max() < 1e-4
    return br


def test_names_and_aliases_hold_transformer_lens_activations(model, tl_bridge):
    from gpt2kit.trace.points import ALIASES, resolve

    tr = trace(model, None, CLEAN)
    with torch.no_grad():
        _, cache = tl_bridge.run_with_cache(torch.tensor([CLEAN]))
    checked = 0
    for alias in ALIASES:
        if not alias.startswith(("blocks", "hook", "ln_final")):
            continue
        for i in range(L if "{i}" in alias else 1):
            tl_name = alias.replace("{i}", str(i))
            ours = tr[resolve(tl_name, L, NH)[0]]
            theirs = cache[tl_name][0]
            if theirs.dim() == 3 and ours.dim() == 3 and theirs.shape[1] == NH:  # (T, nh, hs) -> (nh, T, hs)
                theirs = theirs.transpose(0, 1)
            theirs = theirs.masked_fill(torch.isinf(ours), 0) if "scores" in tl_name else theirs
            ours = ours.masked_fill(torch.isinf(ours), 0)
            assert ours.shape == theirs.shape, tl_name
            assert (ours - theirs).abs().max() < 1e-4, tl_name
            checked += 1
    assert checked >= 14 * L


def test_exact_patching_equals_transformer_lens(model, tl_bridge):
    from transformer_lens import patching as tlp

    mt = _metric(model)
    with torch.no_grad():
        _, clean_cache = tl_bridge.run_with_cache(torch.tensor([CLEAN]))

    def metric(logits):
        return logits[0, -1, mt.answer] - logits[0, -1, mt.wrong]

    corrupt = torch.tensor([CORRUPT])
    for mode, fn in (("resid", "get_act_patch_resid_pre"), ("attn", "get_act_patch_attn_out"),
                     ("mlp", "get_act_patch_mlp_out"), ("heads", "get_act_patch_attn_head_out_all_pos"),
                     ("heads-pos", "get_act_patch_attn_head_out_by_pos")):
        with torch.no_grad():
            theirs = getattr(tlp, fn)(tl_bridge, corrupt, clean_cache, metric).double()  # [L, T] / [L, nh] / [L, T, nh]
        res = patch(model, [(CLEAN, CORRUPT, mt)], mode=mode)
        ours = torch.tensor([[res.corrupt_metric if v is None else v for v in row] for row in res.metric],
                            dtype=torch.float64)
        if mode == "resid":
            ours = ours[:L]  # TL's resid_pre covers H(0) .. H(L-1)
        if mode == "heads-pos":
            theirs = theirs.permute(0, 2, 1).reshape(L * NH, -1)  # rows block.head, columns positions
        assert (ours - theirs).abs().max() < 1e-5, mode


def test_attribution_patching_equals_gradient_times_difference(model, tl_bridge):
    mt = _metric(model)
    res = patch(model, [(CLEAN, CORRUPT, mt)], mode="heads-pos", attribution=True)
    est = res.attribution["estimate"]  # (L * nh, T)
    # by hand: z of every block as the c_proj inputs of the corrupted run, gradient by autograd
    zs, handles = {}, []
    for i in range(L):
        def grab(mod, args, i=i):
            y = args[0].clone()
            zs[i] = y
            return (y,)
        handles.append(model.h[i].attn.c_proj.register_forward_pre_hook(grab))
    m = mt(model(torch.tensor([CORRUPT])).logits[:, -1])[0]
    grads = torch.autograd.grad(m, [zs[i] for i in range(L)])
    for h in handles:
        h.remove()
    for i in range(L):
        z_clean = _clean_tensor(model, model.h[i].attn.c_proj, pre=True)  # (T, C)
        diff = (z_clean - zs[i][0].detach()).double() * grads[i][0].double()  # (T, C)
        want = diff.view(len(CLEAN), NH, HS).sum(-1)  # (T, nh)
        for h in range(NH):
            for p in range(len(CLEAN)):
                assert abs(est[i * NH + h][p] - float(want[p, h])) < 1e-6
    assert all(p.grad is None for p in model.parameters())  # torch.autograd.grad: no .grad written
    # and TransformerLens's own attribution patching, node by node
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    out = attribution_patch(tl_bridge, torch.tensor([CLEAN]), torch.tensor([CORRUPT]),
                            lambda logits: logits[0, -1, mt.answer] - logits[0, -1, mt.wrong])
    n = 0
    for node, score in out.node_scores.items():
        if node.kind == "attn_head_out":
            assert abs(est[node.layer * NH + node.head][node.position] - score) < 1e-5, node
            n += 1
    assert n == L * NH * len(CLEAN)
    ag = res.attribution["agreement"]
    assert ag["cells"] > 0 and -1 <= ag["correlation"] <= 1


def test_agreement():
    a = agreement([[1.0, 2.0, None], [3.0, -1.0, 0.5]], [[1.1, 2.0, 5.0], [2.9, -0.8, None]])
    assert a["cells"] == 4 and a["correlation"] > 0.99 and a["sign_agreement"] == 1.0
    assert a["max_abs_difference"] == pytest.approx(0.2)


# GPT-2's vocabulary on a tiny network, so texts and answer words tokenize as in GPT-2.
BIG_VOCAB = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2)
PAIRS = [
    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupt": "When Mary and John went to the store, Mary gave a drink to", "answer": " Mary", "wrong": " John"},
    {"clean": "When Tom and Anna went to the park, Anna gave a ball to",
     "corrupt": "When Tom and Anna went to the park, Tom gave a ball to", "answer": " Tom", "wrong": " Anna"},
]


def test_metric_tokens_and_specs():
    tok = Tokenizer.default()
    assert one_token(tok, " Mary", "answer") == tok.encode(" Mary")[0]
    with pytest.raises(ValueError, match=r"' Mary Ann' is 2 tokens, not one: \[\d+, \d+\] = \" Mary\", \" Ann\""):
        one_token(tok, " Mary Ann", "answer")
    with pytest.raises(ValueError, match="begin with a space"):
        one_token(tok, "Mississippi", "answer")
    assert parse_metric("logit-diff: Mary, John").tokens == (" Mary", " John")
    with pytest.raises(ValueError, match="logit-diff names 2 tokens, got 1"):
        parse_metric("logit-diff: Mary")
    with pytest.raises(ValueError, match="unknown metric 'kl'"):
        parse_metric("kl")
    mt = make_metric(parse_metric("prob: Paris"), tok)
    x = torch.zeros(1, 50257)
    x[0, mt.answer] = 3.0
    assert float(mt(x)[0]) == pytest.approx(float(torch.softmax(x.double(), -1)[0, mt.answer]))
    loss = make_metric(parse_metric("loss"), tok, answer=" Paris")
    assert float(loss(x)[0]) == pytest.approx(-float(torch.log_softmax(x.double(), -1)[0, mt.answer]))


def test_pairs_average_with_spread():
    m = strong(BIG_VOCAB)
    tok = Tokenizer.default()
    tr = trace(m, tok, PAIRS[0]["clean"], pairs=PAIRS, patch_mode="heads")
    res = tr.patching
    assert res.n_pairs == 2 and res.rows == [f"h.{i}" for i in range(2)] and len(res.columns) == 4
    singles = [trace(m, tok, p["clean"], pairs=[p], patch_mode="heads").patching for p in PAIRS]
    for r in range(2):
        for c in range(4):
            ch = [s.change[r][c] for s in singles]
            assert res.change[r][c] == pytest.approx(sum(ch) / 2, abs=1e-9)
            if res.restored[r][c] is not None:
                fr = [s.restored[r][c] for s in singles]
                assert res.restored[r][c] == pytest.approx(sum(fr) / 2, abs=1e-9)
                assert res.spread[r][c] == pytest.approx(abs(fr[0] - fr[1]) / 2, abs=1e-9)
    assert "logit difference" in res.metric_name
    assert trace(m, tok, None, pairs=PAIRS).ids == tok.encode(PAIRS[0]["clean"])  # no text: the first clean one


def test_bad_pairs_name_the_line(tmp_path, capsys):
    from gpt2kit import save_model

    d = tmp_path / "m"
    save_model(random_model(BIG_VOCAB), d)
    good = json.dumps(PAIRS[0])
    cases = [
        ([good, json.dumps({**PAIRS[0], "corrupt": "When Mary and John went to the store, Mary Ann gave a drink to"})],
         [], "line 2: clean has 14 tokens, corrupt 15"),
        ([good, json.dumps({**PAIRS[0], "clean": "A short one", "corrupt": "A short two"})], [],
         "line 2: 3 tokens, "),
        ([good, "{not json"], [], "line 2: not JSON"),
        ([json.dumps({**PAIRS[0], "answer": " Mary Ann"})], [], "line 1: answer ' Mary Ann' is 2 tokens"),
        ([good], ["--metric", "prob: Mary Ann"], "answer ' Mary Ann' is 2 tokens, not one"),
        ([good], ["--patch", "neurons"], "unknown --patch 'neurons'"),
    ]
    for lines, extra, needle in cases:
        f = tmp_path / "pairs.jsonl"
        f.write_text("\n".join(lines) + "\n")
        rc = main(["trace", "--model", str(d), "--pairs", str(f), "--json", str(tmp_path / "x.json"), *extra])
        err = capsys.readouterr().err
        assert rc == 1 and needle in err and len(error_lines(err)) == 1, (needle, err)
        assert not (tmp_path / "x.json").exists()


def test_cli_pairs_heads_with_attribution(tmp_path, capsys):
    from gpt2kit import save_model

    d = tmp_path / "m"
    save_model(strong(BIG_VOCAB), d)
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    js = tmp_path / "t.json"
    rc = main(["trace", "--model", str(d), "--pairs", str(f), "--patch", "heads-pos", "--metric", "logit-diff",
               "--attribution", "--json", str(js)])
    assert rc == 0, capsys.readouterr().err
    P = json.loads(js.read_text())["patching"]
    assert P["mode"] == "heads-pos" and P["n_pairs"] == 2 and len(P["rows"]) == 2 * 4
    assert len(P["attribution"]["estimate"]) == 8 and P["attribution"]["agreement"]["cells"] > 0
