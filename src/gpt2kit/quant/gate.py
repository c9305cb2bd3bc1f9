"""The quality gate of int8 activations: measured on the model itself, before the mode is turned on.

Weight-only int8 (gpt2kit.quant.modules) costs a trained GPT-2 almost nothing; int8 activations (per-row
scales, gpt2kit.decode.int8act) cost more, and how much depends on the model: an activation row with
one large outlier leaves its other values few int8 steps. So the mode is not switched on blind:
`use_int8_activations(model, windows)` runs the model over held-out token windows twice, weight-only
and with int8 activations, and turns the mode on only when

  the perplexity rises by at most LIMITS["ppl_rise"] over the weight-only model's, and
  the greedy next token agrees with the weight-only model's on at least LIMITS["agree"] of the positions;

otherwise it raises GateFailed (a ValueError) naming the figures and the limits, and the model stays
weight-only. The mean KL(weight-only || int8 activations) is reported beside them. The reference is
the weight-only model because it is what the mode replaces and what an int8 checkpoint holds (no float
model needed); weight-only int8 itself is within its own gate of float32 (docs/quantization.md, which
has the figures of both against float32 on a model trained here).

`read_windows` takes the held-out text the CLI's --gate-data names: a directory of `gpt2kit prepare`
shards (its val_*.bin), one .bin shard, or a UTF-8 text file (tokenized with the model's
tokenizer); WINDOWS windows of LENGTH tokens (fewer where the text is short), spread evenly over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from gpt2kit._io import check_input
from gpt2kit.data.shard import find_shards, read_shard
from gpt2kit.quant.modules import activations, quality, set_activations

LIMITS = {"ppl_rise": 0.02, "agree": 0.97}
WINDOWS = 16
LENGTH = 256
MIN_TOKENS = 33  # 32 next-token positions: fewer decide nothing


class GateFailed(ValueError):
    """int8 activations failed the quality gate on this model (the message has the figures)."""


class _InMode:
    """The model called in one activation mode (what quality() compares is two callables)."""

    def __init__(self, model: nn.Module, mode: str):
        self.model, self.mode = model, mode

    def __call__(self, ids: torch.Tensor):
        set_activations(self.model, self.mode)
        return self.model(ids)


def activation_gate(model: nn.Module, windows: torch.Tensor | Sequence[torch.Tensor],
                    limits: dict[str, float] | None = None) -> dict:
    """The gate's figures for int8 `model` on `windows` (N, T) of held-out token ids: the perplexity
    weight-only and with int8 activations, its relative rise, the greedy agreement, the mean KL, the
    positions, the limits and whether it passed. The model's activation mode is left as it was."""
    limits = {**LIMITS, **(limits or {})}
    before = activations(model)
    if before is None:
        raise ValueError("int8 activations apply to an int8 model; this one is not quantized "
                         "(quantize_model, or --quantize int8)")
    try:
        q = quality(_InMode(model, "float"), _InMode(model, "int8"), windows)
    finally:
        set_activations(model, before)
    passed = q["ppl_rise"] <= limits["ppl_rise"] and q["agree"] >= limits["agree"]
    return {"ppl_weight_only": q["ppl_float"], "ppl_int8_activations": q["ppl_int8"], "ppl_rise": q["ppl_rise"],
            "agree": q["agree"], "kl_mean": q["kl_mean"], "positions": q["positions"], "limits": limits,
            "passed": passed}


def describe(gate: dict) -> str:
    """The gate's figures in one line."""
    lim = gate["limits"]
    return (f"perplexity {gate['ppl_rise']:+.2%} over weight-only int8 ({gate['ppl_weight_only']:.3f} -> "
            f"{gate['ppl_int8_activations']:.3f}; gate: at most {lim['ppl_rise']:+.0%}), greedy agreement "
            f"{gate['agree']:.2%} (gate: at least {lim['agree']:.0%}), mean KL {gate['kl_mean']:.2e} nats, "
            f"on {gate['positions']:,} held-out positions")


def use_int8_activations(model: nn.Module, windows: torch.Tensor | Sequence[torch.Tensor],
                         limits: dict[str, float] | None = None) -> dict:
    """Measure the gate on `windows` and, if it passes, switch int8 `model` to int8 activations (in
    place); returns the gate's figures. GateFailed (the model left weight-only) when it fails."""
    gate = activation_gate(model, windows, limits)
    if not gate["passed"]:
        raise GateFailed(f"int8 activations fail their quality gate on this model: {describe(gate)}; "
                         "run it weight-only int8 (without --int8-activations) or in float")
    set_activations(model, "int8")
    return gate


def windows_of(tokens: Sequence[int] | torch.Tensor, n_ctx: int, count: int = WINDOWS,
               length: int = LENGTH) -> torch.Tensor:
    """`count` windows (N, T) of `length` tokens (at most n_ctx, at most the text), spread evenly over
    `tokens`; ValueError when there are fewer than MIN_TOKENS."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if ids.numel() < MIN_TOKENS:
        raise ValueError(f"the gate's held-out text holds {ids.numel()} tokens; at least {MIN_TOKENS} are needed")
    T = min(length, n_ctx, ids.numel())
    n = max(1, min(count, ids.numel() // T))
    starts = [i * (ids.numel() - T) // max(n - 1, 1) for i in range(n)]
    return torch.stack([ids[s:s + T] for s in starts])  # (N, T)


def read_windows(path: str | Path, tokenizer, n_ctx: int, n_vocab: int) -> torch.Tensor:
    """Held-out windows (N, T) from `path`: a directory of prepared shards (val_*.bin), one .bin shard,
    or a UTF-8 text file; one error naming the path when it is none of them (missing, or a FIFO or a
    device: _io.check_input, which never opens it) or holds ids >= n_vocab."""
    path = check_input(path, "--gate-data", directory=True)
    if path.is_dir():
        tokens = torch.cat([torch.from_numpy(read_shard(f).astype("int64")) for f in find_shards(path, "val")])
    elif path.suffix == ".bin" and path.is_file():
        tokens = torch.from_numpy(read_shard(path).astype("int64"))
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--gate-data {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    if tokens.numel() and int(tokens.max()) >= n_vocab:
        raise ValueError(f"--gate-data {path}: token {int(tokens.max())} is outside the model's vocabulary "
                         f"(n_vocab {n_vocab})")
    try:
        return windows_of(tokens, n_ctx)
    except ValueError as e:
        raise ValueError(f"--gate-data {path}: {e}") from None


def gate_activations(model: nn.Module, tokenizer, gate_data: str | Path) -> str:
    """--int8-activations with --gate-data: switch int8 `model` to int8 activations if it passes the
    gate on the held-out text at `gate_data` (GateFailed when it does not); the line saying so."""
    cfg = model.config
    gate = use_int8_activations(model, read_windows(gate_data, tokenizer, cfg.n_ctx, cfg.n_vocab))
    return f"int8 activations on: their quality gate passed ({describe(gate)})"
