"""gpt2kit.trace interventions: each equals the hand-modified network.

Tolerance: 1e-6 on the logits (float32) for every change that a weight edit can express exactly
(a zeroed head = zeroed c_proj columns, a steered stream = a shifted bias, ...); read-only hooks
at every name leave the logits model(ids)'s bit for bit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import TINY, error_lines, random_model

from gpt2kit.cli import main
from gpt2kit.trace import ALIASES, Intervention, ablate, hook, replace, run_with_hooks, steer, trace
from gpt2kit.trace.points import names

C, NH, HS, L = TINY.n_embd, TINY.n_head, TINY.head_dim, TINY.n_layer
TEXT = "The the, a. The a, the"  # GPT-2's ids for these are all below the tiny vocabulary's 1000
IDS = [5, 17, 3, 99, 250, 17, 3, 42, 7, 600, 5, 17]


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _edited(model, edit) -> torch.Tensor:
    m = copy.deepcopy(model)
    with torch.no_grad():
        edit(m)
    return _logits(m)


def _close(a, b, tol=1e-6):
    assert (a - b).abs().max() < tol, float((a - b).abs().max())


def test_read_only_hooks_at_every_name_change_nothing(tiny_model):
    seen = []
    ivs = [hook(n, lambda x, n=n: seen.append(n)) for n in names(L)
           if n != "logits" and not n.endswith(("scores", "probs"))]
    tr = trace(tiny_model, None, IDS, interventions=ivs)
    assert torch.equal(tr.logits, _logits(tiny_model)) and torch.equal(tr.clean.logits, tr.logits)
    assert sorted(seen) == sorted(iv.name for iv in ivs)  # each hook fired, once
    assert torch.equal(trace(tiny_model, None, IDS).logits, _logits(tiny_model))


def test_zero_head_equals_zeroed_c_proj_columns(tiny_model):
    i, h = 1, 2
    want = _edited(tiny_model, lambda m: m.h[i].attn.c_proj.weight[:, h * HS:(h + 1) * HS].zero_())
    for iv in (ablate(f"h.{i}.attn.head.{h}"), ablate(f"blocks.{i}.attn.hook_z.head.{h}"),
               ablate(f"h.{i}.attn.z", head=h)):
        tr = trace(tiny_model, None, IDS, interventions=[iv])
        _close(tr.logits, want)
        assert torch.count_nonzero(tr[f"h.{i}.attn.z"][h]) == 0  # what is recorded is the intervened run

    def zero_head(z):  # (B, nh, T, hs)
        z = z.clone()
        z[:, h] = 0
        return z
    _close(run_with_hooks(tiny_model, IDS, {f"blocks.{i}.attn.hook_z": zero_head})[0], want)


def test_mean_ablation_of_an_mlp_equals_its_bias_set_to_the_mean(tiny_model):
    i = 0
    clean = trace(tiny_model, None, IDS)
    mean = clean[f"h.{i}.mlp.out"].mean(0)

    def edit(m):
        m.h[i].mlp.c_proj.weight.zero_()
        m.h[i].mlp.c_proj.bias.copy_(mean)
    tr = trace(tiny_model, None, IDS, interventions=[ablate(f"h.{i}.mlp", mean=True)])
    _close(tr.logits, _edited(tiny_model, edit))
    ref = [1, 2, 3, 4, 5, 6, 7]  # another text's mean (any length)
    ref_mean = trace(tiny_model, None, ref)[f"h.{i}.mlp.out"].mean(0)

    def edit_ref(m):
        m.h[i].mlp.c_proj.weight.zero_()
        m.h[i].mlp.c_proj.bias.copy_(ref_mean)
    tr = trace(tiny_model, None, IDS, interventions=[ablate(f"blocks.{i}.hook_mlp_out", mean=True)], mean_over=ref)
    _close(tr.logits, _edited(tiny_model, edit_ref))


def test_steering_and_replacement_equal_shifted_biases(tiny_model):
    g = torch.Generator().manual_seed(3)
    v = torch.randn(C, generator=g)
    # all positions of H^(2) = block 1's output: block 1's MLP bias + 4 v
    _close(trace(tiny_model, None, IDS, interventions=[steer("h.2.resid", v, 4.0)]).logits,
           _edited(tiny_model, lambda m: m.h[1].mlp.c_proj.bias.add_(4.0 * v)))
    # one position of H^(0): that row of wpe
    _close(trace(tiny_model, None, IDS, interventions=[steer("resid.0", v.numpy(), -2.0, positions=[3])]).logits,
           _edited(tiny_model, lambda m: m.wpe.weight[3].add_(-2.0 * v)))
    # H' = H + A, at every position: the attention bias
    _close(trace(tiny_model, None, IDS, interventions=[steer("blocks.0.hook_resid_mid", v)]).logits,
           _edited(tiny_model, lambda m: m.h[0].attn.c_proj.bias.add_(v)))
    # one head's values: its slice of c_attn's bias (the probabilities sum to 1)
    u = torch.randn(HS, generator=g)
    _close(trace(tiny_model, None, IDS, interventions=[steer("h.1.attn.v", u, head=3)]).logits,
           _edited(tiny_model, lambda m: m.h[1].attn.c_attn.bias[2 * C + 3 * HS:2 * C + 4 * HS].add_(u)))
    # replacing the MLP output by a constant: weight 0, bias the constant
    _close(trace(tiny_model, None, IDS, interventions=[replace("h.1.mlp.out", v)]).logits,
           _edited(tiny_model, lambda m: (m.h[1].mlp.c_proj.weight.zero_(), m.h[1].mlp.c_proj.bias.copy_(v))))
    # a user function: doubling LN1's output = doubling its scale and shift
    _close(trace(tiny_model, None, IDS, interventions=[hook("h.0.ln_1", lambda x: 2 * x)]).logits,
           _edited(tiny_model, lambda m: (m.h[0].ln_1.weight.mul_(2), m.h[0].ln_1.bias.mul_(2))))


def test_per_position_ablation_leaves_earlier_positions_alone(tiny_model):
    tr = trace(tiny_model, None, IDS, interventions=[ablate("h.0.attn.out", positions=[5, -1])])
    clean = _logits(tiny_model)
    assert torch.equal(tr.logits[:5], clean[:5])  # causal: nothing before position 5 changed
    assert not torch.equal(tr.logits[5], clean[5])
    assert torch.count_nonzero(tr["h.0.attn.out"][[5, 11]]) == 0 and torch.count_nonzero(tr["h.0.attn.out"][6])
    eff = tr.intervention_effect()
    assert eff["kl"][:5] == [pytest.approx(0.0, abs=1e-7)] * 5 and eff["kl"][5] > 0
    assert eff["interventions"] == ["zero h.0.attn.out@5,-1"]
    data = tr.to_json()
    assert data["intervention"]["clean_lens"]["layers"] == list(range(L + 1))
    assert data["intervention"]["clean_lens"]["top_ids"][-1][-1][0] == int(clean[-1].argmax())


def test_alias_table_resolves_to_recorded_names(tiny_model):
    from gpt2kit.trace.points import resolve

    tr = trace(tiny_model, None, IDS)
    for alias in ALIASES:
        for i in range(L if "{i}" in alias else 1):
            ours, _ = resolve(alias.replace("{i}", str(i)), L, NH)
            assert ours in tr.tensors or ours == "embed.tok" and "embed.tok" in tr.tensors, alias


@pytest.mark.parametrize("iv, needle", [
    (ablate("h.1.atn.z"), "unknown name 'h.1.atn.z'; did you mean h.1.attn.z"),
    (ablate("blocks.1.attn.hook_zz"), "did you mean blocks.1.attn.hook_z"),
    (ablate("h.1.attn.head.4"), "head 4 is outside the model's heads [0, 4)"),
    (ablate("h.7.mlp"), "block 7 is outside the model's blocks [0, 2)"),
    (ablate("h.0.ln_1.head.1"), "only the per-head tensors"),
    (ablate("h.0.attn.probs"), "no module computes it"),
    (steer("h.1.resid", np.ones(31)), "the vector has shape (31,); resid.1 takes (32,)"),
    (steer("h.1.attn.v", np.ones(32), head=0), "takes (8,)"),
    (ablate("h.0.mlp", positions=[12]), "position 12 is outside the input's 12 tokens"),
    (Intervention("h.0.mlp", "scale"), "unknown intervention kind 'scale'"),
])
def test_bad_interventions_say_what_is_wrong(tiny_model, iv, needle):
    with pytest.raises(ValueError) as e:
        trace(tiny_model, None, IDS, interventions=[iv])
    assert needle in str(e.value)


def test_cli_ablate_and_steer(tmp_path, capsys):
    import json

    from gpt2kit import save_model

    d = tmp_path / "m"
    model = random_model()
    save_model(model, d)
    vec = tmp_path / "v.npy"
    np.save(vec, np.ones(C, dtype=np.float32))
    js = tmp_path / "t.json"
    rc = main(["trace", "--model", str(d), TEXT, "--json", str(js), "--ablate", "h.1.attn.head.2",
               "--ablate", "h.0.mlp:mean", "--steer", f"h.1.resid@-1:{vec}*4"])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(js.read_text())
    assert data["intervention"]["interventions"] == ["zero h.1.attn.head.2", "mean h.0.mlp",
                                                     "add 4 x vector at h.1.resid@-1"]
    for argv, needle in [(["--ablate", "h.1.mlpp"], "did you mean h.1.mlp"),
                         (["--ablate", "h.1.attn.head.9"], "head 9 is outside"),
                         (["--steer", f"h.1.resid:{vec}*x"], "the scale after * is a number"),
                         (["--steer", f"h.1.attn.z.head.0:{vec}"], "takes (8,)"),
                         (["--ablate", "h.1.mlp:half"], "the form is NAME[@POS][:zero|:mean]"),
                         (["--steer", "h.1.resid:missing.npy"], "missing.npy: no such file (a vector file"),
                         (["--steer", "h.1.resid:/dev/zero"], "/dev/zero: is a character device, not a regular file")]:
        rc = main(["trace", "--model", str(d), TEXT, "--json", str(tmp_path / "x.json"), *argv])
        err = capsys.readouterr().err
        assert rc == 1 and needle in err and len(error_lines(err)) == 1, (argv, err)
        assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("iv, needle", [
    (steer("h.1.resid", np.r_[np.ones(C - 1), np.nan]), "the first, nan, at index (31,)"),
    (steer("h.1.resid", torch.full((C,), float("inf"))), "32 entries are not a finite float32"),
    (steer("h.1.resid", np.full(C, 1e39)), "the first, 1e+39"),  # finite in float64, inf in float32
    (steer("h.1.resid", np.ones(C), float("nan")), "the scale nan is not a finite float32"),
    (steer("h.1.resid", np.ones(C), float("-inf")), "the scale -inf is not a finite float32"),
    (steer("h.1.resid", np.ones(C), 1e39), "the scale 1e+39 is not a finite float32"),
    (steer("h.1.resid", np.full(C, 1e20), 1e20), "1e+20 x the vector"),  # each finite, the product is not
    (replace("h.1.mlp.out", np.r_[np.nan, np.ones(C - 1)]), "replace h.1.mlp.out: the value: 1 entry"),
])
def test_non_finite_interventions_are_refused(tiny_model, iv, needle):
    with pytest.raises(ValueError) as e:
        trace(tiny_model, None, IDS, interventions=[iv])
    assert needle in str(e.value), str(e.value)


def test_cli_refuses_non_finite_and_unreadable_vectors(tmp_path, capsys):
    from gpt2kit import save_model

    d = tmp_path / "m"
    save_model(random_model(), d)
    files = {"ok": np.ones(C, dtype=np.float32), "nan": np.r_[np.ones(C - 1), np.nan].astype(np.float32),
             "big": np.full(C, 1e39), "huge": np.full(C, 1e30, dtype=np.float32), "text": np.array(["a"] * C)}
    for name, arr in files.items():
        np.save(tmp_path / f"{name}.npy", arr)
    np.savez(tmp_path / "v.npz", a=np.ones(C))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    f = {k: str(tmp_path / f"{k}.npy") for k in (*files, "junk")}
    npz = str(tmp_path / "v.npz")
    expected = "a 1-D float .npy (numpy.save) of the name's width, n_embd"
    for argv, needles in [
        (["--steer", f"resid.1:{f['nan']}"], [f["nan"], "the first, nan, at index (31,)"]),
        (["--steer", f"resid.1:{f['ok']}*nan"], ["the scale nan is not a finite float32"]),
        (["--steer", f"resid.1:{f['ok']}*inf"], ["the scale inf is not a finite float32"]),
        (["--steer", f"resid.1:{f['ok']}*1e39"], ["the scale 1e+39 is not a finite float32"]),
        (["--steer", f"resid.1:{f['huge']}*1e10"], ["1e+10 x the vector", "not a finite float32"]),
        (["--steer", f"resid.1:{f['big']}"], [f["big"], "the first, 1e+39"]),
        (["--replace", f"h.0.mlp.out:{f['nan']}"], [f["nan"], "not a finite float32"]),
        (["--steer", f"resid.1:{npz}"], [npz, "an .npz archive (arrays: a)", expected]),
        (["--steer", f"resid.1:{f['text']}"], [f["text"], "holds <U1 values, not numbers", expected]),
        (["--replace", f"resid.1:{f['junk']}"], [f["junk"], "not a .npy array", expected]),
    ]:
        rc = main(["trace", "--model", str(d), TEXT, "--json", str(tmp_path / "x.json"), *argv])
        err = capsys.readouterr().err
        assert rc == 1 and len(error_lines(err)) == 1, (argv, err)
        assert all(n in err for n in needles), (argv, err)
        assert "could not convert" not in err and not (tmp_path / "x.json").exists()
