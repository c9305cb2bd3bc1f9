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
    names = ("report.html", "report.css", "report.js", "sampling.js")
    return "".join(root.joinpath(n).read_text(encoding="utf-8") for n in names)


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


def _nan_from(p: int):
    """A hook that makes every position from p on NaN (what a bad hook or weight does to the logits)."""
    def fn(x):  # (T, C)
        x = x.clone()
        x[p:] = float("nan")
        return x
    return fn


def test_non_finite_logits_are_marked_not_averaged_as_zero(tiny_model):
    from gpt2kit.trace import hook

    T, p = 10, 4
    tr = trace(tiny_model, None, list(range(T)), interventions=[hook("h.1.mlp.out", _nan_from(p))])
    assert bool(tr.logits[:p].isfinite().all()) and bool(tr.logits[p:].isnan().all())
    stats = tr.to_json()["stats"]
    assert stats["finite_logits"] == [True] * p + [False] * (T - p)
    clean = trace(tiny_model, None, list(range(T))).next_token_stats()["surprisal_bits"]
    assert stats["mean_surprisal_bits"] == pytest.approx(sum(clean[:p]) / p, rel=1e-5)  # causal: the first p agree
    assert trace(tiny_model, None, list(range(T))).next_token_stats()["mean_surprisal_bits"] == \
        pytest.approx(sum(clean) / len(clean), rel=1e-6)


def test_compare_file_reads_the_comparison_as_file_reads_the_text(model_dir, tmp_path, capsys):
    text = "class Point:\n    def __init__(self, path):\n        self.path = path\n"
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.py").write_text(text.replace("path", "name"))
    js = tmp_path / "t.json"
    rc = main(["trace", "--model", str(model_dir), "--file", str(tmp_path / "a.py"),
               "--compare-file", str(tmp_path / "b.py"), "--json", str(js)])
    assert rc == 0, capsys.readouterr().err
    want = Tokenizer.default().encode(text.replace("path", "name"))
    assert json.loads(js.read_text())["patching"]["corrupt_ids"] == want
    # what `--compare "$(sed s/path/name/g a.py)"` passes: the same text without its final newline
    for argv, needle in [
        (["--file", str(tmp_path / "a.py"), "--compare", text.replace("path", "name").rstrip("\n")],
         "the difference is a trailing newline: the text ends with one, the comparison does not"),
        ([text.rstrip("\n"), "--compare-file", str(tmp_path / "b.py")],
         "the difference is a trailing newline: the comparison ends with one, the text does not"),
        ([text, "--compare", "class Point:\n    def f(self, x, y, z):\n        self.x = x"],
         "one difference is a trailing newline"),
        ([text, "--compare", "x", "--compare-file", str(tmp_path / "b.py")], "not both"),
    ]:
        rc = main(["trace", "--model", str(model_dir), *argv, "--json", str(tmp_path / "x.json")])
        err = capsys.readouterr().err
        assert rc == 1 and needle in err and len(error_lines(err)) == 1, (argv, err)
    with pytest.raises(ValueError, match="pair 1: clean has .* the difference is a trailing newline: clean ends"):
        trace(random_model(SMALL_VOCAB), Tokenizer.default(), None, pairs=[{"clean": text, "corrupt": text.rstrip()}])


def test_the_docs_patching_recipe_runs(model_dir, tmp_path):
    """docs/trace.md's command for its picture, as written, on a small model (bash, sed)."""
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "trace.md").read_text(encoding="utf-8")
    snippet = re.search(r"```python\n(class Point:.*?)```", doc, re.S).group(1)
    cmd = re.search(r"`(sed s/path/name/g point\.py > point_name\.py && gpt2kit trace [^`]*)`", doc).group(1)
    assert "--compare-file point_name.py" in cmd and "$(" not in cmd
    cmd = cmd.replace("gpt2kit trace", f"{sys.executable} -m gpt2kit trace").replace("runs/stdlib", str(model_dir))
    tok = Tokenizer.default()
    for final in ("", "\n"):  # as the page says (no final newline: 51 tokens), and as an editor saves it
        (tmp_path / "point.py").write_text(snippet.rstrip("\n") + final)
        r = subprocess.run(["bash", "-c", cmd + " --json t.json"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        data = json.loads((tmp_path / "t.json").read_text())
        assert len(data["ids"]) == len(tok.encode(snippet.rstrip("\n"))) + len(final) == 51 + len(final)
        assert data["patching"]["corrupt_ids"] == tok.encode((snippet.rstrip("\n") + final).replace("path", "name"))
        assert (tmp_path / "r.html").stat().st_size > 0


def test_the_walk_through_comes_early_and_empty_optional_panels_are_left_out(tiny_model, tmp_path):
    from gpt2kit.trace import ablate

    page = trace(tiny_model, None, list(range(8))).to_html()
    assert 'id="panel-sae"' not in page and 'id="panel-intervene"' not in page
    at = [page.index(f'<section id="panel-{p}"') for p in ("tokens", "walk", "heads", "lens", "dla", "norms", "patch")]
    assert at == sorted(at)  # the walk-through right after the tokens
    page = trace(tiny_model, None, list(range(8)), interventions=[ablate("h.0.mlp")]).to_html()
    assert page.index('<section id="panel-tokens"') < page.index('<section id="panel-intervene"') < \
        page.index('<section id="panel-walk"') and 'id="panel-sae"' not in page
