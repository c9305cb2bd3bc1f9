"""The trace report in a real browser: headless Chromium renders every panel with no JavaScript error.

Skips where no Chromium is installed (Debian/Ubuntu: `apt-get install chromium`). The page writes
any error (window.onerror, unhandled rejections, a panel that threw) into #js-errors and sets
body[data-rendered] when it has finished; --dump-dom shows both.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from helpers import TINY, random_model

from gpt2kit.trace import trace

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")


def _chromium(tmp_path, url: str, *extra: str) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


class _Counter(HTMLParser):
    """Counts elements by (section id, tag, class) and collects #js-errors' text and body's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.section: str | None = None
        self.counts: dict[tuple[str | None, str], int] = {}
        self.in_errors = False
        self.errors = ""
        self.body: dict[str, str | None] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.section = a.get("id")
        if tag == "body":
            self.body = a
        self.in_errors = a.get("id") == "js-errors"
        for key in (tag, *(f"{tag}.{c}" for c in (a.get("class") or "").split())):
            self.counts[(self.section, key)] = self.counts.get((self.section, key), 0) + 1

    def handle_endtag(self, tag):
        if tag == "pre":
            self.in_errors = False

    def handle_data(self, data):
        if self.in_errors:
            self.errors += data

    def n(self, section: str, key: str) -> int:
        return self.counts.get((section, key), 0)


