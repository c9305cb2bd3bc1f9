"""Why the first differing stage differs: targeted probes.

A stage is recomputed from the learner's own input to it (so earlier rounding does not count) with
the reference weights, once as GPT-2 computes it and once per known mistake (checker.variants); the
variant the learner's output equals within the tolerance names the mistake. Weights that did not
load come first: a stage whose tensors found no place in the learner's model is explained by that.
Legend: B batch, T tokens, C n_embd, nh heads, hs head size, V vocab.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import gpt2kit.checker.variants as var
from gpt2kit.checker.mapping import WeightMap
from gpt2kit.checker.stages import StageResult, close, fit, max_abs
from gpt2kit.config import GPT2Config

Candidate = tuple[str, Callable[[], torch.Tensor]]


@dataclass
class Evidence:
    cfg: GPT2Config
    state: dict[str, torch.Tensor]  # the reference weights, by gpt2kit's names
    ids: torch.Tensor  # (B, T)
    got: dict[str, torch.Tensor]  # the learner's recorded module inputs and outputs (stages.Recorder)
    ref: dict[str, torch.Tensor]  # the reference's stage values (stages.reference_stages)
    wm: WeightMap
    points: dict[str, str]
    shapes: dict[str, tuple[int, ...]]  # the learner's parameter shapes
    tol: float

    def mine(self, *keys: str) -> torch.Tensor | None:
        """The learner's tensor at the first key recorded, in the (B, T, C) shape."""
        B, T = self.ids.shape
        for key in keys:
            x = fit(self.got.get(key), (B, T, self.cfg.n_embd))
            if x is not None:
                return x
        return None

    def w(self, name: str) -> torch.Tensor:
        return self.state[name].float()


RIGHT = "computed as GPT-2 computes it"  # a probe's verdict: the stage is right given its own input


@dataclass
class Probe:
    out: torch.Tensor  # the learner's value at the stage
    candidates: list[tuple[str | None, Callable[[], torch.Tensor]]]  # (mistake, or None for GPT-2's own; value)


def best_match(candidates: list[Candidate], out: torch.Tensor, tol: float) -> str | None:
    """The message of the candidate closest to out, if one is within tol."""
    found = decide(Probe(out, list(candidates)), tol, lenient=False)
    return None if found == RIGHT else found


def decide(probe: Probe, tol: float, lenient: bool) -> str | None:
    """The mistake the learner's value equals: the closest variant, within tol and closer than GPT-2's
    own computation (lenient: at least ten times closer, for a stage that passed but fed the
    difference on); RIGHT when GPT-2's own computation is what matches; None when nothing does."""
    def dist(compute: Callable[[], torch.Tensor]) -> float:
        y = compute()
        d = max_abs(y, probe.out) if y.shape == probe.out.shape else math.inf
        return math.inf if math.isnan(d) else d

    scored = [(dist(compute), message) for message, compute in probe.candidates]
    right = min((d for d, m in scored if m is None), default=math.inf)
    d, message = min(((d, m) for d, m in scored if m is not None), key=lambda r: r[0], default=(math.inf, None))
    if lenient:
        return message if d <= tol and d * 10 < right else None
    if message is not None and d <= tol and d < right:
        return message
    return RIGHT if right <= tol else None


def _parse(label: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"block (\d+) (.+)", label)
    if m:
        return m.group(2), int(m.group(1))
    return {"embeddings + positions": "embeddings"}.get(label, label), None


_PREFIXES = {"embeddings": ("wte.", "wpe."), "ln_1": ("h.{i}.ln_1.",), "attention": ("h.{i}.attn.",),
             "ln_2": ("h.{i}.ln_2.",), "mlp": ("h.{i}.mlp.",), "final norm": ("ln_f.",), "logits": ()}
_POINT = {"ln_1": "h.{i}.ln_1", "attention": "h.{i}.attn", "ln_2": "h.{i}.ln_2", "mlp": "h.{i}.mlp",
          "final norm": "ln_f"}


def _weights(kind: str, i: int | None, ev: Evidence) -> str | None:
    """A stage explained by weights that did not load: theirs left unset, or GPT-2's left unused."""
    if kind == "logits":
        return _head_weights(ev)
    prefixes = tuple(p.format(i=i) for p in _PREFIXES.get(kind, ()))
    unused = [u for u in ev.wm.unused if u.startswith(prefixes)] if prefixes else []
    path = ev.points.get(_POINT.get(kind, "").format(i=i))
    unset = [n for n, _ in ev.wm.unset if path and n.startswith(path + ".")]
    if unused:
        bias = " (GPT-2 has biases there; nn.Linear and nn.LayerNorm have one unless bias=False)" \
            if all(u.split(" ")[0].endswith(".bias") for u in unused) else ""
        return f"GPT-2's {', '.join(unused)} went into no parameter of yours{bias}; see the weights lines"
    if unset:
        return f"your {', '.join(unset)} kept the values your model was built with (no GPT-2 tensor fits it)"
    return None


