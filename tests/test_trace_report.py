"""gpt2kit.trace's report and CLI: self-contained HTML, --json/--npz, one-line errors, size."""

from __future__ import annotations

import base64
import html
import json
import re

import numpy as np
import pytest
import torch
from helpers import error_lines, random_model

from gpt2kit import save_model
from gpt2kit.cli import main
from gpt2kit.config import GPT2Config
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import trace

# GPT-2's vocabulary (so real text encodes) on a tiny network.
SMALL_VOCAB = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2)
TEXT = "The cat sat on the mat. The cat sat on the"
# Anything that would make a browser fetch: src=, href=, import, url(), @import with http(s).
FETCH = re.compile(r"""(src|href)\s*=\s*["']?\s*(https?:)?//|import\s*\(?\s*["'](https?:)?//"""
                   r"""|url\(\s*["']?(https?:)?//|@import|<link\b|<script[^>]+\bsrc=""", re.I)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_vocab")
    save_model(random_model(SMALL_VOCAB), d)
    return d


def _assets() -> str:
    from importlib import resources

    root = resources.files("gpt2kit.trace").joinpath("assets")
    return "".join(root.joinpath(n).read_text(encoding="utf-8") for n in ("report.html", "report.css", "report.js"))


def test_report_is_self_contained():
    assert "http:" not in _assets() and "https:" not in _assets()  # the code names no URL at all
    m = random_model(SMALL_VOCAB)
    tok = Tokenizer.default()
    tr = trace(m, tok, TEXT + " </script><script>alert(1)</script> <!-- <script> __DATA__", name="tiny")
    page = tr.to_html()
    assert not FETCH.search(page)
    assert page.count("<script") == 2  # the data block and the code; the text's "</script>" stayed data
    data = json.loads(re.search(r'id="trace-data">(.*?)</script>', page, re.S).group(1))
    assert data["ids"] == tr.ids and data["tokens"][0] == "The"
    assert tok.decode(data["ids"]) == tok.decode(tr.ids) and "".join(data["tokens"]).endswith("<!-- <script> __DATA__")
    for panel in ("tokens", "heads", "lens", "dla", "norms", "patch", "walk"):
        assert f'id="panel-{panel}"' in page
    wrapped = tr._repr_html_()
    assert wrapped.startswith("<iframe srcdoc=")
    assert html.unescape(re.search(r'srcdoc="(.*?)"', wrapped, re.S).group(1)) == page


def test_walkthrough_follows_the_spec_order(tiny_model):
    from gpt2kit.trace.report import walkthrough

    tr = trace(tiny_model, None, list(range(10)))
    names = [s["name"] for s in walkthrough(tr, 4)]
    assert names[:4] == ["ids", "embed.tok", "embed.pos", "resid.0"]
    assert names[4:18] == ["h.0.ln_1", "h.0.attn.q", "h.0.attn.k", "h.0.attn.v", "h.0.attn.scores", "h.0.attn.probs",
                           "h.0.attn.z", "h.0.attn.out", "h.0.resid_mid", "h.0.ln_2", "h.0.mlp.pre", "h.0.mlp.post",
                           "h.0.mlp.out", "resid.1"]
    assert names[-3:] == ["ln_f", "logits", "probs"]
    step = next(s for s in walkthrough(tr, 4) if s["name"] == "h.1.mlp.post")
    assert step["row"]["first"] == pytest.approx(tr["h.1.mlp.post"][4, :6].tolist())
    assert step["shape"] == [10, 4 * tiny_model.config.n_embd]


def test_cli_trace_writes_html_json_npz(model_dir, tmp_path, capsys):
    out, js, npz = tmp_path / "r.html", tmp_path / "t.json", tmp_path / "t.npz"
    compare = "The dog sat on the mat. The cat sat on the"
    rc = main(["trace", "--model", str(model_dir), TEXT, "--out", str(out), "--json", str(js), "--npz", str(npz),
               "--top-k", "3", "--compare", compare])
    assert rc == 0, capsys.readouterr().err
    assert "wrote" in capsys.readouterr().out
    data = json.loads(js.read_text())
    ids = Tokenizer.default().encode(TEXT)
    assert data["ids"] == ids and len(data["stats"]["top_ids"][0]) == 3
    assert data["patching"]["corrupt_ids"] == Tokenizer.default().encode(compare)
    z = np.load(npz)
    assert z["logits"].shape == (len(ids), 50257)
    with torch.no_grad():
        from gpt2kit import load_model

        want = load_model(model_dir)(torch.tensor([ids])).logits[0].numpy()
    assert np.array_equal(z["logits"], want)
    assert "<!DOCTYPE html>" in out.read_text()


@pytest.mark.parametrize("argv, needle", [
    (["", "--out", "x.html"], "the text is empty"),
    (["word " * 80, "--out", "x.html"], "more than the context n_ctx=64"),
    (["The cat", "--compare", "The big black cat", "--out", "x.html"], "equal token length"),
    (["The cat", "--layers", "7", "--out", "x.html"], "layer 7 is outside"),
    (["The cat", "--layers", "one", "--out", "x.html"], "unknown --layers value 'one'"),
    (["The cat", "--what", "everything", "--out", "x.html"], "unknown --what value 'everything'"),
    (["The cat"], "nothing to write"),
])
def test_cli_trace_bad_input_is_one_line(model_dir, tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    rc = main(["trace", "--model", str(model_dir), *argv])
    err = capsys.readouterr().err
    assert rc != 0
    assert needle in err and len(error_lines(err)) == 1 and "Traceback" not in err
    assert not (tmp_path / "x.html").exists()


def test_report_size_for_gpt2_small_at_64_tokens():
    """64 tokens through a gpt2-124M-sized network: at most 3 MB of HTML."""
    from gpt2kit.model import GPT2

    torch.manual_seed(0)
    m = GPT2.from_name("gpt2").eval()
    ids = torch.randint(0, 50257, (64,)).tolist()
    page = trace(m, Tokenizer.default(), ids).to_html()
    assert len(page.encode("utf-8")) <= 3 * 2**20


def test_long_inputs_keep_the_file_small(tiny_model, monkeypatch):
    from gpt2kit.trace import report

    tr = trace(tiny_model, None, list(range(40)))
    monkeypatch.setattr(report, "MAX_ATTENTION_BYTES", tiny_model.config.n_head * 40 * 40)  # one block's maps
    data = report.report_data(tr, attention_encoding="u8")
    assert data["attention"]["layers"] == [0] and data["attention"]["omitted"] == [1]
    assert len(data["attention"]["summary"]["prev"]) == 1
    assert len(base64.b64decode(data["attention"]["u8"])) == tiny_model.config.n_head * 40 * 40


def test_pieces_of_a_character_show_their_bytes():
    """A token that is part of a multi-byte character is named by its bytes (the server's
    `bytes:\\xNN` convention), not U+FFFD; whole tokens keep their text."""
    tok = Tokenizer.default()
    tr = trace(random_model(SMALL_VOCAB), tok, "🤖 robot")
    assert tr.ids == [8582, 97, 244, 9379]
    assert tr.tokens == ["bytes:\\xf0\\x9f", "bytes:\\xa4", "bytes:\\x96", " robot"]
    data = tr.to_json()
    assert data["tokens"] == tr.tokens
    assert "\ufffd" not in json.dumps(data, ensure_ascii=False)
    assert data["vocab"]["9379"] == " robot" and data["vocab"]["97"] == "bytes:\\xa4"
