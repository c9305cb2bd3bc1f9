"""Steering vectors from contrasting prompts, saved with what they fit.

ActAdd (Turner et al., "Steering Language Models With Activation Engineering"): the difference of
two prompts' residual streams at one point, at the last position or averaged over positions. With
several prompts on each side, the difference of the two sides' means (contrastive activation
addition, Rimsky et al.). The vector is a 1-D float32 `.npy` (what `--steer NAME:VEC.npy*SCALE`
reads), and beside it `VEC.npy.json`: the model's name and shape (n_embd, n_layer, n_head), the
point and the width, how it was made. A vector whose file says it was made on another shape is
refused when it is loaded for a model (check_fits).
Legend: T tokens, W the point's width.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from gpt2kit._io import atomic_write
from gpt2kit.trace.points import capture_run, point, resolve

POSITIONS = ("last", "mean")


def _activation(model, tokenizer, text: str, name: str, position: str) -> torch.Tensor:
    if not text:
        raise ValueError("a prompt is empty: nothing to read a vector from")
    ids = tokenizer.encode(text)
    if len(ids) > model.config.n_ctx:
        raise ValueError(f"a prompt has {len(ids)} tokens, more than the context n_ctx={model.config.n_ctx}")
    x = capture_run(model, ids, [name])[0][name].float()  # (T, W)
    return x[-1] if position == "last" else x.mean(0)


@torch.no_grad()
def make_vector(model, tokenizer, positive: Sequence[str], negative: Sequence[str], name: str, *,
                position: str = "last") -> tuple[np.ndarray, dict]:
    """mean over positive prompts - mean over negative prompts of the tensor at `name` (a trace or
    TransformerLens name of C or 4C numbers per position), at each prompt's last position or its
    positions' mean; returns (the vector (W,) float32, the metadata save_vector writes)."""
    if position not in POSITIONS:
        raise ValueError(f"position {position!r}: choose from {', '.join(POSITIONS)}")
    if not positive or not negative:
        raise ValueError("a vector needs at least one positive and one negative prompt")
    cfg = model.config
    ours, head = resolve(name, cfg.n_layer, cfg.n_head)
    if head is not None or ours.split(".", 2)[-1] in ("attn.q", "attn.k", "attn.v", "attn.z"):
        raise ValueError(f"{name!r}: a vector is read at a point of one vector per position (a residual, "
                         "attn.out, mlp.out, mlp.pre/post), not a per-head tensor")
    point(model, ours)  # a point no module computes fails here
    was = model.training
    model.eval()
    try:
        pos = torch.stack([_activation(model, tokenizer, t, ours, position) for t in positive]).mean(0)
        neg = torch.stack([_activation(model, tokenizer, t, ours, position) for t in negative]).mean(0)
    finally:
        model.train(was)
    vec = (pos - neg).cpu().numpy().astype(np.float32)
    meta = {"point": ours, "width": int(vec.shape[0]), "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "position": position, "positive": len(positive), "negative": len(negative),
            "method": "actadd" if len(positive) == len(negative) == 1 else "mean-difference"}
    return vec, meta


def meta_path(path) -> Path:
    return Path(str(path) + ".json")


def save_vector(path, vec: np.ndarray, meta: dict, model_name: str) -> None:
    """The vector as a 1-D float32 .npy at path and its metadata (with the model's name) beside it."""
    buf = _npy_bytes(np.asarray(vec, dtype=np.float32))
    atomic_write(path, lambda f: f.write(buf))
    body = json.dumps({"model": model_name, **meta}, indent=1).encode("utf-8")
    atomic_write(meta_path(path), lambda f: f.write(body))


def _npy_bytes(a: np.ndarray) -> bytes:
    import io

    b = io.BytesIO()
    np.save(b, a, allow_pickle=False)
    return b.getvalue()


def read_meta(path) -> dict | None:
    """The metadata beside a vector file, or None when there is none (a vector made elsewhere)."""
    p = meta_path(path)
    if not p.is_file():  # a FIFO or a device is never opened
        return None
    if p.stat().st_size > 1 << 20:
        raise ValueError(f"{p}: {p.stat().st_size:,} bytes; a vector's metadata is a small JSON object")
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{p}: expected an object of the vector's model, point and width")
    return meta


def check_fits(meta: dict | None, model, where: str) -> None:
    """ValueError naming the vector when its metadata says it was made on a model of another shape."""
    if meta is None:
        return
    cfg = model.config
    have = {k: getattr(cfg, k) for k in ("n_embd", "n_layer", "n_head")}
    made = {k: meta.get(k) for k in have}
    if any(v is not None and v != have[k] for k, v in made.items()):
        shown = ", ".join(f"{k} {v}" for k, v in made.items())
        raise ValueError(f"{where}: the vector was made on {meta.get('model', 'a model')} ({shown}); this model has "
                         f"{', '.join(f'{k} {v}' for k, v in have.items())}")
