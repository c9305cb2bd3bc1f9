"""Render a `gpt2kit trace` report in headless Chromium and save a small PNG of its panels.

docs/trace_report.png is made with it (docs/trace.md says from what). Playwright drives the
Chromium already installed (no browser download); `--no-sandbox` because Chromium refuses to run
as root without it. The page is shown at --width px without the panels named by --hide (default:
the step-by-step walk-through), the picture runs from the top down to the panel named by --until
(default: the whole page), and its colours are reduced to a palette so the file stays small.
--click clicks elements first (a head's thumbnail, to show its map large); --scroll-end scrolls
every table that scrolls inside its panel to its right end (the last positions, where the
prediction is).

    pip install playwright pillow          # the [docs] extra
    python scripts/trace_picture.py report.html docs/trace_report.png --width 1400 \
        --click '.hcell[data-layer="0"][data-head="1"]' --scroll-end
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def render(html: Path, png: Path, *, width: int, until: str | None, colors: int, chromium: str,
           click: list[str], scroll_end: bool, hide: list[str]) -> tuple[int, int]:
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto(html.resolve().as_uri())
        page.wait_for_selector("body[data-rendered]", state="attached", timeout=60_000)
        errors = page.inner_text("#js-errors").strip()
        if errors:
            raise SystemExit(f"the report's script failed: {errors.splitlines()[0]}")
        for panel in hide:
            if not page.evaluate("id => { const e = document.getElementById(id); if (e) e.style.display = 'none';"
                                 " return e !== null; }", panel):
                raise SystemExit(f"no element #{panel} in the report")
        for selector in click:
            page.click(selector)
        if scroll_end:
            page.evaluate("document.querySelectorAll('.scroll').forEach(e => { e.scrollLeft = e.scrollWidth; })")
        height = page.evaluate("document.documentElement.scrollHeight")
        if until:
            box = page.query_selector(f"#{until}")
            if box is None:
                raise SystemExit(f"no element #{until} in the report")
            height = int(box.bounding_box()["y"]) - 4
        raw = png.with_suffix(".raw.png")
        page.screenshot(path=str(raw), full_page=True, clip={"x": 0, "y": 0, "width": width, "height": height})
        browser.close()
    with Image.open(raw) as im:
        small = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
        small.save(png, optimize=True)
        size = im.size
    raw.unlink()
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--until", default="", help="element id where the picture stops (default: the whole page)")
    ap.add_argument("--hide", action="append", default=None,
                    help="an element id left out of the picture (repeatable; default panel-walk, '' for none)")
    ap.add_argument("--colors", type=int, default=64)
    ap.add_argument("--click", action="append", default=[], help="a CSS selector to click before the picture")
    ap.add_argument("--scroll-end", action="store_true", help="scroll tables that scroll in their panel to the right")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("no chromium found: give --chromium PATH")
    w, h = render(args.html, args.png, width=args.width, until=args.until or None, colors=args.colors,
                  chromium=args.chromium, click=args.click, scroll_end=args.scroll_end,
                  hide=[h for h in (args.hide if args.hide is not None else ["panel-walk"]) if h])
    print(f"{args.png}: {w} x {h} px, {args.png.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