def _head_weights(ev: Evidence) -> str | None:
    V, C = ev.cfg.n_vocab, ev.cfg.n_embd
    for name, why in ev.wm.unset:
        if "lm_head.bias" in why:
            return (f"your head has a bias ({name}); GPT-2's head has none: nn.Linear(n_embd, vocab_size, "
                    "bias=False)")
    wte = ev.wm.learner_for("wte.weight") or "wte.weight"
    for name, _ in ev.wm.unset:
        if not any(p.isdigit() for p in name.split(".")) and sorted(ev.shapes.get(name, ())) == sorted((V, C)):
            module = name.rpartition(".")[0] or name
            return (f"your head {name} {ev.shapes[name]} is not tied to the token embedding and kept the values it "
                    f"was built with: GPT-2 has no head matrix of its own, its logits are ln_f(x) @ wte^T; tie it "
                    f"(self.{module}.weight = self.{wte.rpartition('.')[0]}.weight) or call it lm_head")
    return None


def _embeddings(ev: Evidence) -> Probe | None:
    out = ev.mine("h.0.block.in", "h.0.ln_1.in", "h.0.attn.in")
    T, C = ev.ids.shape[1], ev.cfg.n_embd
    if out is None or T >= ev.cfg.n_ctx:
        return None
    wte, wpe = ev.w("wte.weight")[ev.ids], ev.w("wpe.weight")
    return Probe(out, [
        (None, lambda: wte + wpe[:T]),
        ("the position embeddings are not added: x = wte(idx) + wpe(pos)", lambda: wte),
        ("positions start at 1; GPT-2's first position is 0: pos = torch.arange(0, T)", lambda: wte + wpe[1:T + 1]),
        (f"the token embeddings are multiplied by sqrt(n_embd) = {math.sqrt(C):.4g}, as the 2017 Transformer does; "
         "GPT-2 adds them unscaled: x = wte(idx) + wpe(pos)", lambda: wte * math.sqrt(C) + wpe[:T]),
        ("the positions are the 2017 Transformer's fixed sinusoids; GPT-2 learns them: wpe = nn.Embedding(n_ctx, "
         "n_embd), x = wte(idx) + wpe(pos)", lambda: wte + var.sinusoids(T, C)),
    ])


_EPS_TRIED = (1e-6, 1e-12, 1e-8, 1e-7, 1e-4, 1e-3, 1e-2)


def ln_candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> list[Candidate]:
    """LayerNorm's usual mistakes on input x with GPT-2's gain w and bias b (the first: GPT-2's own)."""
    out: list[Candidate] = [(None, lambda: var.layer_norm(x, w, b))]
    out += [(f"its LayerNorm eps is {e:g}; GPT-2's is 1e-5 (nn.LayerNorm's default)",
             lambda e=e: var.layer_norm(x, w, b, e)) for e in _EPS_TRIED]
    return out + [
        ("its LayerNorm divides by the unbiased standard deviation (torch.var's default, over C - 1); "
         "GPT-2's LayerNorm uses the biased one: x.var(dim=-1, keepdim=True, unbiased=False)",
         lambda: var.layer_norm(x, w, b, unbiased=True)),
        ("its LayerNorm ignores its gain and bias (elementwise_affine=False, or weights not applied)",
         lambda: var.layer_norm(x, w, b, affine=False)),
        ("its LayerNorm adds no bias (shift); GPT-2's has one", lambda: var.layer_norm(x, w, b, bias=False)),
        ("its LayerNorm has gain and bias exchanged (scale * norm + shift, loaded the other way round)",
         lambda: var.layer_norm(x, w, b, swap=True)),
        ("it is an RMSNorm (no mean taken away); GPT-2 uses LayerNorm",
         lambda: var.layer_norm(x, w, b, rms=True)),
        ("it is an RMSNorm without bias; GPT-2 uses LayerNorm", lambda: var.layer_norm(x, w, b, rms=True, bias=False)),
    ]


