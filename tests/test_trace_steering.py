"""Interventions while generating and scoring (gpt2kit.trace.steering), against the uncached network
re-run with hooks written here at every step, TransformerLens's generate with the same hooks, and an
SAE clamp computed by its formula (sae-lens's use_error_term; tests/test_trace_sae.py compares clamps
with sae-lens's HookedSAETransformer itself).

Tolerances: tokens equal; logits within 1e-4 of TransformerLens and of the uncached re-run (float32,
a cached and an uncached pass); a clamp of every feature to its own value within 1e-5; plain rows
batched beside intervened ones equal to an engine without interventions bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TINY, error_lines, greedy_with_logits, random_model
from safetensors.torch import save_file

from gpt2kit import SamplingSettings, generate, generate_stream, stream_text
from gpt2kit.cli import main
from gpt2kit.config import GPT2Config
from gpt2kit.engine import Engine, RowKey
from gpt2kit.score import score_tokens
from gpt2kit.trace import Interventions, ablate, clamp, replace, run_with_hooks, steer
from gpt2kit.trace.sae import load_sae
from gpt2kit.trace.steering import applied, parse_spec, prepare

C, NH, HS = TINY.n_embd, TINY.n_head, TINY.head_dim
PROMPTS = [[5, 17, 3, 99], [7, 8, 9, 10, 11, 12, 13]]
GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=12, stop_token_ids=())
F = 48


CFG = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=C, n_head=NH, n_layer=TINY.n_layer)  # GPT-2's tokenizer fits


@pytest.fixture(scope="module")
def model():
    m = random_model(CFG)
    with torch.no_grad():  # larger weights, so an intervention moves the greedy tokens
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return m


VEC = torch.randn(C, generator=torch.Generator().manual_seed(1)) * 3


def _tokens_mask(T: int, n_prompt: int, on: str) -> torch.Tensor:
    sel = torch.zeros(T, dtype=torch.bool)
    if on in ("both", "prompt"):
        sel[:n_prompt] = True
    if on in ("both", "generated"):
        sel[n_prompt:] = True
    return sel


def _by_hand(kind: str):
    """(name, fn(x, sel)) written here: what the intervention does to the tensor at the selected tokens."""
    if kind == "steer":
        def add(x, sel):
            x = x.clone()
            x[:, sel] += 2.0 * VEC
            return x
        return "h.1.resid", add

    def zero(x, sel):  # (B, nh, T, hs)
        x = x.clone()
        x[:, 2, sel] = 0
        return x
    return "h.1.attn.z", zero


def _uncached(model, prompt, kind, on, n):
    """Greedy by re-running the whole sequence with the hand-written hook at every step."""
    name, fn = _by_hand(kind)
    seq, logits = list(prompt), []
    for _ in range(n):
        lg = run_with_hooks(model, seq, [(name, lambda x: fn(x, _tokens_mask(x.shape[-2 if x.dim() == 4 else 1],
                                                                            len(prompt), on)))])[0, -1]
        logits.append(lg)
        seq.append(int(lg.argmax()))
    return seq[len(prompt):], torch.stack(logits)


IVS = {"steer": steer("h.1.resid", VEC, 2.0), "ablate": ablate("h.1.attn.head.2")}


@pytest.mark.parametrize("on", ["both", "prompt", "generated"])
@pytest.mark.parametrize("kind", ["steer", "ablate"])
def test_generation_equals_the_uncached_run_with_hooks(model, kind, on):
    got = generate(model, PROMPTS, GREEDY, interventions=Interventions((IVS[kind],), on))
    for c, p in zip(got, PROMPTS, strict=True):
        assert c.tokens == _uncached(model, p, kind, on, GREEDY.max_new_tokens)[0]
    if kind == "steer" and on != "generated":  # the test would see a no-op
        assert [c.tokens for c in got] != [c.tokens for c in generate(model, PROMPTS, GREEDY)]


def test_stream_and_score_take_them(model, tmp_path):
    from gpt2kit.tokenizer import Tokenizer

    tok = Tokenizer.default()
    text = "".join(stream_text(model, tok, "Hello there", GREEDY, interventions=[IVS["steer"]]))
    want = generate(model, "Hello there", GREEDY, tokenizer=tok, interventions=[IVS["steer"]])[0].text
    assert text == want
    steps = list(generate_stream(model, PROMPTS, GREEDY, interventions=[IVS["ablate"]]))
    assert [s.tokens[0] for s in steps] == generate(model, PROMPTS, GREEDY, interventions=[IVS["ablate"]])[0].tokens
    toks = [3, 99, 250, 17]
    lps = score_tokens(model, toks, interventions=[IVS["steer"]])
    name, fn = _by_hand("steer")
    lg = run_with_hooks(model, [50256, *toks], [(name, lambda x: fn(x, torch.ones(5, dtype=bool)))])
    want = torch.log_softmax(lg[0, :-1], -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lps), want, atol=1e-5)


def test_rows_with_their_own_interventions_share_a_step(model):
    """Rows with different interventions and plain rows in one engine: each equals its run alone; the
    plain rows' log-probs equal an engine without interventions bit for bit."""
    edits = [prepare(model, [IVS["steer"]]), None, prepare(model, [IVS["ablate"]]), None]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]

    def run(rows):
        eng = Engine(model, max_batch=len(rows), pack_weights=False)
        made = [eng.new_row(p, GREEDY, logprobs=2, key=RowKey(i), edits=e) for i, (p, e) in enumerate(rows)]
        eng.submit(made)
        out = {i: [] for i in range(len(rows))}
        while eng.has_work:
            for ev in eng.step():
                out[ev.row.key.index].append((ev.token, ev.logprob, ev.top_logprobs))
        return [out[i] for i in range(len(rows))]

    together = run(list(zip(prompts, edits, strict=True)))
    plain = run([(p, None) for p in prompts])
    for i, (p, e) in enumerate(zip(prompts, edits, strict=True)):
        alone = run([(p, e)])[0]
        assert [t for t, _, _ in together[i]] == [t for t, _, _ in alone]
        if e is None:
            assert together[i] == plain[i]  # bit for bit: tokens, log-probs and alternatives
    assert [t for t, _, _ in together[0]] != [t for t, _, _ in plain[0]]


