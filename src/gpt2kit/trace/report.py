"""The trace as data (`report_data`, what --json writes) and as one self-contained HTML file.

The HTML (assets/report.html, .css and .js with sampling.js, filled in here) holds all its data and code inline:
no src/href/import points anywhere, so it opens offline in a browser, in Jupyter
(Trace._repr_html_) and in VS Code's preview. Attention maps travel as base64 uint8
(probability x 255), other numbers rounded to 5 significant digits; --json keeps full precision.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from importlib import resources

import torch

from gpt2kit.trace.views import lens_layers

# The walk-through, in the spec's order: (name suffix, title, equation, note). {l} is the block.
_BLOCK_STEPS = [
    ("ln_1", "LN₁", "X̂ = LN₁(H<sup>(l−1)</sup>) = (H − μ) / σ · g₁ + b₁",
     "normalise each position's residual vector (μ, σ over its C numbers), then scale and shift"),
    ("attn.q", "queries", "Q = X̂ W<sub>q</sub> + b<sub>q</sub>  (split into heads)",
     "c_attn makes Q, K and V in one product; each head gets its own hs-wide slice"),
    ("attn.k", "keys", "K = X̂ W<sub>k</sub> + b<sub>k</sub>", ""),
    ("attn.v", "values", "V = X̂ W<sub>v</sub> + b<sub>v</sub>", ""),
    ("attn.scores", "scores", "S = Q Kᵀ / √d<sub>h</sub>,  S<sub>ij</sub> = −∞ for j &gt; i",
     "each query compares itself with every earlier key; the mask hides the future"),
    ("attn.probs", "attention", "P = softmax(S)  (each row sums to 1)", "how much position t reads from each key"),
    ("attn.z", "weighted values", "Z = P V", "per head, a mix of the values of the positions it attends to"),
    ("attn.out", "attention output", "A<sup>(l)</sup> = merge(Z) W<sub>proj</sub> + b<sub>proj</sub>",
     "the heads side by side, projected back to C"),
    ("resid_mid", "residual after attention", "H′ = H<sup>(l−1)</sup> + A<sup>(l)</sup>", "added, not replaced"),
    ("ln_2", "LN₂", "LN₂(H′)", ""),
    ("mlp.pre", "MLP pre-activation", "U = LN₂(H′) W<sub>fc</sub> + b<sub>fc</sub>", "width 4C"),
    ("mlp.post", "GELU", "G = 0.5 U (1 + tanh(√(2/π) (U + 0.044715 U³)))", "GPT-2's tanh GELU"),
    ("mlp.out", "MLP output", "M<sup>(l)</sup> = G W<sub>mproj</sub> + b<sub>mproj</sub>", "back to width C"),
]


def _round(x: float, spec: str = ".5g") -> float | None:
    if x is None or not math.isfinite(x):
        return None if x is None or math.isnan(x) else (1e30 if x > 0 else -1e30)
    return float(format(x, spec))


def _round_tree(obj, digits: int = 5):
    spec = f".{digits}g"

    def walk(o):
        if type(o) is float:
            return _round(o, spec)
        if isinstance(o, list):  # most leaves are floats in long lists: no call per element to find that out
            return [_round(v, spec) if type(v) is float else walk(v) for v in o]
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        return _round(o, spec) if isinstance(o, float) else o

    return walk(obj)


def _row(t: torch.Tensor, n: int = 6) -> dict:
    """A few numbers of one row (the first n) and the row's norm; -inf (masked) becomes None."""
    t = t.float()
    finite = torch.isfinite(t)
    vals = [v if ok else None for v, ok in zip(t[:n].tolist(), finite[:n].tolist(), strict=True)]
    return {"first": vals, "norm": float(t.where(finite, 0.0).norm()), "n": t.numel()}