def _norm(kind: str, i: int | None, ev: Evidence) -> Probe | str | None:
    key = {"ln_1": f"h.{i}.ln_1", "ln_2": f"h.{i}.ln_2", "final norm": "ln_f"}[kind]
    out = ev.mine(f"{key}.out")
    if out is None:
        return None
    w, b = ev.w(f"{key}.weight"), ev.w(f"{key}.bias")
    given = ev.mine(f"{key}.in")
    if kind == "ln_1" and given is not None and close(var.layer_norm(given, w, b), out, ev.tol):
        h, a = ev.mine(f"h.{i}.block.in"), ev.mine(f"h.{i}.attn.out")
        if h is not None and a is not None and close(given, h + a, ev.tol) and not close(given, h, ev.tol):
            return ("post-norm: ln_1 normalises x + attn(x), after the residual; GPT-2 is pre-norm: "
                    "x = x + self.attn(self.ln_1(x)), then x = x + self.mlp(self.ln_2(x))")
    if given is None:
        L = ev.cfg.n_layer
        given = ev.ref[{"ln_1": f"resid.{i}", "ln_2": f"h.{i}.resid_mid", "final norm": f"resid.{L}"}[kind]]
    who = "the final norm" if kind == "final norm" else f"block {i}'s {kind}"
    return Probe(out, [(m and f"{who}: {m}", f) for m, f in ln_candidates(given, w, b)])


def _sublayer_input(i: int, ev: Evidence, sub: str, norm: str, unnormed: str, wrong: str
                    ) -> tuple[torch.Tensor, torch.Tensor] | str | None:
    """Block i's sublayer `sub` (attn, mlp): its output and the input to probe it with (the learner's own
    where it differs from norm's output), or the diagnosis when that input is the un-normed `unnormed`
    point (the words `wrong`); None where the sublayer's output is not observed."""
    out = ev.mine(f"h.{i}.{sub}.out")
    x = ev.mine(f"h.{i}.{norm}.out")
    x = ev.ref[f"h.{i}.{norm}"] if x is None else x
    if out is None:
        return None
    projection_only = ev.points.get(f"h.{i}.{sub}") == ev.wm.owners.get(f"h.{i}.{sub}.c_proj.weight")
    given = None if projection_only else ev.mine(f"h.{i}.{sub}.in")
    if given is not None and not close(given, x, ev.tol):
        h = ev.mine(f"h.{i}.{unnormed}")
        if h is not None and close(given, h, ev.tol):
            return wrong
        x = given
    return out, x


def _attention(i: int, ev: Evidence) -> Probe | str | None:
    found = _sublayer_input(i, ev, "attn", "ln_1", "block.in",
                            "the attention is given the block's input x, not ln_1(x): x = x + self.attn(self.ln_1(x))")
    if found is None or isinstance(found, str):
        return found
    out, x = found
    p = f"h.{i}.attn."
    weights = (ev.w(p + "c_attn.weight"), ev.w(p + "c_attn.bias"), ev.w(p + "c_proj.weight"), ev.w(p + "c_proj.bias"))
    nh, C = ev.cfg.n_head, ev.cfg.n_embd
    hs = C // nh

    def att(**kw) -> Callable[[], torch.Tensor]:
        return lambda: var.attention(x, *weights, nh, **kw)

    prev = ("the causal mask is shifted by one: no position sees itself (tril(..., diagonal=-1), or a triu mask "
            "of what to hide without diagonal=1); position t must see keys 0..t")
    candidates = [
        (None, att()),
        (f"the attention scores are not scaled: GPT-2 divides q k^T by sqrt(d_head) = sqrt({hs}) before the "
         "softmax", att(scale="none")),
        (f"the scores are divided by sqrt(n_embd) = sqrt({C}); GPT-2 divides by sqrt(d_head) = sqrt({hs}), the "
         "head size", att(scale="embd")),
        (f"the scores are divided by d_head = {hs}; GPT-2 divides by its square root", att(scale="hs")),
        ("the causal mask is applied after the softmax, so each row no longer sums to 1: mask the scores "
         "(masked_fill(mask == 0, float('-inf'))) and then take the softmax", att(mask="after")),
        ("there is no causal mask: every position also attends to the positions after it", att(mask="none")),
        ("the causal mask is shifted by one: each position also sees the next token (tril(..., diagonal=1)); "
         "position t must see keys 0..t: torch.tril(torch.ones(T, T))", att(mask="next")),
        (prev, att(mask="prev")), (prev, att(mask="prev", fill=-1e9)),
        ("the softmax runs over the wrong axis (dim=-2, the queries); it must normalise over the keys, the last "
         "axis: softmax(att, dim=-1)", att(softmax_dim=-2)),
        ("the heads are split with a plain view(B, nh, T, hs); each head takes its own hs channels: "
         "view(B, T, nh, hs).transpose(1, 2)", att(split="view")),
        ("the heads take interleaved channels (view(B, T, hs, nh)); head h is channels h*hs .. (h+1)*hs - 1: "
         "view(B, T, nh, hs).transpose(1, 2)", att(split="interleaved")),
        ("the heads are merged without transposing back: y is (B, nh, T, hs), and "
         "y.transpose(1, 2).reshape(B, T, C) puts the heads side by side", att(merge="view")),
        ("the heads are split and merged with plain views, without the transposes: q.view(B, T, nh, hs)"
         ".transpose(1, 2) to split, y.transpose(1, 2).reshape(B, T, C) to merge", att(split="view", merge="view")),
        ("c_proj's matrix is used transposed (x @ W, where nn.Linear computes x @ W^T)", att(proj_t=True)),
    ]
    for order in ("qvk", "kqv", "kvq", "vqk", "vkq"):
        candidates.append((f"q, k and v are taken in the order {', '.join(order)}; GPT-2's is q, k, v: "
                           "q, k, v = c_attn(x).split(n_embd, dim=2)", att(order=order)))
    return Probe(out, candidates)