def test_hooks_never_outlive_a_call(model):
    def boom(x):
        raise RuntimeError("in the hook")

    with pytest.raises(RuntimeError, match="in the hook"):
        run_with_hooks(model, [1, 2, 3], [("h.0.mlp", boom)])
    with pytest.raises(RuntimeError, match="in the hook"):
        with applied(model, prepare(model, [IVS["steer"]]), 3):
            run_with_hooks(model, [1, 2, 3], [("h.0.attn", boom)])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_refusals_name_the_intervention(model):
    for ivs, needle in (([ablate("h.1.mlp", mean=True)], "mean ablation"),
                        ([ablate("h.1.mlp", positions=[2])], "positions (@)"),
                        ([steer("h.1.resid", np.ones(C + 1))], f"takes ({C},)"),
                        ([ablate("embed.pos")], "resid.0"),
                        ([ablate("h.1.attn.scores")], "derived"),
                        ([ablate("h.9.mlp")], "outside the model's blocks")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            generate(model, PROMPTS, GREEDY, interventions=ivs)
    with pytest.raises(ValueError, match="intervene on 'everywhere'"):
        generate(model, PROMPTS, GREEDY, interventions=Interventions((IVS["steer"],), "everywhere"))
    with pytest.raises(ValueError, match="speculative"):
        generate(model, PROMPTS, SamplingSettings(temperature=0.0, prompt_lookup=2), interventions=[IVS["steer"]])
    with pytest.raises(ValueError, match="beam"):
        generate(model, PROMPTS, SamplingSettings(num_beams=2), interventions=[IVS["steer"]])


# --- SAE clamps ----------------------------------------------------------------------------------
def _sae_dir(d, hook="blocks.1.hook_resid_pre", d_in=C, center=False):
    g = torch.Generator().manual_seed(3)
    w = {"W_enc": torch.randn(d_in, F, generator=g) * 0.3, "b_enc": torch.randn(F, generator=g) * 0.1,
         "W_dec": torch.randn(F, d_in, generator=g) * 0.3, "b_dec": torch.randn(d_in, generator=g) * 0.1}
    d.mkdir(parents=True, exist_ok=True)
    save_file(w, str(d / "sae_weights.safetensors"))
    meta = {"hook_name": hook, "model_from_pretrained_kwargs": {"center_writing_weights": center}}
    (d / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": F, "architecture": "standard",
                                            "normalize_activations": "none", "metadata": meta}))
    return w


