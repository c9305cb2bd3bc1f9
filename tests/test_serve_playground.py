"""The playground page at GET /, in headless Chromium through Playwright, against a live server on
loopback with a small random-weight model: it streams completions and chat replies that equal the
API's own, shows each token's log-prob and alternatives on hover, shows the API's errors, gives a
`gpt2kit trace` command that runs, asks for the API key where there is one, and requests nothing
but the server's own URLs. Skips where Playwright or Chromium is missing."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import SMALL, live_server, varied_model  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "src/gpt2kit/serve/assets/playground.html"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
KEY = "play-key-123"
WAIT = 120_000  # ms: a bound against a hang, far above what a step takes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(varied_model(SMALL, seed=0), d)
    return str(d)


def _server(model_dir, **opts):
    # the model's name is its directory, as `gpt2kit serve -m DIR` names it: the trace command runs as shown
    return live_server(lambda: (load_model(model_dir), load_tokenizer(model_dir)),
                       ServeOptions(served_model_name=model_dir, **opts))


@pytest.fixture(scope="module")
def server(model_dir):
    with _server(model_dir) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Page:
    """A fresh page on the playground that records every request it makes."""

    def __init__(self, browser, url: str) -> None:
        self.url = url
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.requests: list = []
        self.page.on("request", lambda r: self.requests.append(r))
        self.problems: list[str] = []  # script errors and console errors (a blocked script or style shows here)
        self.page.on("pageerror", lambda e: self.problems.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(m.text))
        self.page.set_default_timeout(WAIT)
        self.page.goto(url + "/")

    def models_loaded(self) -> None:
        self.page.wait_for_selector("body[data-models]", state="attached")

    def settings(self, **values) -> None:
        for name, v in values.items():
            self.page.fill(f"#{name}", str(v))

    def run(self) -> str:
        self.page.click("#run")
        self.page.wait_for_selector("body[data-state='done'], body[data-state='error']", state="attached")
        return self.page.get_attribute("body", "data-state")

    def outside(self) -> list[str]:
        return [r.url for r in self.requests if not r.url.startswith(self.url + "/")]

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, server):
    p = Page(browser, server)
    yield p
    p.close()


def test_the_page_is_served_self_contained_with_a_policy_that_allows_only_its_own_script(server):
    r = httpx.get(server + "/", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert html == PAGE.read_text(encoding="utf-8")
    # nothing the page loads names another place: no src/href but data:, no URL in its script or style
    assert re.findall(r'(?:src|href)="([^"]*)"', html) == ["data:,"]
    assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html.split("<script>")[1], re.I)
    csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    for tag in ("script", "style"):
        block = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.S).group(1)
        assert csp[f"{tag}-src"] == f"'sha256-{base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()}'"
    assert csp["connect-src"] == "'self'"
    assert csp["default-src"] == "'none'"
    assert "/" not in httpx.get(server + "/openapi.json", timeout=60).json()["paths"]  # no API


def test_the_page_streams_a_completion_and_shows_each_tokens_log_prob_on_hover(page, server, model_dir):
    prompt = "Hello, my name is"
    page.models_loaded()
    assert page.page.input_value("#model") == model_dir
    page.page.fill("#prompt", prompt)
    page.settings(max_tokens=8, temperature=0, logprobs=3)
    posts = []
    page.page.on("request", lambda r: r.method == "POST" and posts.append(json.loads(r.post_data)))
    assert page.run() == "done"
    sent = posts[-1]
    assert sent["stream"] is True and sent["logprobs"] == 3 and sent["prompt"] == prompt
    want = httpx.post(server + "/v1/completions", timeout=60,
                      json={"model": model_dir, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                            "logprobs": 3}).json()["choices"][0]
    tokens = page.page.locator(".choice[data-index='0'] .tok")
    assert tokens.all_text_contents() == want["logprobs"]["tokens"]
    assert page.page.get_attribute(".choice[data-index='0']", "data-text") == want["text"]
    assert int(page.page.get_attribute("body", "data-events")) >= 2  # it came in pieces
    for k in (0, 5):
        tokens.nth(k).hover()
        page.page.wait_for_selector("#tip:not([hidden])")
        tip = page.page.inner_text("#tip")
        shown = float(re.search(r"logprob (-?\d+\.\d+)", tip).group(1))
        assert abs(shown - want["logprobs"]["token_logprobs"][k]) <= 1e-4
        for alt, lp in want["logprobs"]["top_logprobs"][k].items():
            assert f"{json.dumps(alt, ensure_ascii=False)}\t{lp:.4f}" in tip
    border = page.page.eval_on_selector(".tok[data-lp]", "e => getComputedStyle(e).borderBottomStyle")
    assert border == "solid"  # the page's style applies under its policy
    assert page.outside() == [] and page.problems == []


def test_the_page_streams_n_seeded_samples_as_the_api_gives_them(page, server, model_dir):
    page.models_loaded()
    page.settings(max_tokens=6, temperature=1, seed=7, n=2, logprobs="")
    assert page.run() == "done"
    want = httpx.post(server + "/v1/completions", timeout=60,
                      json={"model": model_dir, "prompt": page.page.input_value("#prompt"), "max_tokens": 6,
                            "seed": 7, "n": 2}).json()["choices"]
    got = [page.page.get_attribute(f".choice[data-index='{i}']", "data-text") for i in range(2)]
    assert got == [c["text"] for c in sorted(want, key=lambda c: c["index"])]
    assert page.page.locator(".choice").count() == 2 and page.page.locator(".tok[data-lp]").count() == 0


def test_an_api_error_is_shown_in_the_page(page):
    page.models_loaded()
    page.settings(temperature=2, top_p=1, max_tokens=4, extra='{"top_k": -1}')
    assert page.run() == "error"
    error = page.page.inner_text("#error")
    assert error.startswith("400 invalid_request_error:") and "(param: top_k)" in error
    page.page.fill("#extra", "[1]")  # the page's own check: a clear line, nothing sent
    page.page.click("#run")
    page.page.wait_for_function("document.getElementById('error').textContent.startsWith('extra:')")
    assert page.page.inner_text("#error") == "extra: must be a JSON object of request fields"


def test_the_page_chats_and_keeps_the_conversation(page, server, model_dir):
    page.models_loaded()
    page.page.check("input[name='mode'][value='chat']")
    page.page.fill("#user", "What is a cat?")
    page.settings(max_tokens=6, temperature=0)
    assert page.run() == "done"
    want = httpx.post(server + "/v1/chat/completions", timeout=60,
                      json={"model": model_dir, "messages": [{"role": "user", "content": "What is a cat?"}],
                            "max_tokens": 6, "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert page.page.get_attribute(".choice[data-index='0']", "data-text") == want
    assert page.page.locator("#transcript .msg").all_inner_texts() == ["user\nWhat is a cat?", f"assistant\n{want}"]
    assert page.outside() == [] and page.problems == []


def test_the_trace_command_shown_runs_and_writes_the_report(page, tmp_path):
    page.models_loaded()
    page.page.fill("#prompt", "It's a 'quoted' -text")
    page.settings(max_tokens=4, temperature=0, logprobs="")
    assert page.run() == "done"
    page.page.click("#trace")
    argv = shlex.split(page.page.inner_text("#trace-cmd"))
    text = page.page.get_attribute(".choice[data-index='0']", "data-text")
    assert argv[:2] == ["gpt2kit", "trace"] and argv[-1] == "It's a 'quoted' -text" + text
    done = subprocess.run([sys.executable, "-m", "gpt2kit", *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "trace.html").stat().st_size > 0


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(browser, model_dir):
    with _server(model_dir, api_key=KEY) as (url, _):
        assert httpx.get(url + "/", timeout=60).status_code == 200  # the page holds no data
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 401
        p = Page(browser, url)
        try:
            p.page.wait_for_selector("#error:not([hidden])")
            assert "401" in p.page.inner_text("#error") and "API key" in p.page.inner_text("#error")
            assert p.page.evaluate("document.activeElement.id") == "api-key"
            p.page.fill("#api-key", KEY)
            p.page.dispatch_event("#api-key", "change")
            p.models_loaded()
            p.settings(max_tokens=4, temperature=0)
            assert p.run() == "done" and p.page.locator(".tok").count() == 4
            api = [r for r in p.requests if "/v1/" in r.url]
            assert api[-1].headers["authorization"] == f"Bearer {KEY}"
            assert p.page.evaluate("sessionStorage.getItem('gpt2kit.playground.apiKey')") == KEY
            assert p.outside() == []
        finally:
            p.close()