def walkthrough(tr, position: int) -> list[dict]:
    """The forward pass for this input in the spec's order, each step with its equation, shape and numbers."""
    T, cfg = len(tr.ids), tr.config
    steps: list[dict] = [{
        "block": None, "name": "ids", "title": "tokens", "eq": "X = (x<sub>1</sub>, …, x<sub>T</sub>)",
        "shape": [T], "note": f"{T} token ids; no token is added", "row": {"first": tr.ids[:6], "norm": None,
                                                                          "n": T}}]
    for name, title, eq, note in (
            ("embed.tok", "token embedding", "wte[X]", "row x<sub>t</sub> of wte, C numbers per token"),
            ("embed.pos", "position embedding", "wpe[pos],  pos = 0 … T−1", "row t of wpe"),
            ("resid.0", "residual stream", "H<sup>(0)</sup> = wte[X] + wpe[pos]", "the stream every block adds to")):
        if name in tr.tensors:
            steps.append({"block": None, "name": name, "title": title, "eq": eq, "note": note,
                          "shape": list(tr[name].shape), "row": _row(tr[name][position])})
    for i in range(cfg.n_layer):
        for suffix, title, eq, note in _BLOCK_STEPS:
            name = f"h.{i}.{suffix}"
            if name not in tr.tensors:
                continue
            t = tr[name]
            row = t[0, position] if t.dim() == 3 else t[position]  # head 0 for per-head tensors
            steps.append({"block": i, "name": name, "title": title + (" (head 0)" if t.dim() == 3 else ""),
                          "eq": eq.replace("(l)", f"({i + 1})").replace("(l−1)", f"({i})"), "note": note,
                          "shape": list(t.shape), "row": _row(row)})
        name = f"resid.{i + 1}"
        if name in tr.tensors:
            steps.append({"block": i, "name": name, "title": "residual after the block",
                          "eq": f"H<sup>({i + 1})</sup> = H′ + M<sup>({i + 1})</sup>", "note": "",
                          "shape": list(tr[name].shape), "row": _row(tr[name][position])})
    L = cfg.n_layer
    steps.append({"block": None, "name": "ln_f", "title": "final LayerNorm", "eq": f"LN<sub>f</sub>(H<sup>({L})</sup>)",
                  "note": "", "shape": list(tr["ln_f"].shape), "row": _row(tr["ln_f"][position])})
    logits = tr.logits[position].float()
    steps.append({"block": None, "name": "logits", "title": "logits",
                  "eq": f"logits = LN<sub>f</sub>(H<sup>({L})</sup>) wteᵀ", "note": "the tied head: no separate matrix",
                  "shape": list(tr.logits.shape), "row": _row(logits)})
    p, i = torch.softmax(logits, -1).topk(5)
    steps.append({"block": None, "name": "probs", "title": "next-token distribution", "eq": "softmax(logits)",
                  "note": "the five most likely next tokens", "shape": [cfg.n_vocab],
                  "top": [[int(a), float(b)] for a, b in zip(i, p, strict=True)]})
    return steps


# The patching grids leave a cell blank when its effect is under this: a fraction restored under 0.01,
# or a metric change under 0.01 of the grid's largest (the value stays in the cell's tooltip).
BLANK_BELOW = 0.01

# Attention maps are nh * T^2 numbers per block; above these many, later blocks' maps are left out
# (their scores stay) so a long input still makes a file a browser opens. The npz has them all.
MAX_ATTENTION_BYTES = 12 * 2**20  # HTML, one byte each
MAX_ATTENTION_FLOATS = 2 * 2**20  # --json, ~20 characters each


