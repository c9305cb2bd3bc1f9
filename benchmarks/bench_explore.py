"""gpt2kit explore: how long a text update takes to appear in the browser, on a gpt2-124M-sized network.

Random weights (the cost does not depend on their values), GPT-2's tokenizer, a text of --tokens
tokens. The app runs in this process (a thread, as `gpt2kit explore` serves it) and headless Chromium
(Playwright, /usr/bin/chromium or --chromium) opens its page. Each round puts a new text in the box,
presses "run" (so the half-second pause after the last key is not counted) and waits, inside the
page, until

  answer  the page's first request for the text (/api/trace) is answered: the server's part
  views   the trace views are drawn (tokens, attention, attribution, norms, walk-through; and the logit
          lens, where the page draws it with them)
  all     every panel has updated: the block stepper, the next-token panel, the interventions, and the
          logit lens where the page fetches it on its own

then one more animation frame (so the page has painted). Times are read by the page's own clock
(performance.now), so the driver's round trips do not count. Then one next-token step: "append the
greedy token", to the next-token panel redrawn. Medians over the rounds, after one warm-up round.

To compare two checkouts, run this script with each one's src first on PYTHONPATH, alternating:

    PYTHONPATH=src python benchmarks/bench_explore.py                  # gpt2 (124M), 64 tokens, 5 rounds
    PYTHONPATH=src python benchmarks/bench_explore.py --rounds 9 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import threading
import time

import torch

from gpt2kit.config import GPT2Config
from gpt2kit.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.tokenizer import Tokenizer

BASE = ("When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat and "
        "looked at the birds outside the window, while the rain kept falling on the old town. ")

# In the page: put the text in the box, press run, and resolve with the page-clock times at which each
# counter on <body> (the page's own "this update is done" marks) has moved on, one frame later.
_UPDATE_JS = """async ([text, views, all]) => {
  const b = document.body, at = {}, t0 = performance.now(), fetch0 = window.fetch;
  window.fetch = function (path, opts) {  // when the text's first request is answered (its headers)
    const r = fetch0(path, opts);
    if (path === '/api/trace') r.then(() => { at.answer = performance.now() - t0; });
    return r;
  };
  const before = {}; for (const k of all) before[k] = +(b.getAttribute('data-' + k) || 0);
  const frame = () => new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  const moved = keys => keys.every(k => +(b.getAttribute('data-' + k) || 0) > before[k]);
  const wait = keys => new Promise(res => {
    if (moved(keys)) { res(); return; }
    const obs = new MutationObserver(() => { if (moved(keys)) { obs.disconnect(); res(); } });
    obs.observe(b, {attributes: true});
  });
  document.getElementById('text').value = text;
  document.getElementById('run').click();
  const v = wait(views).then(frame).then(() => { at.views = performance.now() - t0; });
  await wait(all); await frame(); at.all = performance.now() - t0; await v;
  window.fetch = fetch0;
  return at;
}"""

_STEP_JS = """async () => {
  const b = document.body, n = +(b.getAttribute('data-gen') || 0), t0 = performance.now();
  document.getElementById('append-greedy').click();
  await new Promise(res => { const obs = new MutationObserver(() => {
    if (+(b.getAttribute('data-gen') || 0) > n) { obs.disconnect(); res(); } });
    obs.observe(b, {attributes: true}); });
  await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
}"""

VIEWS = ["report"]  # the page's mark for "the trace views are drawn"
ALL = ["report", "stages", "gen", "iv", "lens"]  # those the page sets (a page without "lens" draws it with "report")


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def texts(tok, T: int, n: int) -> list[str]:
    """n different texts of exactly T tokens each (the same words, shifted)."""
    ids = tok.encode(BASE * (T // 20 + 4))
    out = []
    for i in range(n):
        text = tok.decode(ids[i * 3:i * 3 + T])
        if len(tok.encode(text)) != T:  # a cut that merges differently: drop a token until it fits
            text = tok.decode(ids[i * 3 + 1:i * 3 + T + 1])
        assert len(tok.encode(text)) == T, text
        out.append(text)
    return out


def serve(model, tok, name: str):
    """The app on a free loopback port in a daemon thread: (URL, the server)."""
    from gpt2kit.serve.explore_app import bind, server_for
    from gpt2kit.trace.explore import Explorer

    sock = bind(0)
    server = server_for(Explorer(model, tok, name=name))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/", server


def run(model, tok, *, tokens: int, rounds: int, chromium: str, width: int = 1100, name: str = "model") -> dict:
    """{answer, views, all, step: [seconds]} for `rounds` updates of a `tokens`-token text, after a warm-up."""
    from playwright.sync_api import sync_playwright

    url, server = serve(model, tok, name)
    out: dict[str, list[float]] = {"answer": [], "views": [], "all": [], "step": []}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.set_default_timeout(120_000)
                page.goto(url)
                page.wait_for_selector("body[data-gen][data-stages][data-report][data-iv]", state="attached")
                page.wait_for_timeout(3000)  # the first text's last request (the lens) answered
                marks = [k for k in ALL if page.get_attribute("body", f"data-{k}") is not None]
                for i, text in enumerate(texts(tok, tokens, rounds + 1)):
                    at = page.evaluate(_UPDATE_JS, [text, VIEWS, marks])
                    step = page.evaluate(_STEP_JS)
                    errors = page.inner_text("#js-errors").strip()
                    if errors:
                        raise RuntimeError(f"the page reported errors: {errors}")
                    if i:  # the first round warms up
                        for k in ("answer", "views", "all"):
                            out[k].append(at[k] / 1e3)
                        out["step"].append(step / 1e3)
            finally:
                browser.close()
    finally:
        server.should_exit = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2", help="a gpt2kit.config preset, random weights (default gpt2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--json", help="also write the times to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name(args.preset)).eval()
    tok = Tokenizer.default()
    load0 = _load()
    t = run(model, tok, tokens=args.tokens, rounds=args.rounds, chromium=args.chromium, name=args.preset)
    load1 = _load()
    med = {k: statistics.median(v) for k, v in t.items()}
    print(f"machine: {describe_cpu()}; torch {torch.__version__}, {args.threads} threads; {args.preset}, "
          f"random weights, float32; {args.tokens} tokens; {args.rounds} rounds, medians")
    print(f"load average (1, 5, 15 min) before/after: {load0} / {load1}")
    print(f"{'answer s':>9} {'views s':>8} {'all s':>6} {'next token s':>13}   (each round: views / all / step)")
    print(f"{med['answer']:>9.3f} {med['views']:>8.3f} {med['all']:>6.3f} {med['step']:>13.3f}   " + "  ".join(
        f"{a:.2f}/{b:.2f}/{c:.2f}" for a, b, c in zip(t["views"], t["all"], t["step"], strict=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "tokens": args.tokens, "threads": args.threads, "load": [load0, load1],
                       **t, "median": med}, f)


if __name__ == "__main__":
    main()
