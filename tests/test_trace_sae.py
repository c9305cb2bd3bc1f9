"""gpt2kit.trace SAEs in SAELens's format: equal to sae-lens's own encode/decode (1e-5, float32).

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
from helpers import TINY, error_lines, random_model
from safetensors.torch import load_file, save_file

from gpt2kit.cli import main
from gpt2kit.trace import trace
from gpt2kit.trace.sae import activations, load_sae

C, NH, HS, L = TINY.n_embd, TINY.n_head, TINY.head_dim, TINY.n_layer
IDS = [5, 17, 3, 99, 250, 17, 3, 42, 7, 600]
F = 48


def _write(d, *, hook="blocks.1.hook_resid_pre", d_in=C, arch="standard", extra=None, seed=0, **cfg):
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(d_in, F, generator=g) * 0.3, "b_enc": torch.randn(F, generator=g) * 0.1,
         "W_dec": torch.randn(F, d_in, generator=g) * 0.3, "b_dec": torch.randn(d_in, generator=g) * 0.1,
         **(extra or {})}
    d.mkdir(parents=True, exist_ok=True)
    save_file(w, str(d / "sae_weights.safetensors"))
    body = {"d_in": d_in, "d_sae": F, "architecture": arch, "apply_b_dec_to_input": True,
            "normalize_activations": "none", "metadata": {"hook_name": hook, "sae_lens_version": "6.0.0"}, **cfg}
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
    cases = [{"arch": a, "hook": h, "cfg": cfg, "d_in": 4 * C if h.endswith("hook_post") else C, "d_sae": F,
              "n_head": NH, "seed": 1 + i} for i, (a, h, cfg) in enumerate(CASES)]
    (root / "cases.json").write_text(json.dumps(cases))
    _sae_lens("make", root, path)
    model, runs = random_model(), []
    for i in range(len(cases)):
        ours = load_sae(root / str(i), L, NH)
        tr = trace(model, None, IDS, sae=ours)
        x = activations(tr, ours)  # (T, D)
        save_file({"x": x.contiguous()}, str(root / str(i) / "x.safetensors"))
        runs.append((ours.reconstruct(x), tr.sae_features()["l0"]))
    _sae_lens("encode", root, path)
    return [(f, rec, l0, load_file(str(root / str(i) / "sae_lens.safetensors"))) for i, ((f, rec), l0) in
            enumerate(runs)]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{a}-{h}" for a, h, _ in CASES])
def test_features_equal_sae_lens_encode(sae_lens_runs, i):
    f, rec, l0, want = sae_lens_runs[i]
    assert f.shape == want["f"].shape and (f - want["f"]).abs().max() < 1e-5
    assert (rec - want["rec"]).abs().max() < 1e-5
    assert l0 == (want["f"] > 0).sum(-1).tolist()
    assert int((want["f"] > 0).sum()) > 0  # something fired: the comparison is not of zeros
