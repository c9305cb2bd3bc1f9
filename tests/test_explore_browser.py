"""gpt2kit explore and the report's sampling panel driven in headless Chromium by Playwright: type a
text, move the sliders, append tokens, step through a block; the probabilities shown are the
model's (within the 0.05 percentage points of one decimal) and what gpt2kit's sampler computes, the
page asks nothing of any address but the app's, and it fits a phone's width.

Skips where Chromium or Playwright is missing (`apt-get install chromium`, `pip install playwright`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time

import pytest
import torch
from helpers import SMALL, varied_model

from gpt2kit.sampling.sampler import row_generator, sample, warp
from gpt2kit.sampling.settings import SamplingSettings
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import trace
from gpt2kit.trace.report import token_text

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("fastapi")

TEXT = "The cat sat on the mat. The cat sat on the"
SETTINGS = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.02}


@pytest.fixture(scope="module")
def model():
    return varied_model(SMALL)


@contextlib.contextmanager
def explorer(model):
    """The app on a free 127.0.0.1 port in a thread, stopped on the way out."""
    from gpt2kit.serve.explore_app import bind, server_for
    from gpt2kit.trace.explore import Explorer

    sock = bind(0)
    server = server_for(Explorer(model, Tokenizer.default(), name="small"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def browser_page(width: int, height: int = 900):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


def _pct(s: str) -> float:
    return float(s.rstrip("%"))


def _shown(page, box: str) -> list[tuple[int, float, float | None]]:
    """The table's rows: (token id, model p %, p % with the settings or None where removed)."""
    rows = page.eval_on_selector_all(f"{box} tr[data-id]", "rs => rs.map(r => [r.dataset.id, "
                                    "r.querySelector('.raw').textContent, r.querySelector('.warped').textContent])")
    return [(int(i), _pct(a), None if b == "removed" else _pct(b)) for i, a, b in rows]


def _set_sliders(page, prefix: str, values: dict) -> None:
    for name, v in values.items():
        page.eval_on_selector(f"#{prefix}{name.replace('_', '-')}", "(e, v) => { e.value = v; "
                              "e.dispatchEvent(new Event('input')); }", str(v))


def _check_distribution(rows, logits: torch.Tensor, settings: dict | None, removes: bool = True) -> None:
    """Each shown percentage within 0.05 points (one decimal) of the model's softmax and of the sampler's."""
    raw = torch.softmax(logits.double(), -1) * 100
    assert [i for i, _, _ in rows] == logits.topk(10).indices.tolist()
    warped = raw if settings is None else torch.softmax(warp(logits[None].float(), SamplingSettings(**settings))[0]
                                                        .double(), -1) * 100
    for i, a, b in rows:
        assert abs(a - float(raw[i])) <= 0.05 + 1e-9
        if b is None:
            assert float(warped[i]) == 0.0
        else:
            assert abs(b - float(warped[i])) <= 0.05 + 1e-9
    if settings is not None:  # the settings changed what is shown: they are tested, not passed through
        assert any(b is None for _, _, b in rows) if removes else any(abs(a - b) > 1 for _, a, b in rows)


