"""Optimizers and learning-rate schedules for training GPT-2.

    opt = make_optimizer(model, "muon", lr=3e-3, muon_lr=0.02, weight_decay=0.1)
    f = lr_factor(step, schedule="wsd", warmup_steps=15, max_steps=300, min_lr_ratio=0.0)
    opt.set_lr_factor(f)
    opt.step(); opt.zero_grad(set_to_none=True)

adamw: AdamW on everything; weight decay on the 2-D tensors (the matrices and the wte/wpe
embeddings, as nanoGPT), none on biases and LayerNorm gains. Fused kernels where the device has them.

muon: as modded-nanogpt, Muon (torch.optim.Muon: momentum, then Newton-Schulz orthogonalisation of
the update) for the 2-D matrices inside the blocks (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj),
and AdamW as above for the rest: the embeddings (which are also the tied LM head), biases and gains.
Muon's learning rate is its own (muon_lr), with Keller Jordan's shape scaling sqrt(max(1, out/in)).
torch.optim.Muon always orthogonalises in bfloat16; `Muon` here is torch's class (its state and
update) with the Newton-Schulz dtype a parameter: float32 for a float32 run, so a run computes in the
dtype it asked for; bfloat16 only for a bfloat16 run on a device that multiplies it natively
(newton_schulz_dtype: a CPU without native bfloat16, AVX2, emulates those products at many times a
float32 product's cost).

Schedules multiply each group's base rate by a factor:
    cosine  linear warmup to 1, then cosine down to min_lr_ratio at max_steps (GPT-2/3, nanoGPT)
    wsd     warmup-stable-decay: linear warmup to 1, flat, then linear down to min_lr_ratio over the
            last decay_fraction of the steps (MiniCPM; modded-nanogpt's schedule)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gpt2kit.decode.plain import cpu_has_native_bfloat16
from gpt2kit.devices import resolve_dtype
from gpt2kit.train.config import OPTIMIZERS, SCHEDULES, require_muon
from gpt2kit.validate import check_choice

ADAM_BETAS = (0.9, 0.95)  # GPT-3's betas (nanoGPT, llm.c); 0.999 is less stable at GPT-2 batch sizes
ADAM_EPS = 1e-8
MUON_MOMENTUM = 0.95


def newton_schulz_dtype(run_dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """The dtype Muon orthogonalises in for a run computing in `run_dtype` on `device`.

    float32 for a float32 run: the update is as exact as the rest of the step (in bfloat16, DDP's
    all-reduced gradient and one process's sum, equal but for the last bit, round to different
    updates). For a bfloat16 run, bfloat16 (torch.optim.Muon's own choice) where the device multiplies
    it natively: CUDA, and CPUs where oneDNN has bfloat16 kernels (AVX512-BF16 / AMX:
    decode.plain.cpu_has_native_bfloat16); float32 elsewhere, which an AVX2 CPU multiplies many
    times faster than the bfloat16 it emulates. A property of the machine, not a timing."""
    if resolve_dtype(run_dtype) != torch.bfloat16:
        return torch.float32
    device = torch.device(device)
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32


def zeropower_via_newtonschulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                               eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz with the working dtype a parameter (torch fixes
    bfloat16): the same quintic iteration, operation for operation, so dtype=bfloat16 is torch's result."""
    a, b, c = ns_coefficients
    x = grad.to(dtype)  # a copy whenever dtype differs; for float32 grads in float32 a view we must not write
    if dtype == grad.dtype:
        x = x.clone()
    if grad.size(0) > grad.size(1):
        x = x.T  # (small, large): the Gram matrix is the small side's
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


_TorchMuon = getattr(torch.optim, "Muon", None)

if _TorchMuon is not None:
    class Muon(_TorchMuon):  # type: ignore[valid-type, misc]
        """torch.optim.Muon with the Newton-Schulz iteration in `ns_dtype` (torch: always bfloat16).

        Same parameter groups, defaults, state ("momentum_buffer") and state_dict as torch's class, so
        checkpoints move between the two; with ns_dtype=bfloat16 `step` defers to torch's own."""

        def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any):
            super().__init__(params, **kwargs)
            self.ns_dtype = ns_dtype

        @torch.no_grad()
        def step(self, closure=None):
            if self.ns_dtype == torch.bfloat16:
                return super().step(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                params: list[torch.Tensor] = []
                grads: list[torch.Tensor] = []
                bufs: list[torch.Tensor] = []
                self._init_group(group, params, grads, bufs)
                lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
                for param, grad, buf in zip(params, grads, bufs, strict=True):
                    # torch.optim._muon._single_tensor_muon, step for step, but for the dtype
                    buf.lerp_(grad, 1 - momentum)
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                    update = zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"],
                                                        group["eps"], self.ns_dtype)
                    param.mul_(1 - lr * wd)
                    param.add_(update, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
            return loss
else:
    Muon = None  # type: ignore[assignment, misc]


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim._muon._adjust_lr: the rate scaled so updates of any shape have a comparable RMS."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def lr_factor(step: int, *, schedule: str, warmup_steps: int, max_steps: int, min_lr_ratio: float,
              decay_fraction: float = 0.4) -> float:
    """The multiplier of the base rate for 0-based step `step` (1 at the peak, min_lr_ratio at the end)."""
    check_choice("schedule", schedule, SCHEDULES)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr_ratio
    if schedule == "cosine":
        ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr_ratio + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - min_lr_ratio)
    decay_steps = max(1, round(decay_fraction * (max_steps - warmup_steps)))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    # step decay_start has factor 1, step max_steps would have min_lr_ratio
    return min_lr_ratio + (1.0 - min_lr_ratio) * (max_steps - step) / decay_steps


