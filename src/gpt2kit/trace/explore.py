"""`gpt2kit explore`: the trace as a local web app, one page served on a loopback address.

The page (assets/explore.html, .css, .js and the sampling code it shares with the static report)
is served by the app itself and fetches nothing else, so it works offline. Its numbers come from
gpt2kit.trace: the views are the trace's report page, drawn in the page from the same data the static
report holds (gpt2kit.trace.report.page_data: the numbers rounded to 5 significant digits, attention
as uint8), sent as JSON for each text; the logit lens, most of the work, comes in a second request so
the other views appear without waiting for it. The block stepper
reads the same Trace (gpt2kit.trace.stages), and generation runs the model with a KVCache, one
token per step at the position the cache's length gives (a traced text's cache starts from the keys
and values its trace recorded). One lock serialises every use of the
model: the trace's hooks sit on the model's own modules while it records.

Routes (gpt2kit.serve.explore_app; JSON in and out, a bad value is a 400 naming it):
  GET  /                 the page
  GET  /api/info         the model's name and shape
  POST /api/trace        {text} -> ids, tokens and the views' data (page_data, the logit lens left out)
  POST /api/lens         {text} -> the logit lens and the names of its tokens (report.lens_data)
  POST /api/stages       {text, layer, head, position, rows, cols} -> gpt2kit.trace.stages.block_stages
  POST /api/gen/start    {text} -> a generation session: the last position's logits (float32, base64)
  POST /api/gen/append   {session, mode: greedy | sample, temperature, top_k, top_p, min_p, seed}
  POST /api/intervene    {text, ablate: [names], steer: {name, text, scale}} -> clean vs intervened next tokens
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

import torch

from gpt2kit.trace.report import asset, b64_f32, fill_page, lens_data, page_data, token_text, views_page

MAX_SESSIONS = 4  # generation sessions kept (each holds a KV cache of n_ctx positions); the oldest goes
TOP_SENT = 50  # tokens named with each distribution: the shown top 10 always come from the raw top 10


class SessionGone(LookupError):
    """A generation session the app no longer holds (404)."""


class Explorer:
    """The model, its tokenizer and the app's state: the last trace and the generation sessions."""

    def __init__(self, model, tokenizer, name: str = "") -> None:
        if model.training:
            raise ValueError("explore shows inference: call model.eval() first")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.lock = threading.Lock()
        self._last: tuple[tuple[int, ...], object] | None = None
        self.sessions: OrderedDict[str, dict] = OrderedDict()

    @property
    def config(self):
        return self.model.config

    def info(self) -> dict:
        cfg = self.config
        return {"model": self.name, "config": {k: getattr(cfg, k) for k in ("n_vocab", "n_ctx", "n_embd", "n_head",
                                                                             "n_layer")}}

    def ids(self, text: str) -> list[int]:
        if not text:
            raise ValueError("the text is empty: type something")
        ids = self.tokenizer.encode(text)
        n_ctx = self.config.n_ctx
        if len(ids) > n_ctx:
            raise ValueError(f"the text is {len(ids)} tokens, more than the model's context n_ctx={n_ctx}")
        return ids

    def trace(self, text: str):
        """The Trace of the text (everything recorded), the last one kept for the stepper."""
        from gpt2kit.trace import KINDS, trace
        from gpt2kit.trace.record import DEFAULT_MAX_BYTES, estimate_bytes

        ids = self.ids(text)
        cfg = self.config
        need = estimate_bytes(cfg, len(ids), frozenset(KINDS), range(cfg.n_layer))
        if need > DEFAULT_MAX_BYTES:  # the big sizes at long texts: say what to shorten, not trace's flags
            raise ValueError(f"recording every tensor of this model for {len(ids)} tokens needs ~{need / 2**20:,.0f} "
                             f"MiB, over the limit of {DEFAULT_MAX_BYTES / 2**20:,.0f} MiB: use a shorter text")
        if self._last is None or self._last[0] != tuple(ids):
            self._last = (tuple(ids), trace(self.model, self.tokenizer, ids, name=self.name))
        return self._last[1]

    def views(self, text: str) -> dict:
        """The views of the text but the logit lens: what report.js's render draws."""
        with self.lock:
            tr = self.trace(text)
            return {"ids": tr.ids, "tokens": tr.tokens, "views": page_data(tr, lens=False)}

    def lens(self, text: str) -> dict:
        with self.lock:
            return lens_data(self.trace(text))

    def stages(self, text: str, layer: int, head: int, position: int, rows: int, cols: int) -> dict:
        from gpt2kit.trace.stages import block_stages

        with self.lock:
            tr = self.trace(text)
            out = block_stages(tr, layer, head, position, rows, cols)
        out["tokens"] = tr.tokens
        out["vocab"] = {str(i): token_text(self.tokenizer, i) for i, _ in out["stages"][-1]["top"]}
        return out

    # --- generation, one token at a time on a KV cache ------------------------------------------
    def _state(self, sid: str, s: dict, logits: torch.Tensor) -> dict:
        s["logits"] = logits
        top = logits.topk(min(TOP_SENT, logits.numel())).indices.tolist()
        return {"session": sid, "ids": s["ids"], "tokens": [token_text(self.tokenizer, i) for i in s["ids"]],
                "prompt_length": s["prompt_length"], "cache_length": s["cache"].length,
                "n_ctx": self.config.n_ctx, "logits": b64_f32(logits), "greedy": top[0],
                "vocab": {str(i): token_text(self.tokenizer, i) for i in top}}

    @torch.no_grad()
    def gen_start(self, text: str) -> dict:
        from gpt2kit.kv_cache import KVCache

        ids = self.ids(text)
        with self.lock:
            got = self._recorded(ids)
            if got is None:
                cache = KVCache.for_model(self.model, 1, self.config.n_ctx)
                idx = torch.tensor([ids], device=self.model.wpe.weight.device)
                got = cache, self.model(idx, cache=cache).logits[0, -1].float()  # (V,): the last position's
            cache, logits = got
            sid = secrets.token_hex(8)
            s = {"ids": list(ids), "prompt_length": len(ids), "cache": cache}
            self.sessions[sid] = s
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
            return self._state(sid, s, logits)

    def _recorded(self, ids: list[int]):
        """(a KV cache, the last position's logits) from the kept trace when it is of these ids: the page
        traces a text before it generates from it, and the trace recorded every block's keys and values."""
        from gpt2kit.kv_cache import KVCache

        if self._last is None or self._last[0] != tuple(ids):
            return None
        tr, L = self._last[1], self.config.n_layer
        if any(f"h.{i}.attn.{x}" not in tr.tensors for i in range(L) for x in "kv"):
            return None
        p = self.model.wpe.weight
        kv = [torch.stack([tr[f"h.{i}.attn.k"], tr[f"h.{i}.attn.v"]]) for i in range(L)]  # L x (2, nh, T, hs)
        present = torch.stack(kv)  # (L, 2, nh, T, hs)
        cache = KVCache.from_present(present[None].to(p.device, p.dtype), self.config.n_ctx)
        return cache, tr.logits[-1].float()

    @torch.no_grad()
    def gen_append(self, sid: str, mode: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, seed: int = 0) -> dict:
        from gpt2kit.sampling.sampler import row_generator, sample, warp
        from gpt2kit.sampling.settings import SamplingSettings

        if mode not in ("greedy", "sample"):
            raise ValueError(f"mode must be greedy or sample, got {mode!r}")
        settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        with self.lock:
            s = self.sessions.get(sid)
            if s is None:
                raise SessionGone(f"no generation session {sid!r} (at most {MAX_SESSIONS} are kept): start again")
            cache = s["cache"]
            if cache.length >= self.config.n_ctx:
                raise ValueError(f"the context is full: n_ctx={self.config.n_ctx} tokens")
            logits = s["logits"][None]  # (1, V)
            if mode == "greedy" or settings.greedy:
                token = int(logits.argmax())
            else:
                gen = row_generator(seed, 0, prompt=s["ids"])  # the same seed and context, the same draw
                token = int(sample(warp(logits, settings), [gen])[0])
            idx = torch.tensor([[token]], device=self.model.wpe.weight.device)
            # one new token at position cache.length; the earlier keys and values are read from the cache
            new = self.model(idx, cache=cache).logits[0, -1].float()
            s["ids"].append(token)
            self.sessions.move_to_end(sid)
            return {**self._state(sid, s, new), "appended": token}

    def intervene(self, text: str, ablate: list[str], steer: dict | None) -> dict:
        """The last position's next tokens with and without the interventions (gpt2kit.trace.intervene):
        ablate names zero-ablated; steer {name, text, scale} adds scale x the unit vector of the steer
        text's last-position tensor at that name."""
        from gpt2kit.trace import ablate as ablation
        from gpt2kit.trace import steer as steering
        from gpt2kit.trace import trace

        ivs = [ablation(n) for n in ablate]
        ids = self.ids(text)
        with self.lock:
            if steer is not None:
                ivs.append(steering(steer["name"], self._direction(steer["text"], steer["name"]),
                                    float(steer["scale"])))
            if not ivs:
                raise ValueError("nothing to change: give ablate names or a steer")
            tr = trace(self.model, self.tokenizer, ids, what="resid", interventions=ivs, name=self.name)
            eff = tr.intervention_effect(k=10)
        return {"interventions": eff["interventions"], "rows": eff["last"], "kl_last": eff["kl"][-1],
                "vocab": {str(i): token_text(self.tokenizer, i) for i, _, _ in eff["last"]}}

    def _direction(self, text: str, name: str) -> torch.Tensor:
        """The unit vector of the text's last-position tensor at the name (so a scale reads in norms)."""
        from gpt2kit.trace.points import capture_run, resolve

        canon, head = resolve(name, self.config.n_layer, self.config.n_head)
        if head is not None or canon.split(".")[-1] in ("q", "k", "v", "z"):
            raise ValueError(f"steer at a residual, attention or MLP output, not a per-head tensor ({name!r})")
        got, _ = capture_run(self.model, self.ids(text), [canon])
        x = got[canon][-1].float()  # (C,)
        return x / x.norm().clamp_min(1e-12)


def page(ex: Explorer) -> str:
    """The one page: its CSS and scripts inline, the model's shape and the views' page (the report's,
    without data; its frame draws each text's views) as data."""
    data = {**ex.info(), "views_page": views_page(f"gpt2kit trace — {ex.name or 'model'}")}
    return fill_page(asset("explore.html"), f"gpt2kit explore — {ex.name or 'model'}", asset("explore.css"),
                     asset("sampling.js") + asset("explore.js"), data)