def _mlp(i: int, ev: Evidence) -> Probe | str | None:
    found = _sublayer_input(i, ev, "mlp", "ln_2", "ln_2.in",
                            "the MLP is given x, not ln_2(x): x = x + self.mlp(self.ln_2(x))")
    if found is None or isinstance(found, str):
        return found
    out, x = found
    p = f"h.{i}.mlp."
    w = (ev.w(p + "c_fc.weight"), ev.w(p + "c_fc.bias"), ev.w(p + "c_proj.weight"), ev.w(p + "c_proj.bias"))
    tanh = "GPT-2 uses the tanh approximation: nn.GELU(approximate='tanh')"
    return Probe(out, [
        (None, lambda: var.mlp(x, *w)),
        (f"the MLP's GELU is the exact, erf form (nn.GELU() or F.gelu(x)); {tanh}", lambda: var.mlp(x, *w, "erf")),
        (f"the MLP uses ReLU; GPT-2 uses GELU, {tanh[10:]}", lambda: var.mlp(x, *w, "relu")),
        (f"the MLP's GELU is the sigmoid approximation x * sigmoid(1.702 x); {tanh}",
         lambda: var.mlp(x, *w, "sigmoid")),
        (f"the MLP uses SiLU (x * sigmoid(x)); {tanh}", lambda: var.mlp(x, *w, "silu")),
        (f"the MLP has no activation between c_fc and c_proj; {tanh}", lambda: var.mlp(x, *w, "none")),
    ])


def _residual(kind: str, i: int, ev: Evidence) -> Probe | None:
    h = ev.mine(f"h.{i}.block.in")
    h = ev.ref[f"resid.{i}"] if h is None else h
    if kind == "residual 1":
        out, a, n = ev.mine(f"h.{i}.ln_2.in"), ev.mine(f"h.{i}.attn.out"), ev.mine(f"h.{i}.ln_1.out")
        if out is None or a is None:
            return None
        return Probe(out, [
            (None, lambda: h + a),
            ("the attention's residual connection is missing: x = x + self.attn(self.ln_1(x))", lambda: a),
            ("the attention's output is added to ln_1(x), not to the block's input x: keep x and write "
             "x = x + self.attn(self.ln_1(x))", lambda: (n if n is not None else h) + a)])
    L = ev.cfg.n_layer
    after = (f"h.{i + 1}.block.in", f"h.{i + 1}.ln_1.in") if i + 1 < L else ("ln_f.in",)
    out, m = ev.mine(f"h.{i}.block.out", *after), ev.mine(f"h.{i}.mlp.out")
    h1, n2 = ev.mine(f"h.{i}.ln_2.in"), ev.mine(f"h.{i}.ln_2.out")
    if out is None or m is None or h1 is None:
        return None
    cands = [(None, lambda: h1 + m),
             ("the MLP's residual connection is missing: x = x + self.mlp(self.ln_2(x))", lambda: m),
             ("the MLP's output is added to the block's input, skipping the attention's residual: "
              "x = x + attn(ln_1(x)), then x = x + mlp(ln_2(x))", lambda: h + m)]
    if n2 is not None:
        cands.append(("the MLP's output is added to ln_2(x), not to x: x = x + self.mlp(self.ln_2(x))",
                      lambda: n2 + m))
    return Probe(out, cands)