def test_every_panel_renders_without_javascript_errors(tmp_path):
    m = random_model()
    T = 20
    clean = [(7 * i) % TINY.n_vocab for i in range(T // 2)] * 2  # a repeat: induction scores exist
    corrupt = list(clean)
    corrupt[3] = 999
    tr = trace(m, None, clean, patch_from=corrupt, name="tiny random")
    page = tmp_path / "report.html"
    tr.save_html(page)
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    p = _Counter()
    p.feed(dom)
    assert p.errors.strip() == ""
    assert p.body.get("data-rendered") == "ok"
    L, nh = TINY.n_layer, TINY.n_head
    assert p.n("panel-tokens", "span.tok") == T + 1  # every token and the "next" marker
    assert p.n("panel-heads", "div.hcell") == L * nh and p.n("panel-heads", "canvas") == L * nh + 1  # + the large one
    assert p.n("panel-lens", "tr") == L + 2  # header + H(0) .. H(L)
    assert p.n("panel-lens", "td") == (L + 1) * T
    assert p.n("panel-dla", "option") == T and p.n("panel-dla", "div.bar") >= 2 * L + 3
    assert p.n("panel-norms", "polyline") == 1 and p.n("panel-norms", "circle") == (L + 1) * T
    assert p.n("panel-patch", "td") == (L + 1) * T
    n_steps = 4 + L * 14 + 3  # tokens/embeddings, 14 steps per block, ln_f/logits/probs
    assert p.n("panel-walk", "div.step") == n_steps and p.n("panel-walk", "details") == L


def test_a_page_error_is_caught_and_shown(tmp_path):
    """The error channel the test above relies on does report: a broken data block shows up."""
    m = random_model()
    html = trace(m, None, [1, 2, 3]).to_html()
    broken = re.sub(r'("walk":)\[', r'\1{"oops":', html, count=1)  # walk is no longer a list: a panel throws
    assert broken != html
    page = tmp_path / "broken.html"
    page.write_text(broken, encoding="utf-8")
    p = _Counter()
    p.feed(_chromium(tmp_path, page.as_uri(), "--dump-dom"))
    assert p.body.get("data-rendered") in ("with-errors", None) and p.errors.strip() != ""


def test_a_partial_selection_renders_without_errors(tmp_path):
    """--layers/--what leave some panels with less (or nothing) to show; none of them may throw."""
    tr = trace(random_model(), None, list(range(12)), layers="1", what="probs")
    page = tmp_path / "partial.html"
    tr.save_html(page)
    p = _Counter()
    p.feed(_chromium(tmp_path, page.as_uri(), "--dump-dom"))
    assert p.errors.strip() == "" and p.body.get("data-rendered") == "ok"
    assert p.n("panel-heads", "div.hcell") == TINY.n_head  # one block's heads
    assert p.n("panel-lens", "tr") == 2  # only H(L) is recorded


def test_the_large_map_on_load_is_the_outlined_thumbnail(tmp_path):
    tr = trace(random_model(), None, list(range(12)))
    page = tmp_path / "r.html"
    tr.save_html(page)
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    sel = re.findall(r'<div class="hcell sel" data-layer="(\d+)" data-head="(\d+)"', dom)
    shown = re.search(r'<div class="help">block (\d+), head (\d+) \(rows: query', dom)
    assert len(sel) == 1 and shown is not None
    assert sel[0] == shown.groups()


def test_the_docs_screenshot_command_works(tmp_path):
    """docs/trace.md's chromium command, as written (run as root here, which needs --no-sandbox)."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "trace.md").read_text(encoding="utf-8")
    cmd = re.search(r"`(chromium --headless[^`]*)`", doc).group(1)
    page = tmp_path / "r.html"
    trace(random_model(), None, list(range(8))).save_html(page)
    argv = cmd.replace("file://$PWD/r.html", page.as_uri()).split()
    argv[0] = CHROMIUM
    argv.insert(1, f"--user-data-dir={tmp_path / 'profile'}")
    subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=120)
    assert (tmp_path / "screenshot.png").stat().st_size > 1000


def test_the_docs_picture_script_renders_a_small_png(tmp_path):
    """scripts/trace_picture.py (docs/trace_report.png's maker): Playwright on the installed Chromium,
    the page at the given width, cut above the walk-through, a palette PNG."""
    import sys
    from pathlib import Path

    pytest.importorskip("playwright")
    PIL = pytest.importorskip("PIL.Image")
    page, png = tmp_path / "r.html", tmp_path / "r.png"
    trace(random_model(), None, list(range(12))).save_html(page)
    script = Path(__file__).parents[1] / "scripts" / "trace_picture.py"
    subprocess.run([sys.executable, str(script), str(page), str(png), "--width", "1400", "--chromium", CHROMIUM],
                   check=True, capture_output=True, timeout=180)
    with PIL.open(png) as im:
        assert im.size[0] == 1400 and 1000 < im.size[1] and im.mode == "P"
    assert png.stat().st_size < 300 * 1024


def test_an_intervened_report_shows_both_runs(tmp_path):
    from gpt2kit.trace import ablate

    T = 12
    tr = trace(random_model(), None, list(range(T)), interventions=[ablate("h.1.attn.head.0"), ablate("h.0.mlp")])
    page = tmp_path / "iv.html"
    tr.save_html(page)
    p = _Counter()
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    p.feed(dom)
    assert p.errors.strip() == "" and p.body.get("data-rendered") == "ok"
    assert p.n("panel-intervene", "li") == 2
    n_last = len(tr.intervention_effect()["last"])
    L = TINY.n_layer
    # the last-position table (header + rows), the per-position table (3 rows), the clean lens
    assert p.n("panel-intervene", "tr") == (1 + n_last) + (1 + 3) + (L + 2)
    assert "INTERVENED run" in dom


def test_patching_panel_states_its_metric_and_shows_attribution(tmp_path):
    T = 10
    clean = list(range(T))
    corrupt = list(clean)
    corrupt[2] = 999
    # the plain random model: the clean and corrupted metric differ by ~1e-4, so the panel must warn
    tr = trace(random_model(), None, clean, patch_from=corrupt, patch_mode="heads", attribution=True)
    page = tmp_path / "p.html"
    tr.save_html(page)
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    p = _Counter()
    p.feed(dom)
    assert p.errors.strip() == "" and p.body.get("data-rendered") == "ok"
    assert p.n("panel-patch", "td") == 2 * TINY.n_layer * TINY.n_head  # exact grid + attribution grid
    assert 'id="patch-warning"' in dom and "amplified noise" in dom
    assert re.search(r'id="patch-metric">Metric: logit (difference|of)', dom)
    assert 'id="patch-attr-help"' in dom


# Measures, after the report has drawn: table cells whose text is cut off, and whether the page
# itself is wider than the window (long tables must scroll inside their panel instead).
_MEASURE = """<script>(function(){var n=0,c=document.querySelectorAll('td,th'),bad=[];
for(var i=0;i<c.length;i++){if(c[i].scrollWidth>c[i].clientWidth+1){n++;if(bad.length<3)bad.push(c[i].textContent);}}
document.body.setAttribute('data-clipped',n+' '+JSON.stringify(bad));
document.body.setAttribute('data-page-wider',String(document.documentElement.scrollWidth>window.innerWidth+1));
})();</script></body>"""


@pytest.mark.parametrize("width", [1200, 1600])
def test_tables_are_readable_at_common_widths(tmp_path, width):
    from gpt2kit.config import GPT2Config
    from gpt2kit.tokenizer import Tokenizer

    m = random_model(GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2))
    text = ("If you are in the top window, CTRL-W w jumps to the window below it. If you are in the "
            "bottom window, CTRL-W w jumps to the")
    corrupt = text.replace("top", "left")
    tr = trace(m, Tokenizer.default(), text, patch_from=corrupt)
    page = tmp_path / "w.html"
    page.write_text(tr.to_html().replace("</body>", _MEASURE), encoding="utf-8")
    dom = _chromium(tmp_path, page.as_uri(), f"--window-size={width},900", "--dump-dom")
    p = _Counter()
    p.feed(dom)
    assert p.errors.strip() == ""
    assert p.body.get("data-clipped", "").startswith("0 "), p.body.get("data-clipped")
    assert p.body.get("data-page-wider") == "false"


_KEY_COLUMN = """<script>(function(){var g=document.getElementById('patch-grid'),w=g.parentNode,out=0;
var b=w.getBoundingClientRect();
var rows=g.querySelectorAll('tr');for(var i=0;i<rows.length;i++){var r=rows[i].lastElementChild.getBoundingClientRect();
if(r.right>b.right+1||r.left<b.left-1)out++;}
document.body.setAttribute('data-key',out+' '+rows.length+' '+(w.scrollWidth>w.clientWidth+1));})();</script></body>"""


def test_patching_grid_blanks_small_effects_and_keeps_the_last_position_in_view(tmp_path):
    from helpers import varied_model

    from gpt2kit.tokenizer import Tokenizer
    from gpt2kit.trace.report import BLANK_BELOW

    m = varied_model()  # a clean - corrupted difference of 15 logits: the cells are fractions restored
    text = ("If you are in the top window, CTRL-W w jumps to the window below it. If you are in the "
            "bottom window, CTRL-W w jumps to the")
    tr = trace(m, Tokenizer.default(), text, patch_from=text.replace("top", "left"))
    page = tmp_path / "k.html"
    page.write_text(tr.to_html().replace("</body>", _KEY_COLUMN), encoding="utf-8")
    dom = _chromium(tmp_path, page.as_uri(), "--window-size=1200,900", "--dump-dom")
    out, rows, scrolls = re.search(r'data-key="(\d+) (\d+) (\w+)"', dom).groups()
    assert scrolls == "true" and int(rows) == len(tr.patching.rows) + 1  # the grid is wider than its panel ...
    assert out == "0"  # ... and the last column, where the metric is read, is in view in every row
    P = tr.patching
    assert P.shown == "restored"
    V, small = P.restored, BLANK_BELOW
    want = [v is not None and abs(v) >= small for row in reversed(V) for v in row]  # the grid's top row is the last
    grid = re.search(r'<table class="lens" id="patch-grid">(.*?)</table>', dom, re.S).group(1)
    got = [text != "" for text in re.findall(r"<td[^>]*>([^<]*)</td>", grid)]
    assert got == want
    assert sum(v is not None and abs(v) < small for row in V for v in row) > 0  # some were blanked
    assert f"or the effect is under {BLANK_BELOW}" in dom


def test_the_sae_panel_renders(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    d, F = tmp_path / "sae", 24
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"W_enc": torch.randn(TINY.n_embd, F, generator=g), "b_enc": torch.zeros(F),
               "W_dec": torch.randn(F, TINY.n_embd, generator=g), "b_dec": torch.zeros(TINY.n_embd)},
              str(d / "sae_weights.safetensors"))
    (d / "cfg.json").write_text(json.dumps({"d_in": TINY.n_embd, "d_sae": F, "architecture": "standard",
                                            "metadata": {"hook_name": "blocks.1.hook_resid_pre"}}))
    T = 9
    tr = trace(random_model(), None, list(range(T)), sae=d)
    page = tmp_path / "s.html"
    tr.save_html(page)
    p = _Counter()
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    p.feed(dom)
    assert p.errors.strip() == "" and p.body.get("data-rendered") == "ok"
    assert p.n("panel-sae", "tr") == T + 1 and p.n("panel-sae", "li") == len(tr.sae_features()["features"]) > 0
    assert 'id="sae-summary"' in dom and "fraction of variance explained" in dom


def test_non_finite_logits_show_a_note_not_white_tokens(tmp_path):
    from gpt2kit.trace import hook

    T, p = 10, 4

    def nan_from(x):
        x = x.clone()
        x[p:] = float("nan")
        return x
    tr = trace(random_model(), None, list(range(T)), interventions=[hook("h.1.mlp.out", nan_from)])
    page = tmp_path / "nan.html"
    tr.save_html(page)
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    c = _Counter()
    c.feed(dom)
    assert c.errors.strip() == "" and c.body.get("data-rendered") == "ok"
    note = re.search(r'<p class="warn" id="nonfinite">([^<]*)</p>', dom)
    assert note and f"not finite (NaN or ±inf) at {T - p} of {T} positions (4, 5, 6, 7, 8, 9)" in note.group(1)
    # tokens p+1 .. T-1 and the "next" marker are predicted from NaN logits
    assert c.n("panel-tokens", "span.nonfinite") == T - p
    assert "(over the positions with finite logits)" in dom and "mean surprisal 0.00" not in dom