class Optimizers:
    """One or more torch optimizers stepped together, with one learning-rate factor.

    Every param group keeps its peak rate in group["base_lr"]; set_lr_factor sets group["lr"] to
    base_lr * factor. state_dict() is {name: that optimizer's state_dict()}.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers
        for opt in optimizers.values():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state of all the optimizers (each parameter belongs to one): the live dicts.

        A new dict, not a ChainMap: torch's states are defaultdicts, which a failed lookup would grow."""
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def set_lr_factor(self, factor: float) -> None:
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * factor

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) == {"state", "param_groups"} and set(self.optimizers) == {"adamw"}:
            state = {"adamw": state}  # a checkpoint from before there was a choice: one AdamW
        if set(state) != set(self.optimizers):
            raise ValueError(f"the saved optimizer state holds {sorted(state)}, this run has {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def param_groups(params: list[nn.Parameter] | nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups: weight decay on the 2-D weights (the matrices and, as in nanoGPT, the
    wte/wpe embeddings), none on biases and LayerNorm gains. Frozen parameters are left out."""
    if isinstance(params, nn.Module):
        params = list(params.parameters())
    params = [p for p in params if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D matrices inside the transformer blocks (not the embeddings, biases or gains)."""
    return [p for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name.startswith("h.")]


def make_optimizer(model: nn.Module, name: str, *, lr: float, weight_decay: float, muon_lr: float = 0.02,
                   muon_weight_decay: float = 0.0, muon_dtype: torch.dtype | str | None = None) -> Optimizers:
    """AdamW ("adamw") or Muon for the block matrices plus AdamW for the rest ("muon"); see the module doc.

    muon_dtype: the dtype of Muon's Newton-Schulz iteration (None: float32; newton_schulz_dtype gives
    the choice for a run's dtype and device)."""
    check_choice("optimizer", name, OPTIMIZERS)
    ns_dtype = resolve_dtype(muon_dtype) or torch.float32
    if ns_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"muon_dtype must be float32 or bfloat16, got {muon_dtype!r}")
    optimizers: dict[str, torch.optim.Optimizer] = {}
    muon_params: list[nn.Parameter] = []
    if name == "muon":
        require_muon()
        muon_params = muon_parameters(model)
        optimizers["muon"] = Muon(muon_params, lr=muon_lr, weight_decay=muon_weight_decay, momentum=MUON_MOMENTUM,
                                  nesterov=True, adjust_lr_fn="original", ns_dtype=ns_dtype)
    taken = {id(p) for p in muon_params}
    rest = [p for p in model.parameters() if id(p) not in taken]
    groups = [g for g in param_groups(rest, weight_decay) if g["params"]]
    if not groups and optimizers:  # everything trained is Muon's (LoRA's matrices): no AdamW
        return Optimizers(optimizers)
    kwargs: dict[str, Any] = {"lr": lr, "betas": ADAM_BETAS, "eps": ADAM_EPS}
    try:
        optimizers["adamw"] = torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # no fused kernel for this device / dtype
        optimizers["adamw"] = torch.optim.AdamW(groups, foreach=True, **kwargs)
    return Optimizers(optimizers)
