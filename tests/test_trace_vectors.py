"""gpt2kit steer make / gpt2kit.trace.vectors: ActAdd and mean-difference vectors against the residual
stream read here with a hook on the block's output (exact: the same forward, float32), saved with
the model they fit and refused by another."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import SMALL, error_lines, varied_model

from gpt2kit import save_model
from gpt2kit.cli import main
from gpt2kit.config import GPT2Config
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace.vectors import make_vector


@pytest.fixture(scope="module")
def model():
    return varied_model()


def _resid(model, text, layer):
    """The residual stream before block `layer` (the output of block layer - 1), (T, C)."""
    got = {}

    def keep(mod, args, out):
        got["x"] = out[0].clone()
    h = model.h[layer - 1].register_forward_hook(keep)
    with torch.no_grad():
        model(torch.tensor([Tokenizer.default().encode(text)]))
    h.remove()
    return got["x"]


def test_actadd_and_mean_difference_equal_the_stream_read_by_hand(model):
    tok = Tokenizer.default()
    vec, meta = make_vector(model, tok, ["Love"], ["Hate is here"], "h.1.resid")
    want = _resid(model, "Love", 1)[-1] - _resid(model, "Hate is here", 1)[-1]
    assert np.array_equal(vec, want.numpy())
    assert meta["point"] == "resid.1" and meta["width"] == SMALL.n_embd and meta["method"] == "actadd"
    pos, neg = ["I love it", "Wonderful day"], ["I hate it", "Awful", "Bad news today"]
    vec, meta = make_vector(model, tok, pos, neg, "blocks.1.hook_resid_pre", position="mean")
    want = (torch.stack([_resid(model, t, 1).mean(0) for t in pos]).mean(0)
            - torch.stack([_resid(model, t, 1).mean(0) for t in neg]).mean(0))
    assert np.allclose(vec, want.numpy(), atol=1e-6) and meta["method"] == "mean-difference"
    for args, kw, needle in ((([], ["x"], "resid.1"), {}, "at least one"), (([""], ["x"], "resid.1"), {}, "empty"),
                             ((["a"], ["b"], "h.1.attn.head.2"), {}, "per-head"),
                             ((["a"], ["b"], "resid.1"), {"position": "first"}, "choose from")):
        with pytest.raises(ValueError, match=needle):
            make_vector(model, tok, *args, **kw)


def test_cli_makes_a_vector_that_steer_reads_and_another_model_refuses(model, tmp_path, capsys):
    d = tmp_path / "m"
    save_model(model, d)
    out = tmp_path / "love.npy"
    assert main(["steer", "make", "--model", str(d), "--layer", "1", "Love", "Hate", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert "actadd at resid.1" in capsys.readouterr().out
    vec = np.load(out)
    assert vec.shape == (SMALL.n_embd,) and vec.dtype == np.float32
    meta = json.loads((tmp_path / "love.npy.json").read_text())
    assert meta["model"] == str(d) and meta["point"] == "resid.1" and meta["n_embd"] == SMALL.n_embd
    # the CLI runs the saved model in its loaded layout: the same products to float rounding
    assert np.allclose(vec, (_resid(model, "Love", 1)[-1] - _resid(model, "Hate", 1)[-1]).numpy(), atol=1e-5)
    assert main(["generate", "--model", str(d), "Hi", "--max-new-tokens", "3", "--steer", f"h.1.resid:{out}*4"]) == 0
    capsys.readouterr()
    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.txt"
    pos.write_text("I love it\nWonderful day\n")
    neg.write_text("I hate it\n")
    assert main(["steer", "make", "--model", str(d), "--point", "h.1.resid", "--positive-file", str(pos),
                 "--negative-file", str(neg), "--position", "mean", "--out", str(tmp_path / "m.npy")]) == 0
    assert "mean-difference" in capsys.readouterr().out
    # a model of another shape: the same width, one more layer
    other = tmp_path / "other"
    save_model(varied_model(GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=3)), other)
    for cmd in (["generate", "--model", str(other), "Hi", "--max-new-tokens", "2"],
                ["trace", "--model", str(other), "Hi", "--json", str(tmp_path / "t.json")]):
        assert main([*cmd, "--steer", f"h.1.resid:{out}"]) == 1
        err = error_lines(capsys.readouterr().err)
        assert len(err) == 1 and "n_layer 2" in err[0] and "n_layer 3" in err[0], err
    for argv, needle in ((["Love"], "a POSITIVE and a NEGATIVE"),
                         (["Love", "Hate", "--layer", "1", "--point", "resid.1"], "one of them"),
                         (["Love", "Hate"], "give the point"), (["Love", "Hate", "--layer", "9"], "outside")):
        assert main(["steer", "make", "--model", str(d), *argv, "--out", str(tmp_path / "x.npy")]) == 1
        err = error_lines(capsys.readouterr().err)
        assert len(err) == 1 and needle in err[0], err
