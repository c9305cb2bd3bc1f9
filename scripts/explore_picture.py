"""A small PNG of `gpt2kit explore`'s page: the app on a free 127.0.0.1 port, the page in headless
Chromium (Playwright, the installed browser; `--no-sandbox` because Chromium refuses root without it),
a text typed in, the sliders moved, the block stepper at its softmax stage (the tour hidden), the top
--height pixels kept, the colours reduced to a palette. docs/explore.png is made with it (docs/explore.md
says from what).

    pip install playwright pillow          # the [docs] extra
    python scripts/explore_picture.py tiny-gpt2 docs/explore.png --text "The cat sat on the mat. The cat sat on the"
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path


def render(model_path: str, png: Path, *, text: str, width: int, height: int, chromium: str, colors: int) -> None:
    from PIL import Image
    from playwright.sync_api import sync_playwright

    from gpt2kit import load_model, load_tokenizer
    from gpt2kit.serve.explore_app import bind, server_for
    from gpt2kit.trace.explore import Explorer

    sock = bind(0)
    server = server_for(Explorer(load_model(model_path), load_tokenizer(model_path), name=Path(model_path).name))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(f"http://127.0.0.1:{sock.getsockname()[1]}/")
            page.wait_for_selector("body[data-gen][data-stages]", state="attached", timeout=120_000)
            page.fill("#text", text)
            page.wait_for_function("t => document.getElementById('gen-context').textContent === t", arg=text,
                                   timeout=120_000)
            for name, v in (("gen-temperature", "0.8"), ("gen-top-k", "40")):
                page.eval_on_selector(f"#{name}", "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }", v)
            page.evaluate("document.getElementById('tour').style.display = 'none'")
            for _ in range(12):  # the stepper at the softmax of the attention scores
                page.click("#step-next")
            raw = png.with_suffix(".raw.png")
            page.screenshot(path=str(raw), clip={"x": 0, "y": 0, "width": width, "height": height})
            browser.close()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    with Image.open(raw) as im:
        im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)
    raw.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("png", type=Path)
    ap.add_argument("--text", default="The cat sat on the mat. The cat sat on the")
    ap.add_argument("--width", type=int, default=900)
    ap.add_argument("--height", type=int, default=1720)
    ap.add_argument("--colors", type=int, default=48)
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("no chromium found: give --chromium PATH")
    render(args.model, args.png, text=args.text, width=args.width, height=args.height, chromium=args.chromium,
           colors=args.colors)
    print(f"{args.png}: {args.png.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