def _logits(ev: Evidence, logits: torch.Tensor) -> Probe:
    x = ev.mine("ln_f.out")
    x = ev.ref["ln_f"] if x is None else x
    L, V, C = ev.cfg.n_layer, ev.cfg.n_vocab, ev.cfg.n_embd
    h = ev.mine("ln_f.in", f"h.{L - 1}.block.out")
    h = ev.ref[f"resid.{L}"] if h is None else h
    wte = ev.w("wte.weight")[:V]
    last = logits.shape[1] == 1 and x.shape[1] > 1  # the learner gives the last position only
    x, h = (x[:, -1:], h[:, -1:]) if last else (x, h)
    return Probe(logits, [
        (None, lambda: F.linear(x, wte)),
        ("the head multiplies by the token embedding reshaped to (n_embd, vocab): a reshape is not a transpose; "
         "logits = x @ wte.weight.T, i.e. F.linear(x, wte.weight)", lambda: x @ wte.reshape(C, V)),
        ("the final LayerNorm is not applied before the head: logits = lm_head(ln_f(x))", lambda: F.linear(h, wte)),
    ])


GENERIC = {
    "embeddings": "GPT-2's embeddings are wte[idx] + wpe[arange(T)]",
    "ln_1": "GPT-2's ln_1 is LayerNorm(x) with eps 1e-5, of the block's input",
    "ln_2": "GPT-2's ln_2 is LayerNorm(x) with eps 1e-5, of x + attention",
    "final norm": "GPT-2's final norm is LayerNorm with eps 1e-5 of the last block's output",
    "attention": "GPT-2's attention is c_proj(merge(softmax(q k^T / sqrt(d_head) + causal mask) v)) of ln_1(x), "
                 "and none of the known mistakes tried (scale, mask, softmax axis, heads, q/k/v order) matches",
    "residual 1": "GPT-2's first residual is x + attn(ln_1(x))",
    "mlp": "GPT-2's MLP is c_proj(gelu_tanh(c_fc(ln_2(x)))), and none of the other activations tried matches",
    "residual 2": "GPT-2's second residual is x + mlp(ln_2(x)) with x the first residual",
    "logits": "GPT-2's logits are ln_f(x) @ wte^T (the head tied to the token embedding, no bias)",
}


def _probe(kind: str, i: int | None, ev: Evidence, logits: torch.Tensor | None) -> Probe | str | None:
    if kind == "embeddings":
        return _embeddings(ev)
    if kind in ("ln_1", "ln_2", "final norm"):
        return _norm(kind, i, ev)
    if kind == "attention":
        return _attention(i, ev)
    if kind == "mlp":
        return _mlp(i, ev)
    if kind.startswith("residual"):
        return _residual(kind, i, ev)
    return _logits(ev, logits) if kind == "logits" and logits is not None else None


def _verdict(stage: StageResult, ev: Evidence, logits: torch.Tensor | None, lenient: bool) -> str | None:
    kind, i = _parse(stage.label)
    probe = _probe(kind, i, ev, logits)
    if isinstance(probe, str) or probe is None:
        return probe
    return decide(probe, ev.tol, lenient)


def diagnose(first: StageResult, ev: Evidence, logits: torch.Tensor | None = None,
             before: list[StageResult] = ()) -> str:
    """One sentence on why `first` differs: the weights that did not load, a probed mistake, or what GPT-2
    computes there. When the stage computes GPT-2's function of its own input, the difference came in
    earlier below the tolerance: `before` (the stages ahead of it) are probed for the mistake."""
    kind, i = _parse(first.label)
    if first.note.startswith("shape"):
        return f"your {first.label} has {first.note}"
    found = _weights(kind, i, ev) or _verdict(first, ev, logits, lenient=False)
    if found != RIGHT:
        return found or f"no known mistake matches: {GENERIC[kind]}"
    for s in before:
        if s.diff is not None and s.diff > 0:
            earlier = _verdict(s, ev, logits, lenient=True)
            if earlier not in (None, RIGHT):
                return (f"{earlier} (at {s.label} the difference, {s.diff:.2e}, is within the tolerance; it grows to "
                        f"{first.diff:.2e} by {first.label})")
    return (f"{first.label} computes what GPT-2 does from its own input: the difference comes from earlier stages, "
            "where it is within the tolerance, and grows here")
