"""gpt2kit.trace SAEs in SAELens's format: equal to sae-lens's own encode/decode (1e-5, float32).

The sae-lens comparisons skip where sae-lens cannot be imported (sae-lens 6 needs
transformer-lens < 4, which cannot share an environment with the test extra's 4.x); the
format checks and bad-input tests below build SAELens-format files by hand and always run.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY
from safetensors.torch import save_file

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
        with pytest.raises(ValueError, match="") as e:
            trace(tiny_model, None, IDS, sae=tmp_path / name)
        assert needle in str(e.value), (name, str(e.value))
        rc = main(["trace", "--model", str(d), "The the, a.", "--json", str(tmp_path / "x.json"),
                   "--sae", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert rc == 1 and needle in err and len(err.strip().splitlines()) == 1, (name, err)
        assert not (tmp_path / "x.json").exists()
    # a hook point the selection left out
    _write(tmp_path / "mlp", hook="blocks.0.hook_mlp_out")
    with pytest.raises(ValueError, match="did not record"):
        trace(tiny_model, None, IDS, sae=tmp_path / "mlp", what="resid")


def _sae_lens_sae(arch: str, hook: str, d_in: int, seed: int, **cfg):
    from sae_lens.saes.jumprelu_sae import JumpReLUSAE, JumpReLUSAEConfig
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig
    from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig

    cls, cfg_cls = {"standard": (StandardSAE, StandardSAEConfig), "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
                    "topk": (TopKSAE, TopKSAEConfig)}[arch]
    sae = cls(cfg_cls(d_in=d_in, d_sae=F, metadata=SAEMetadata(hook_name=hook), **cfg))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.rand_like(p) * 0.2 if name == "threshold" else torch.randn_like(p) * 0.3)
    return sae.eval()


@pytest.mark.parametrize("arch, hook, cfg", [
    ("standard", "blocks.1.hook_resid_pre", {}),
    ("standard", "blocks.0.hook_mlp_out", {"apply_b_dec_to_input": False}),
    ("standard", "blocks.1.hook_resid_post", {"normalize_activations": "constant_norm_rescale"}),
    ("standard", "blocks.0.hook_attn_out", {"normalize_activations": "layer_norm"}),
    ("jumprelu", "blocks.1.hook_resid_mid", {}),
    ("topk", "blocks.1.hook_resid_pre", {"k": 6}),
    ("topk", "blocks.0.mlp.hook_post", {"k": 4, "rescale_acts_by_decoder_norm": True}),
    ("standard", "blocks.1.attn.hook_z", {"reshape_activations": "hook_z"}),
])
def test_features_equal_sae_lens_encode(tiny_model, tmp_path, arch, hook, cfg):
    pytest.importorskip("sae_lens", reason="sae-lens is not importable here (it needs transformer-lens < 4)")
    d_in = 4 * C if hook.endswith("hook_post") else C
    sae = _sae_lens_sae(arch, hook, d_in, seed=1, **cfg)
    sae.save_model(tmp_path / "sae")
    ours = load_sae(tmp_path / "sae", L, NH)
    tr = trace(tiny_model, None, IDS, sae=ours)
    x = activations(tr, ours)  # (T, D)
    x_tl = x.view(len(IDS), NH, HS) if hook.endswith("hook_z") else x  # hook_z SAEs take (..., nh, hs)
    with torch.no_grad():
        want_f = sae.encode(x_tl)
        want_rec = sae.decode(want_f).reshape(len(IDS), -1)
    f, rec = ours.reconstruct(x)
    assert (f - want_f).abs().max() < 1e-5
    assert (rec - want_rec).abs().max() < 1e-5
    assert tr.sae_features()["l0"] == (want_f > 0).sum(-1).tolist()