def _last_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_explore_end_to_end(model):
    tok = Tokenizer.default()
    ids = tok.encode(TEXT)
    T, C = len(ids), SMALL.n_embd
    with explorer(model) as url, browser_page(1100) as page:
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url)
        page.wait_for_selector("body[data-gen][data-stages][data-report]", state="attached")
        page.fill("#text", TEXT)  # the page runs the text itself, half a second after the last key
        page.wait_for_function("([n, t]) => document.getElementById('gen-context').textContent === t && "
                               "(document.querySelector('#stage-input .shape') || {}).textContent === "
                               "'(T, C) = (' + n + ', 32)'", arg=[T, TEXT])
        page.wait_for_function("() => document.getElementById('count').textContent.startsWith('" + str(T) + " of')")
        assert page.inner_text("#js-errors").strip() == ""
        logits = _last_logits(model, ids)
        _check_distribution(_shown(page, "#gen-top"), logits, None)
        _set_sliders(page, "gen-", SETTINGS)
        _check_distribution(_shown(page, "#gen-top"), logits, SETTINGS)
        kept = int(torch.isfinite(warp(logits[None], SamplingSettings(**SETTINGS))).sum())
        assert page.inner_text("#gen-kept").startswith(f"{kept} of {SMALL.n_vocab} tokens")

        # append the greedy token, then a sampled one: the cache grows by one each time
        page.click("#append-greedy")
        page.wait_for_function("() => document.getElementById('gen-cache').textContent.includes('+ 1 appended')")
        greedy = int(logits.argmax())
        assert page.get_attribute("#gen-context .new", "data-id") == str(greedy)
        assert f"KV cache: {T + 1} positions" in page.inner_text("#gen-cache")
        ids2 = [*ids, greedy]
        logits2 = _last_logits(model, ids2)
        _check_distribution(_shown(page, "#gen-top"), logits2, SETTINGS)  # the sliders stay where they were
        page.fill("#seed", "5")
        page.click("#append-sample")
        page.wait_for_function("() => document.getElementById('gen-cache').textContent.includes('+ 2 appended')")
        drawn = sample(warp(logits2[None], SamplingSettings(**SETTINGS, seed=5)), [row_generator(5, 0, prompt=ids2)])
        want = int(drawn[0])
        assert page.eval_on_selector_all("#gen-context .new", "s => s[1].dataset.id") == str(want)

        # step through block 1, head 2, at position 5
        n = int(page.get_attribute("body", "data-stages"))
        page.select_option("#step-layer", "1")
        page.wait_for_selector(f'body[data-stages="{n + 1}"]', state="attached")
        page.select_option("#step-head", "2")
        page.wait_for_selector(f'body[data-stages="{n + 2}"]', state="attached")
        page.select_option("#step-pos", "5")
        page.wait_for_selector(f'body[data-stages="{n + 3}"]', state="attached")
        for _ in range(10):
            page.click("#step-next")
        assert page.get_attribute(".stage.cur", "data-key") == "scaled"
        assert "model.py: multihead_attn()" in page.inner_text(".stage.cur")
        tr = trace(model, tok, ids)
        q, k = tr["h.1.attn.q"][2], tr["h.1.attn.k"][2]
        want_rows = ((q @ k.T) / (C // SMALL.n_head) ** 0.5)[2:6, 0:6]  # rows 2..5 (4 up to 5), keys 0..5
        got = page.eval_on_selector_all(".stage.cur table.vals tr", "rs => rs.slice(1).map(r => "
                                        "Array.from(r.querySelectorAll('td')).map(c => parseFloat(c.textContent)))")
        assert torch.allclose(torch.tensor(got), want_rows, rtol=1e-4, atol=1e-6)

        # an intervention, the tour, the report's own panels
        n = int(page.get_attribute("body", "data-iv"))
        page.check("#iv-ablate")
        page.wait_for_selector(f'body[data-iv="{n + 1}"]', state="attached")
        assert page.locator("#iv-table tr").count() > 2
        page.click("#tour-next")
        page.click("#tour-show")
        frame = page.frame_locator("#report")
        assert frame.locator("#panel-tokens span.tok").count() == T + 1
        assert frame.locator("#panel-sample #samp-top tr").count() == 11
        _check_views(page, frame, tr)
        assert page.inner_text("#js-errors").strip() == ""
    port = url.split(":")[2].rstrip("/")
    outside = [r for r in requests if not r.startswith((f"http://127.0.0.1:{port}/", "about:", "data:"))]
    assert outside == [] and len(requests) >= 8


def _check_views(page, frame, tr) -> None:
    """The views on screen are trace()'s: every logit-lens cell's five tokens, their probabilities (as
    shown, 0 or 1 decimals) and the next token's rank; the attributed logit at the last position."""
    T, L = len(tr.ids), tr.config.n_layer
    page.wait_for_function("n => { const f = document.getElementById('report').contentDocument; "
                           "return document.body.hasAttribute('data-lens') && "
                           "f.querySelectorAll('#lens tr:first-child th').length === n; }", arg=T + 1)
    titles = frame.locator("#lens td").evaluate_all("tds => tds.map(td => td.title)")
    assert len(titles) == (L + 1) * T
    want = tr.logit_lens(k=5)
    for n, title in enumerate(titles):
        layer, t = L - n // T, n % T  # rows from the last layer down
        lines = title.split("\n")
        assert lines[0] == f"layer {layer}, position {t}"
        for k, line in enumerate(lines[1:6]):
            shown, name = line.split(" ", 1)
            assert name == json.dumps(token_text(tr.tokenizer, want["top_ids"][layer][t][k]), ensure_ascii=False)
            assert abs(float(shown.rstrip("%")) - 100 * want["top_probs"][layer][t][k]) <= 0.5 + 1e-9
        if t < T - 1:
            assert lines[6].endswith(f"rank {want['next_rank'][layer][t]}")
    text = frame.locator("#dla p.help").inner_text()
    logit = float(text.split(" = ")[1].split(" ")[0])
    assert logit == pytest.approx(float(tr.logits[-1].max()), rel=1e-4, abs=1e-4)


def test_explore_fits_a_phone(model):
    with explorer(model) as url, browser_page(390, 844) as page:
        page.goto(url)
        page.wait_for_selector("body[data-gen][data-stages][data-report][data-iv]", state="attached")
        assert page.inner_text("#js-errors").strip() == ""
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert page.locator("#gen-top tr[data-id]").count() == 10
        # the tour: every page's "show me" finds its live view; a stage page opens that stage
        shown = []
        for _ in range(17):
            page.click("#tour-show")
            shown.append((page.inner_text("#tour-title"), page.get_attribute(".stage.cur", "data-key")))
            page.click("#tour-next")
        assert page.inner_text("#tour-count") == "(17 of 17)" and page.inner_text("#js-errors").strip() == ""
        assert ("LayerNorm", "ln_1.norm") in shown and ("The causal mask", "masked") in shown
        assert page.locator(".lit").count() == 1  # the last page's target, marked


def test_a_bad_text_is_shown_not_thrown(model):
    with explorer(model) as url, browser_page(1000) as page:
        page.goto(url)
        page.wait_for_selector("body[data-gen]", state="attached")
        page.fill("#text", " a" * (SMALL.n_ctx + 5))
        page.wait_for_selector("body[data-error]", state="attached")
        assert f"n_ctx={SMALL.n_ctx}" in page.inner_text("#error")
        assert page.inner_text("#js-errors").strip() == ""


def test_the_report_sampling_panel(tmp_path, model):
    tok = Tokenizer.default()
    tr = trace(model, tok, TEXT, top_k=3)  # fewer than the ten shown: the panel names them itself
    path = tmp_path / "r.html"
    tr.save_html(path)
    with browser_page(1200) as page:
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-rendered]", state="attached")
        assert page.inner_text("#js-errors").strip() == ""
        logits = tr.logits[-1]
        _check_distribution(_shown(page, "#samp-top"), logits, None)
        assert "<" not in page.inner_text("#samp-top td.tk")  # named, not <id>
        off = {"temperature": 1, "top_k": 0, "top_p": 1, "min_p": 0}
        for one in ({"temperature": 1.6}, {"top_k": 4}, {"top_p": 0.6}, {"min_p": 0.15}, SETTINGS):
            _set_sliders(page, "samp-", {**off, **one})
            _check_distribution(_shown(page, "#samp-top"), logits, {**off, **one}, removes="temperature" not in one)
        _set_sliders(page, "samp-", {"temperature": 0})
        assert page.inner_text("#samp-kept").startswith("temperature below 1e-5: greedy")
        rows = _shown(page, "#samp-top")
        assert rows[0][2] == 100.0 and all(b is None for _, _, b in rows[1:])