def _clamped_by_formula(w, x, feats, center):
    """sae-lens's hooked SAE with use_error_term: decode(clamped) + (x_in - decode(f)), put back."""
    mu = x.mean(-1, keepdim=True) if center else 0
    xin = x - mu
    f = torch.relu((xin - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    g = f.clone()
    for k, v in feats:
        g[..., k] = v
    out = g @ w["W_dec"] + w["b_dec"] + (xin - (f @ w["W_dec"] + w["b_dec"]))
    return out + mu


@pytest.mark.parametrize("center", [False, True])
def test_a_clamp_equals_the_formula_while_generating(model, tmp_path, center):
    w = _sae_dir(tmp_path / "sae", center=center)
    feats = ((3, 6.0), (11, 0.0))
    got = generate(model, PROMPTS, GREEDY, interventions=[clamp(tmp_path / "sae", dict(feats))])
    for c, p in zip(got, PROMPTS, strict=True):
        seq = list(p)
        for _ in range(GREEDY.max_new_tokens):
            lg = run_with_hooks(model, seq, [("resid.1", lambda x: _clamped_by_formula(w, x, feats, center))])
            seq.append(int(lg[0, -1].argmax()))
        assert c.tokens == seq[len(p):]


@pytest.mark.parametrize("hook", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"])
def test_clamping_every_feature_to_its_own_value_changes_nothing(model, tmp_path, hook):
    _sae_dir(tmp_path / "sae", hook=hook)
    sae = load_sae(tmp_path / "sae", TINY.n_layer, TINY.n_head)
    ids = [42]
    got = {}

    def keep(x):
        got["x"] = x.clone()

    plain = run_with_hooks(model, ids, [(sae.name, keep)])
    f = sae.features(got["x"])[0, 0]  # (F,) at the one position
    assert (f > 0).any()
    edits = prepare(model, [clamp(sae, {i: float(v) for i, v in enumerate(f)})])
    with applied(model, edits, 1):
        out = model(torch.tensor([ids])).logits
    assert (out - plain).abs().max() < 1e-5
    with applied(model, prepare(model, [clamp(sae, {int(f.argmax()): 50.0})]), 1):
        moved = model(torch.tensor([ids])).logits
    assert (moved - plain).abs().max() > 1e-2  # the check above can fail


def test_clamp_refusals(model, tmp_path):
    _sae_dir(tmp_path / "sae")
    with pytest.raises(ValueError, match=f"feature {F} is outside"):
        prepare(model, [clamp(tmp_path / "sae", {F: 1.0})])
    _sae_dir(tmp_path / "wide", d_in=C + 2)
    with pytest.raises(ValueError, match="another model"):
        prepare(model, [clamp(tmp_path / "wide", {0: 1.0})])


# --- request specs and the command line -----------------------------------------------------------
def test_request_specs_name_server_side_vectors_only(model, tmp_path):
    _sae_dir(tmp_path / "sae")
    vectors = {"love": VEC.numpy()}
    saes = {"res1": load_sae(tmp_path / "sae", TINY.n_layer, TINY.n_head)}
    iv = parse_spec("h.1.resid:love*2", vectors, saes)
    assert iv.kind == "add" and iv.scale == 2.0 and iv.name == "h.1.resid"
    assert parse_spec("h.1.attn.head.2", vectors, saes).kind == "zero"
    assert parse_spec("clamp:res1:3=6,11=0", vectors, saes).features == ((3, 6.0), (11, 0.0))
    for spec, needle in (("h.1.resid:/etc/passwd*2", "names a file"), ("h.1.resid:v.npy", "names a file"),
                         ("h.1.resid:hate", "unknown vector 'hate'"), ("clamp:x:1=2", "unknown SAE 'x'"),
                         ("clamp:/tmp/sae:1=2", "names a file"), ("clamp:res1:3", "FEATURE=VALUE"),
                         ("h.1.resid:love*x", "scale"), ("h.1.mlp:mean", "mean ablation"), ("", "non-empty")):
        with pytest.raises(ValueError, match=needle):
            parse_spec(spec, vectors, saes)


def test_cli_generate_and_score_with_interventions(model, tmp_path, capsys):
    from gpt2kit import save_model
    from gpt2kit.tokenizer import Tokenizer

    d = tmp_path / "m"
    save_model(model, d)
    vec = tmp_path / "v.npy"
    np.save(vec, VEC.numpy())
    tok = Tokenizer.default()
    for on in ("both", "prompt"):
        argv = ["generate", "--model", str(d), "Hello there", "--greedy", "--max-new-tokens", "8", "--json",
                "--ignore-eot", "--steer", f"h.1.resid:{vec}*2", "--ablate", "h.1.attn.head.2", "--intervene-on", on]
        assert main(argv) == 0, capsys.readouterr().err
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
        ivs = Interventions((steer("h.1.resid", VEC, 2.0), ablate("h.1.attn.head.2")), on)
        want = generate(model, "Hello there", SamplingSettings(temperature=0.0, max_new_tokens=8, stop_token_ids=()),
                        tokenizer=tok, interventions=ivs)[0].tokens
        assert got == want
    text = tmp_path / "t.txt"
    text.write_text("Hello there, friend")
    _sae_dir(tmp_path / "sae")
    assert main(["score", str(text), "--model", str(d), "--json", "--sae", str(tmp_path / "sae"),
                 "--clamp", "3=6"]) == 0
    got = json.loads(capsys.readouterr().out)["logprobs"]
    want = score_tokens(model, tok.encode("Hello there, friend"), interventions=[clamp(tmp_path / "sae", {3: 6.0})])
    assert got == pytest.approx(want, abs=1e-6)
    for argv, needle in ((["--clamp", "3=6"], "give --sae DIR"), (["--steer", "h.1.resid:nope.npy"], "nope.npy"),
                         (["--replace", f"h.1.mlp.pre:{vec}"], "takes (128,)"), (["--ablate", "h.1.mlp:mean"], "mean")):
        assert main(["generate", "--model", str(d), "Hi", "--max-new-tokens", "2", *argv]) == 1
        err = error_lines(capsys.readouterr().err)
        assert len(err) == 1 and needle in err[0], err


def test_replace_while_generating(model):
    value = torch.randn(NH, HS)
    got = generate(model, PROMPTS[:1], GREEDY, interventions=[replace("h.0.attn.v", value)])[0].tokens

    def fn(x):  # (B, nh, T, hs)
        x = x.clone()
        x[:] = value[None, :, None]
        return x
    seq = list(PROMPTS[0])
    for _ in range(GREEDY.max_new_tokens):
        seq.append(int(run_with_hooks(model, seq, [("h.0.attn.v", fn)])[0, -1].argmax()))
    assert got == seq[len(PROMPTS[0]):]


# --- TransformerLens: the same hooks during its generate ------------------------------------------
@pytest.fixture(scope="module")
def tl_pair(tmp_path_factory):
    """A varied random model and TransformerLens's bridge over the same weights (converted through
    transformers)."""
    pytest.importorskip("transformer_lens")
    from helpers import hf_from_ours, varied_model
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import GPT2TokenizerFast

    from gpt2kit.tokenizer import Tokenizer

    m = varied_model()
    d = tmp_path_factory.mktemp("tl")
    hf = hf_from_ours(m)
    hf.save_pretrained(d)
    Tokenizer.default().save(d)
    GPT2TokenizerFast(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt")).save_pretrained(d)
    br = TransformerBridge.boot_transformers(str(d), hf_model=hf, tokenizer=GPT2TokenizerFast.from_pretrained(d),
                                             device="cpu")
    return m, br


def _tl_with_logits(br, prompt, hooks, n):
    """TransformerLens's greedy generate with fwd_hooks on. Its KV-cached generate differs from its own
    uncached one on this model even without hooks (its bridge's cache path, not the hooks), so the
    reference is its generate without the cache: every step re-runs the sequence through the hooks."""
    with br.hooks(fwd_hooks=hooks):
        out = br.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, stop_at_eos=False,
                          use_past_kv_cache=False, verbose=False, return_type="tokens", output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


STEER = torch.randn(C, generator=torch.Generator().manual_seed(7)) * 2


def test_steering_and_ablation_equal_transformer_lens_generate(tl_pair, tmp_path):
    model, br = tl_pair
    prompt, n = [5, 17, 3, 99], 32

    def add(x, hook):
        return x + 3.0 * STEER

    def zero_head(x, hook):  # (B, T, nh, hs)
        x = x.clone()
        x[:, :, 2] = 0
        return x

    w = _sae_dir(tmp_path / "sae")

    def sae_clamp(x, hook):
        return _clamped_by_formula(w, x, ((3, 6.0),), False)

    cases = [([steer("h.1.resid", STEER, 3.0)], [("blocks.1.hook_resid_pre", add)]),
             ([ablate("h.1.attn.head.2")], [("blocks.1.attn.hook_z", zero_head)]),
             ([clamp(tmp_path / "sae", {3: 6.0})], [("blocks.1.hook_resid_pre", sae_clamp)])]
    plain = generate(model, [prompt], SamplingSettings(temperature=0.0, max_new_tokens=n, stop_token_ids=()))[0]
    for ours_ivs, tl_hooks in cases:
        toks, logits = greedy_with_logits(model, prompt, ours_ivs, n)
        want, want_logits = _tl_with_logits(br, prompt, tl_hooks, n)
        assert toks == want, ours_ivs
        assert (logits - want_logits).abs().max() < 1e-4
        assert toks != plain.tokens  # each intervention changes the text: the comparison can fail