def _attention(tr, encoding: str | None) -> dict | None:
    recorded = [i for i in tr.layers if f"h.{i}.attn.probs" in tr.tensors]
    if not recorded or encoding is None:
        return None
    T, nh = len(tr.ids), tr.config.n_head
    fit = max(1, (MAX_ATTENTION_FLOATS if encoding == "list" else MAX_ATTENTION_BYTES) // (nh * T * T))
    layers = recorded[:fit]
    P = torch.stack([tr[f"h.{i}.attn.probs"].float().cpu() for i in layers])  # (nL, nh, T, T)
    summary = {k: (v[:len(layers)] if k != "layers" else layers) for k, v in tr.attention_summary().items()}
    out = {"layers": layers, "shape": list(P.shape), "summary": summary, "omitted": recorded[len(layers):]}
    if encoding == "list":
        out["probs"] = P.tolist()
    else:
        u8 = (P * 255).round().clamp(0, 255).to(torch.uint8).numpy().tobytes()
        out["u8"] = base64.b64encode(u8).decode("ascii")
    return out


def report_data(tr, *, attention_encoding: str | None = "list", position: int = -1, lens: bool = True) -> dict:
    """Everything the report shows, as plain JSON-able data; lens=False leaves the logit lens out (None:
    the unembedding of every layer is most of the work, so `gpt2kit explore` sends it second)."""
    cfg, T = tr.config, len(tr.ids)
    data: dict = {
        "model": tr.name, "config": {k: getattr(cfg, k) for k in ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")},
        "ids": tr.ids, "tokens": tr.tokens, "shapes": {k: list(v) for k, v in tr.shapes().items()},
        "stats": tr.next_token_stats(), "lens": tr.logit_lens(k=5) if lens else None,
        "norms": {"layers": lens_layers(tr), "values": tr.residual_norms().tolist()},
        "attention": _attention(tr, attention_encoding), "walk": walkthrough(tr, position % T),
        "walk_position": position % T,
    }
    try:
        data["dla"] = tr.direct_logit_attribution()
    except ValueError as e:  # a partial selection: say why the panel is empty
        data["dla"] = {"unavailable": str(e)}
    data["patching"] = tr.patching.to_json() if tr.patching is not None else None
    if data["patching"] is not None:
        data["patching"]["blank_below"] = BLANK_BELOW
    data["intervention"] = None
    data["sae"] = tr.sae_features()
    used = set(tr.ids)
    if tr.clean is not None:
        data["intervention"] = {**tr.intervention_effect(), "clean_lens": tr.clean_logit_lens(k=5)}
        used.update(i for i, _, _ in data["intervention"]["last"])
        used.update(lens_ids(data["intervention"]["clean_lens"]))
    for rows in data["stats"]["top_ids"]:
        used.update(rows)
    used.update(lens_ids(data["lens"]))
    if "tokens" in data["dla"]:
        used.update(data["dla"]["tokens"])
    for step in data["walk"]:
        used.update(a for a, _ in step.get("top", []))
    if tr.patching is not None:
        used.update(t for t in (tr.patching.answer, tr.patching.foil) if t is not None)
    data["vocab"] = {str(i): _token_text(tr, i) for i in sorted(used)}
    return data


def lens_ids(lens: dict | None) -> set[int]:
    """The token ids a logit lens names."""
    return set() if lens is None else {i for layer in lens["top_ids"] for rows in layer for i in rows}


def token_text(tokenizer, i: int) -> str:
    """Token i as the report names it: its text when its bytes are UTF-8 on their own, else
    `bytes:\\xNN...` (a piece of a multi-byte character; the server's log-probs use the same
    convention), `<i>` without a tokenizer or for an id it does not know."""
    if tokenizer is None:
        return f"<{i}>"
    try:
        b = tokenizer.decode_bytes([i])
    except ValueError:
        return f"<{i}>"
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def _token_text(tr, i: int) -> str:
    return token_text(tr.tokenizer, i)


def asset(name: str) -> str:
    return resources.files("gpt2kit.trace").joinpath("assets", name).read_text(encoding="utf-8")


# Panels with nothing to show without their option are left out of the page.
_OPTIONAL_PANELS = (("intervene", "intervention"), ("sae", "sae"))


def _template(data: dict) -> str:
    page = asset("report.html")
    for panel, key in _OPTIONAL_PANELS:
        if data[key] is None:
            page = re.sub(rf'<section id="panel-{panel}".*?</section>\n', "", page, count=1, flags=re.S)
    return page


def b64_f32(t: torch.Tensor) -> str:
    """A tensor's numbers as little-endian float32, base64 (what a page's Float32Array reads)."""
    return base64.b64encode(t.detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()).decode("ascii")


# The sampling panel computes in the page from the last position's full logits (V float32, base64),
# so every setting's distribution is exact, its normaliser included.
SAMPLING_SHOWN = 10


def sampling_data(tr) -> dict:
    last = tr.logits[-1]
    top = last.float().topk(min(SAMPLING_SHOWN, last.numel())).indices.tolist()
    return {"position": len(tr.ids) - 1, "logits": b64_f32(last), "vocab": {str(i): _token_text(tr, i) for i in top}}


def fill_page(template: str, title: str, css: str, js: str, data) -> str:
    """A page template's __TITLE__, __CSS__, __JS__ and __DATA__ (data as JSON) filled in."""
    # "</script" or "<!--" in the text would end or confuse the script element; "<" can only sit
    # inside JSON strings, where \u003c means the same.
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=True).replace("<", "\\u003c")
    fill = {"TITLE": html.escape(title), "CSS": css, "JS": js, "DATA": payload}
    # One pass, so a placeholder-like string inside the user's text is never substituted.
    return re.sub(r"__(TITLE|CSS|JS|DATA)__", lambda m: fill[m.group(1)], template)


def page_data(tr, *, lens: bool = True) -> dict:
    """What the page's script draws (report.js's render): report_data with the attention maps as uint8,
    the numbers rounded to 5 significant digits, and the sampling panel's float32 logits."""
    data = _round_tree(report_data(tr, attention_encoding="u8", lens=lens))
    data["sampling"] = sampling_data(tr)  # after rounding: the logits stay float32
    return data


def lens_data(tr) -> dict:
    """The logit lens alone, rounded as page_data rounds it, with the names of the tokens it shows."""
    lens = _round_tree(tr.logit_lens(k=5))
    return {"lens": lens, "vocab": {str(i): _token_text(tr, i) for i in sorted(lens_ids(lens))}}


def _page(data: dict | None, title: str) -> str:
    return fill_page(_template(data or {key: None for _, key in _OPTIONAL_PANELS}), title, asset("report.css"),
                     asset("sampling.js") + asset("report.js"), data)


def render_html(tr) -> str:
    return _page(page_data(tr), f"gpt2kit trace — {tr.name or 'model'} — {len(tr.ids)} tokens")


def views_page(title: str) -> str:
    """The report page with no data: its script draws what GPT2Report.render(data) is given (page_data)."""
    return _page(None, title)
