"""gpt2kit.trace SAEs in SAELens's format: equal to sae-lens's own encode/decode (1e-5, float32), and a
clamp while generating equal to sae-lens's HookedSAETransformer with use_error_term (tokens over 32
greedy steps, each step's logits within 1e-4).

sae-lens 6 needs transformer-lens < 4, which cannot share an environment with the test extra's 4.3,
so sae-lens runs in a subprocess (tests/sae_lens_ref.py) with tests/sae-lens.txt's pinned sae-lens and
transformer-lens 3 ahead on its path (the README's test command installs them, --no-deps, into the
venv's sae-lens/); it skips only where neither that nor an importable sae-lens is there. The format
checks and bad-input tests build SAELens-format files by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, error_lines, hf_from_ours, random_model
from safetensors.torch import load_file, save_file

from gpt2kit.cli import main
from gpt2kit.trace import trace
from gpt2kit.trace.sae import activations, load_sae

C, NH, HS, L = TINY.n_embd, TINY.n_head, TINY.head_dim, TINY.n_layer
IDS = [5, 17, 3, 99, 250, 17, 3, 42, 7, 600]
F = 48


def _write(d, *, hook="blocks.1.hook_resid_pre", d_in=C, arch="standard", extra=None, seed=0, meta=None, **cfg):
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(d_in, F, generator=g) * 0.3, "b_enc": torch.randn(F, generator=g) * 0.1,
         "W_dec": torch.randn(F, d_in, generator=g) * 0.3, "b_dec": torch.randn(d_in, generator=g) * 0.1,
         **(extra or {})}
    d.mkdir(parents=True, exist_ok=True)
    save_file(w, str(d / "sae_weights.safetensors"))
    body = {"d_in": d_in, "d_sae": F, "architecture": arch, "apply_b_dec_to_input": True,
            "normalize_activations": "none",
            "metadata": {"hook_name": hook, "sae_lens_version": "6.0.0", **(meta or {})}, **cfg}
    (d / "cfg.json").write_text(json.dumps(body))
    return w


def test_standard_sae_by_its_formula(tiny_model, tmp_path):
    w = _write(tmp_path / "sae")
    tr = trace(tiny_model, None, IDS, sae=tmp_path / "sae")
    x = tr["resid.1"]  # blocks.1.hook_resid_pre = H(1)
    f = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    v = tr.sae_features()
    assert v["name"] == "resid.1" and v["l0"] == (f > 0).sum(-1).tolist()
    top = f.topk(5, dim=-1)
    assert v["top_ids"] == top.indices.tolist()
    assert torch.allclose(torch.tensor(v["top_acts"]), top.values, atol=1e-6)
    rec = f @ w["W_dec"] + w["b_dec"]
    err = (x - rec).pow(2).sum(-1)
    assert v["mse"] == pytest.approx(float(err.mean() / C), rel=1e-5)
    assert v["fve"] == pytest.approx(float(1 - err.sum() / (x - x.mean(0)).pow(2).sum()), rel=1e-5)
    peak = f.max(0).values
    assert v["features"][0] == int(peak.argmax())
    assert v["feature_tokens"][0][0][0] == int(f[:, v["features"][0]].argmax())
    data = tr.to_json()
    assert data["sae"]["hook_name"] == "blocks.1.hook_resid_pre"
    assert "panel-sae" in tr.to_html()


CENTRE = {"model_from_pretrained_kwargs": {"center_writing_weights": True}}


def _relu_features(x, w):
    return torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])


def test_centred_writing_weights_centre_what_the_sae_reads(tiny_model, tmp_path):
    """center_writing_weights (SAELens 6: metadata.model_from_pretrained_kwargs; earlier: top level) means
    the SAE was trained on a stream with each position's mean over the width removed: at the residual
    and the attention/MLP outputs only (hook_z and the MLP's hidden units are what they were)."""
    tr = trace(tiny_model, None, IDS)
    x = tr["resid.1"]
    centred = x - x.mean(-1, keepdim=True)
    w = _write(tmp_path / "v6", meta=CENTRE)
    sae = load_sae(tmp_path / "v6", L, NH)
    assert sae.center_writing_weights and sae.centres
    assert torch.allclose(sae.features(x), _relu_features(centred, w), atol=1e-6)
    assert not torch.allclose(sae.features(x), _relu_features(x, w), atol=1e-3)  # centring matters here
    v = trace(tiny_model, None, IDS, sae=sae).sae_features()
    assert v["centred"] and v["l0"] == (_relu_features(centred, w) > 0).sum(-1).tolist()
    rec = _relu_features(centred, w) @ w["W_dec"] + w["b_dec"]
    assert v["mse"] == pytest.approx(float((centred - rec).pow(2).sum(-1).mean() / C), rel=1e-5)
    # a batch of inputs (what a hook during generation sees) reads each row the same way
    assert torch.allclose(sae.features(torch.stack([x, 2 * x])), torch.stack([sae.features(x), sae.features(2 * x)]))
    # SAELens before 6: the training config at the top level, hook_point for hook_name
    old = tmp_path / "v5"
    _write(old, meta=CENTRE)
    _edit(old / "cfg.json", lambda c: {**{k: v for k, v in c.items() if k != "metadata"},
                                       "hook_point": "blocks.1.hook_resid_pre", **CENTRE})
    assert load_sae(old, L, NH).centres and torch.equal(load_sae(old, L, NH).features(x), sae.features(x))
    # said false, or not said: the raw stream
    for meta in ({"model_from_pretrained_kwargs": {"center_writing_weights": False}}, {}):
        _write(tmp_path / "raw", meta=meta)
        assert torch.allclose(load_sae(tmp_path / "raw", L, NH).features(x), _relu_features(x, w), atol=1e-6)
    # where the stream's mean does not reach: the heads' z (side by side) is read as it is
    _write(tmp_path / "z", hook="blocks.1.attn.hook_z", meta=CENTRE)
    zsae = load_sae(tmp_path / "z", L, NH)
    z = tr["h.1.attn.z"].transpose(0, 1).reshape(len(IDS), C)
    assert not zsae.centres and torch.allclose(zsae.features(tr["h.1.attn.z"]), _relu_features(z, w), atol=1e-6)


def test_bad_saes_say_what_is_wrong(tiny_model, tmp_path, capsys):
    from gpt2kit import save_model

    cases = {
        "wide": (dict(d_in=C + 1), "the SAE's d_in is 33, but 'resid.1' is 32 wide"),
        "nowhere": (dict(hook="blocks.9.hook_resid_pre"), "is no point of this model"),
        "unknown": (dict(hook="blocks.1.hook_resid_prefix"), "is no point of this model"),
        "gated": (dict(arch="gated"), "architecture 'gated' is not supported"),
        "topk": (dict(arch="topk"), "a topk SAE needs k"),
        "whiten": (dict(normalize_activations="covariance_whitening"), "normalize_activations 'covariance_whitening'"),
    }
    for name, (kw, _) in cases.items():
        _write(tmp_path / name, **kw)
    (tmp_path / "empty").mkdir()
    cases["empty"] = ({}, "no cfg.json")
    d = tmp_path / "m"
    save_model(tiny_model, d)
    for name, (_, needle) in cases.items():
        with pytest.raises(ValueError) as e:
            trace(tiny_model, None, IDS, sae=tmp_path / name)
        assert needle in str(e.value), (name, str(e.value))
        rc = main(["trace", "--model", str(d), "The the, a.", "--json", str(tmp_path / "x.json"),
                   "--sae", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert rc == 1 and needle in err and len(error_lines(err)) == 1, (name, err)
        assert not (tmp_path / "x.json").exists()
    # a hook point the selection left out
    _write(tmp_path / "mlp", hook="blocks.0.hook_mlp_out")
    with pytest.raises(ValueError, match="did not record"):
        trace(tiny_model, None, IDS, sae=tmp_path / "mlp", what="resid")


def _edit(path, fn) -> None:
    """Rewrite a JSON file through fn(data) -> data."""
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _weights(d, **changes) -> None:
    w = load_file(str(d / "sae_weights.safetensors"))
    save_file({**w, **changes}, str(d / "sae_weights.safetensors"))


def _bad_files(tmp_path) -> dict[str, tuple[object, list[str]]]:
    """name -> (the file the message must name, what else it must say), each an SAE broken one way."""
    cases: dict[str, tuple[object, list[str]]] = {}

    def case(name, fix, file, *needles, **kw):
        d = tmp_path / name
        _write(d, **kw)
        fix(d)
        cases[name] = (d / file, list(needles))

    cfg, wts = "cfg.json", "sae_weights.safetensors"
    case("list", lambda d: (d / cfg).write_text("[1, 2]"), cfg, "holds an array; expected an object of settings")
    case("meta", lambda d: _edit(d / cfg, lambda c: {**c, "metadata": ["blocks.1.hook_resid_pre"]}), cfg,
         "metadata is an array; expected an object")
    case("d_in", lambda d: _edit(d / cfg, lambda c: {**c, "d_in": "abc"}), cfg, 'd_in is "abc"; expected an integer')
    case("hook", lambda d: _edit(d / cfg, lambda c: {**c, "metadata": {"hook_name": 5}}), cfg,
         "hook_name is 5; expected a TransformerLens hook name")
    case("flag", lambda d: _edit(d / cfg, lambda c: {**c, "apply_b_dec_to_input": "false"}), cfg,
         'apply_b_dec_to_input is "false"; expected true or false')
    case("centre", lambda d: None, cfg, 'model_from_pretrained_kwargs.center_writing_weights is "yes"; expected true',
         meta={"model_from_pretrained_kwargs": {"center_writing_weights": "yes"}})
    case("kwargs", lambda d: None, cfg, "model_from_pretrained_kwargs is true; expected an object",
         meta={"model_from_pretrained_kwargs": True})
    case("truncated", lambda d: (d / wts).write_bytes((d / wts).read_bytes()[:300]), wts,
         "cannot read it as safetensors", "truncated")
    case("enc1d", lambda d: _weights(d, W_enc=torch.ones(C)), wts, "W_enc has shape (32,); expected 2-D (d_in, d_sae)")
    case("enc3d", lambda d: _weights(d, W_enc=torch.ones(2, C, F)), wts, "W_enc has shape (2, 32, 48); expected 2-D")
    case("int", lambda d: _weights(d, W_dec=torch.ones(F, C, dtype=torch.int64)), wts,
         "W_dec has dtype torch.int64; expected a float tensor")
    case("nan", lambda d: _weights(d, W_enc=torch.ones(C, F).index_put_((torch.tensor(3), torch.tensor(5)),
                                                                        torch.tensor(float("nan")))), wts,
         "W_enc holds 1 value(s) that are not finite float32", "the first at (3, 5)")
    case("big", lambda d: _weights(d, b_dec=torch.full((C,), 1e39, dtype=torch.float64)), wts,
         "b_dec holds 32 value(s) that are not finite float32")  # finite in float64, inf in float32
    case("threshold", lambda d: _weights(d, threshold=torch.ones(F + 1)), wts,
         "threshold has shape (49,), expected (48,) from W_enc (32, 48)", arch="jumprelu")
    return cases


def test_bad_sae_files_name_the_file_and_what_is_expected(tiny_model, tmp_path, capsys):
    from gpt2kit import save_model

    d = tmp_path / "m"
    save_model(tiny_model, d)
    for name, (file, needles) in _bad_files(tmp_path / "saes").items():
        with pytest.raises(ValueError) as e:
            trace(tiny_model, None, IDS, sae=file.parent)
        assert str(e.value).startswith(f"{file}: ") and all(n in str(e.value) for n in needles), (name, str(e.value))
        if name not in ("list", "d_in", "truncated", "enc1d", "nan"):
            continue  # the command line prints the same error: a few of them show that
        rc = main(["trace", "--model", str(d), "The the, a.", "--json", str(tmp_path / "x.json"),
                   "--sae", str(file.parent)])
        err = capsys.readouterr().err
        assert rc == 1 and str(file) in err and len(error_lines(err)) == 1, (name, err)
        assert not (tmp_path / "x.json").exists()


CASES = [
    ("standard", "blocks.1.hook_resid_pre", {}),
    ("standard", "blocks.0.hook_mlp_out", {"apply_b_dec_to_input": False}),
    ("standard", "blocks.1.hook_resid_post", {"normalize_activations": "constant_norm_rescale"}),
    ("standard", "blocks.0.hook_attn_out", {"normalize_activations": "layer_norm"}),
    ("jumprelu", "blocks.1.hook_resid_mid", {}),
    ("topk", "blocks.1.hook_resid_pre", {"k": 6}),
    ("topk", "blocks.0.mlp.hook_post", {"k": 4, "rescale_acts_by_decoder_norm": True}),
    ("standard", "blocks.1.attn.hook_z", {"reshape_activations": "hook_z"}),
]
# SAEs whose metadata asks for TransformerLens's centred writing weights, as sae-lens's gpt2-small-res-jb
# set does; sae-lens's side reads its activations from TransformerLens loaded that way (sae_lens_ref.py),
# not from gpt2kit's. The last one says false, which must leave the stream as it is.
TL_CASES = [
    ("standard", "blocks.1.hook_resid_pre", {}, CENTRE),
    ("jumprelu", "blocks.0.hook_attn_out", {}, CENTRE),
    ("topk", "blocks.1.hook_mlp_out", {"k": 6}, CENTRE),
    ("standard", "blocks.1.hook_resid_post", {"normalize_activations": "layer_norm"}, CENTRE),
    ("standard", "blocks.0.hook_resid_mid", {"normalize_activations": "constant_norm_rescale"}, CENTRE),
    ("standard", "blocks.0.attn.hook_z", {"reshape_activations": "hook_z"}, CENTRE),
    ("standard", "blocks.0.mlp.hook_post", {}, CENTRE),
    ("standard", "blocks.1.hook_resid_pre", {}, {"model_from_pretrained_kwargs": {"center_writing_weights": False}}),
]


def _sae_lens_path() -> list[str] | None:
    """Where sae-lens is: GPT2KIT_SAE_LENS_PATH or the venv's sae-lens/ (tests/sae-lens.txt, installed
    there by the README's test command) ahead of the venv; [] if sae-lens is importable as installed."""
    d = Path(os.environ.get("GPT2KIT_SAE_LENS_PATH") or Path(sys.prefix) / "sae-lens")
    if (d / "sae_lens").is_dir():
        return [str(d)]
    return [] if importlib.util.find_spec("sae_lens") else None


def _sae_lens(phase: str, root: Path, path: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    script = Path(__file__).with_name("sae_lens_ref.py")
    r = subprocess.run([sys.executable, str(script), phase, str(root)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def sae_lens_runs(tmp_path_factory):
    """Each case's SAE made and saved by sae-lens, loaded by gpt2kit, run on the trace's activations at its
    hook point, and encoded/decoded by sae-lens on those same activations (one subprocess per side)."""
    path = _sae_lens_path()
    if path is None:
        pytest.skip('no sae-lens: pip install --no-deps --target "$VIRTUAL_ENV/sae-lens" -r tests/sae-lens.txt')
    root = tmp_path_factory.mktemp("sae-lens")
    cases = [{"arch": a, "hook": h, "cfg": cfg, "meta": meta, "tl": bool(meta), "ids": IDS, "n_head": NH,
              "d_in": 4 * C if h.endswith("hook_post") else C, "d_sae": F, "seed": 1 + i}
             for i, (a, h, cfg, meta) in enumerate([(*c, {}) for c in CASES] + TL_CASES)]
    (root / "cases.json").write_text(json.dumps(cases))
    model, runs = random_model(), []
    hf_from_ours(model).save_pretrained(root / "hf")
    _sae_lens("make", root, path)
    for i in range(len(cases)):
        ours = load_sae(root / str(i), L, NH)
        tr = trace(model, None, IDS, sae=ours)
        x = activations(tr, ours)  # (T, D): what the SAE reads
        assert torch.equal(ours.features(tr[ours.name]), ours.encode(x))  # the one encode a hook would use
        save_file({"x": x.contiguous()}, str(root / str(i) / "x.safetensors"))
        runs.append((x, ours.reconstruct(x), tr.sae_features()["l0"]))
    _sae_lens("encode", root, path)
    return [(x, f, rec, l0, load_file(str(root / str(i) / "sae_lens.safetensors"))) for i, (x, (f, rec), l0) in
            enumerate(runs)]


IDS_ALL = [f"{a}-{h}" for a, h, _ in CASES] + [f"tl-{a}-{h}-{'centred' if m == CENTRE else 'raw'}"
                                               for a, h, _, m in TL_CASES]


@pytest.mark.parametrize("i", range(len(CASES) + len(TL_CASES)), ids=IDS_ALL)
def test_features_equal_sae_lens_encode(sae_lens_runs, i):
    x, f, rec, l0, want = sae_lens_runs[i]
    if i >= len(CASES):  # sae-lens read TransformerLens's activations: gpt2kit's reading of its own equals them
        assert (x - want["x"]).abs().max() < 1e-5
        raw_mean = x.mean(-1).abs().max()
        assert raw_mean < 1e-5 if IDS_ALL[i].endswith("centred") and "hook_z" not in IDS_ALL[i] \
            and "hook_post" not in IDS_ALL[i] else raw_mean > 1e-3  # the case tests what it says it does
    assert f.shape == want["f"].shape and (f - want["f"]).abs().max() < 1e-5
    assert (rec - want["rec"]).abs().max() < 1e-5
    assert l0 == (want["f"] > 0).sum(-1).tolist()
    assert int((want["f"] > 0).sum()) > 0  # something fired: the comparison is not of zeros


# --- a clamp while generating, against sae-lens's HookedSAETransformer --------------------------------
# (architecture, hook, cfg, metadata): each SAE attached to HookedSAETransformer with use_error_term=True
# and GEN_CLAMP set on its hook_sae_acts_post at every position (sae_lens_ref.py generate), against
# gpt2kit's generate(..., interventions=[clamp(dir, GEN_CLAMP)]) on the same weights.
GEN_CASES = [
    ("standard", "blocks.1.hook_resid_pre", {}, {}),
    ("standard", "blocks.1.hook_resid_pre", {}, CENTRE),
    ("jumprelu", "blocks.0.hook_resid_mid", {}, {}),
    ("jumprelu", "blocks.0.hook_attn_out", {}, CENTRE),
    ("topk", "blocks.1.hook_mlp_out", {"k": 6}, CENTRE),
    ("topk", "blocks.0.mlp.hook_post", {"k": 4, "rescale_acts_by_decoder_norm": True}, {}),
    ("standard", "blocks.0.hook_resid_post", {"normalize_activations": "layer_norm"}, {}),
    ("standard", "blocks.0.attn.hook_z", {"reshape_activations": "hook_z"}, {}),
]
GEN_PROMPT, GEN_N, GEN_CLAMP = [5, 17, 3, 99], 32, {3: 6.0, 11: 0.0}


@pytest.fixture(scope="module")
def sae_lens_generations(tmp_path_factory):
    """A random model whose greedy text varies (helpers.varied_model), saved in transformers' format; each
    case's SAE made and saved by sae-lens; sae-lens's greedy generation under the clamp (one subprocess
    per phase). Returns (the model, the directory, the cases)."""
    from helpers import varied_model
    from transformers import GPT2TokenizerFast

    from gpt2kit.tokenizer import Tokenizer

    path = _sae_lens_path()
    if path is None:
        pytest.skip('no sae-lens: pip install --no-deps --target "$VIRTUAL_ENV/sae-lens" -r tests/sae-lens.txt')
    root = tmp_path_factory.mktemp("sae-lens-generate")
    cases = [{"arch": a, "hook": h, "cfg": cfg, "meta": meta, "d_in": 4 * C if h.endswith("hook_post") else C,
              "d_sae": F, "seed": 100 + i, "prompt": GEN_PROMPT, "n": GEN_N, "clamp": GEN_CLAMP}
             for i, (a, h, cfg, meta) in enumerate(GEN_CASES)]
    (root / "cases.json").write_text(json.dumps(cases))
    model = varied_model(TINY, seed=5)
    hf_from_ours(model).save_pretrained(root / "hf")
    Tokenizer.default().save(root / "hf")  # for TransformerLens's cached generate (sae_lens_ref.py)
    GPT2TokenizerFast(vocab_file=str(root / "hf" / "vocab.json"),
                      merges_file=str(root / "hf" / "merges.txt")).save_pretrained(root / "hf")
    _sae_lens("make", root, path)
    _sae_lens("generate", root, path)
    return model, root, cases


@pytest.mark.parametrize("i", range(len(GEN_CASES)),
                         ids=[f"{a}-{h}{'-centred' if m else ''}{'-' + next(iter(c)) if c else ''}"
                              for a, h, c, m in GEN_CASES])
def test_clamp_while_generating_equals_sae_lens_hooked_sae(sae_lens_generations, i):
    """Greedy over 32 tokens: the tokens equal sae-lens's, and every step's intervened logits are within 1e-4
    of sae-lens's (float32; the two compute decode(clamped) + x - decode(f) in different orders)."""
    from helpers import greedy_with_logits

    from gpt2kit import SamplingSettings, generate
    from gpt2kit.trace import clamp

    model, root, _ = sae_lens_generations
    want = load_file(str(root / str(i) / "generated.safetensors"))
    # sae-lens's own KV-cached generate agrees with its step-by-step re-run: the reference is one thing
    assert want["cached_tokens"].tolist() == want["tokens"].tolist()
    assert (want["cached_logits"] - want["logits"]).abs().max() < 1e-4
    toks, logits = greedy_with_logits(model, GEN_PROMPT, [clamp(root / str(i), GEN_CLAMP)], GEN_N)
    assert toks == want["tokens"].tolist()
    assert logits.shape == want["logits"].shape and (logits - want["logits"]).abs().max() < 1e-4
    plain = generate(model, [GEN_PROMPT], SamplingSettings(temperature=0.0, max_new_tokens=GEN_N,
                                                           stop_token_ids=()))[0].tokens
    assert toks != plain  # the clamp changes the text: the comparison can fail
