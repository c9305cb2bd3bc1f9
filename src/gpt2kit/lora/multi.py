"""Many LoRA adapters on one base, chosen per row: an AdapterBank of adapters in slots, the
MultiLoRALinear modules that hold them, and adapter_rows, through which an engine's steps give each
row its adapter (docs/serving.md, "Many LoRA adapters on one base").

Legend: S slots, r the largest rank, in/out the matrix's features, n rows, T tokens a row, R = n T.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kit.lora.modules import TARGETS, LoRALinear, switched_off
from gpt2kit.quant.modules import is_quantized


class AdapterBank:
    """The adapters a model's MultiLoRALinear modules hold, each in a slot of its own (`names`: slot ->
    name, None a free slot; a slot never moves while its adapter is held, so a row's index stays its
    adapter's), and the per-row choice the next forwards use: row b runs slot index[b], or the base
    where it is -1."""

    def __init__(self) -> None:
        # name: its (A, B) per module (our names) and scaling per module, from checkpoint.adapter.read_adapter
        self.adapters: dict[str, tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]] = {}
        self.names: list[str | None] = []
        self.modules: dict[str, MultiLoRALinear] = {}  # our names: the module
        self.rank = 1  # r: every slot's block is r wide (the largest rank held)
        # set_rows': the next forwards' n rows, m of them adapted, in one of MultiLoRALinear's two forms:
        # stacked, mask (n, 1, S r) each row's ones on its adapter's block; or gathered, picks (m,) each
        # adapted row's slot and rows (m,) which rows (None: all n). Both None: every row the base.
        self.n, self.mask, self.picks, self.rows = 0, None, None, None

    def index_of(self, name: str) -> int:
        return self.names.index(name)

    def add(self, name: str, tensors: dict, scalings: dict[str, float]) -> int:
        """Hold an adapter (checked already) in the first free slot; its index."""
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        slot = self.names.index(None) if None in self.names else len(self.names)
        self.names[slot:slot + 1] = [name]
        self.adapters[name] = (tensors, scalings)
        self.restack()
        return slot

    def remove(self, name: str) -> None:
        """Drop an adapter, its slot free for the next (no row may run it: the caller's to ensure)."""
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        self.names[self.names.index(name)] = None
        while self.names and self.names[-1] is None:
            self.names.pop()
        self.restack()

    def set_rows(self, index: Sequence[int] | None) -> None:
        """The adapter of each row of the next forwards (-1: the base); None or all -1: every row the base."""
        self.mask = self.picks = self.rows = None
        if index is None or all(i < 0 for i in index):
            return
        bad = [i for i in index if i >= len(self.names) or (i >= 0 and self.names[i] is None)]
        if bad:
            raise ValueError(f"adapter index out of range: {bad[0]} with {len(self.adapters)} adapters loaded "
                             f"(slots {self.names})")
        w, r, S = next(iter(self.modules.values())).weight, self.rank, len(self.names)
        adapted = [b for b, i in enumerate(index) if i >= 0]
        self.n = len(index)
        if len(adapted) >= S:  # the stacked form reads S blocks, the gathered m: the fewer, ties stacked (fewer calls)
            cols = [[1.0 if c // r == i else 0.0 for c in range(S * r)] for i in index]
            self.mask = torch.tensor(cols, dtype=w.dtype, device=w.device)[:, None]
            return
        self.picks = torch.tensor([index[b] for b in adapted], dtype=torch.long, device=w.device)
        self.rows = None if len(adapted) == self.n else torch.tensor(adapted, dtype=torch.long, device=w.device)

    @torch.no_grad()
    def restack(self) -> None:
        """Each module's tensors from the adapters held (MultiLoRALinear's legend; zeros where a slot is free
        or its adapter leaves the module alone), new ones: the prefix cache sees its blocks are stale."""
        held = [self.adapters.get(name) if name is not None else None for name in self.names]
        self.rank = r = max((a.shape[0] for ad in filter(None, held) for a, _ in ad[0].values()), default=1)
        for name, m in self.modules.items():
            pairs = [ad[0].get(name) if ad is not None else None for ad in held]
            kw = {"device": m.weight.device, "dtype": m.weight.dtype}
            if not any(pairs):  # no adapter held adapts it: the base alone, nothing added
                m.lora_A = m.lora_A_rows = m.lora_B = torch.zeros(0, **kw)
                continue
            A, B = torch.zeros(len(pairs), m.in_features, r, **kw), torch.zeros(len(pairs), r, m.out_features, **kw)
            for i, (ad, pair) in enumerate(zip(held, pairs, strict=True)):
                if pair is not None:  # rank below r: zero columns of A and rows of B add exact zeros
                    a, b = pair
                    A[i, :, :a.shape[0]] = (ad[1][name] * a.float().t()).to(m.weight.dtype)
                    B[i, :a.shape[0]] = b.t()
            m.lora_A_rows, m.lora_B = A, B
            m.lora_A = A.permute(1, 0, 2).reshape(m.in_features, -1).contiguous()


class MultiLoRALinear(nn.Module):
    """nn.Linear's frozen weight and bias plus the bank's adapters, a block of rank r per slot (S
    slots; r the largest rank, smaller ones padded with zeros, which add exact zeros): lora_A_rows
    (S, in, r) each slot's scaling x A^T, lora_A (in, S r) the same side by side, lora_B (S, r, out)
    its B^T. The base product is the plain one (decode.bind runs it on the decode step's own kernels
    and calls add_update); each adapted row adds s (x A^T) B^T for its own adapter (Punica's batched
    LoRA), in the form that reads fewer of these tensors (AdapterBank.set_rows): stacked, two plain
    products for all rows, z = (x lora_A) * mask keeping each row's own block (zeros elsewhere, and
    everywhere for a base row), then y + z lora_B, a base row y + 0, the base exactly; or gathered,
    each adapted row's A and B taken by its slot into two batched products, a base row not touched."""

    def __init__(self, linear: nn.Linear, bank: AdapterBank) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach(), requires_grad=False) if linear.bias is not None else None
        self.bank = bank
        for name in ("lora_A", "lora_A_rows", "lora_B"):  # buffers: model.buffers() shows when they are replaced
            self.register_buffer(name, torch.zeros(0), persistent=False)
        self.disabled = False  # within disable_adapter: the base alone

    def adapter_off(self) -> contextlib.AbstractContextManager[None]:
        return switched_off(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_update(x, F.linear(x, self.weight, self.bias))  # (..., out)

    def updating(self) -> bool:
        """Whether some row of the next forwards runs an adapter here."""
        bank = self.bank
        return (bank.mask is not None or bank.picks is not None) and not self.disabled and self.lora_A.numel() > 0

    def add_update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y, the base product of x (..., in) (plus a residual, if the caller added one), with each
        adapted row's update added (a new tensor; y itself where no row runs an adapter here)."""
        if not self.updating():
            return y
        n, R = self.bank.n, x.numel() // x.shape[-1]  # (B, T, in), (B, in) or the flat step's (B * T, in): b-major
        if R % n:
            raise ValueError(f"the adapter index has {n} rows, the input {tuple(x.shape)} does not split into them")
        bank, T, out = self.bank, R // n, self.out_features
        if bank.mask is not None:  # stacked
            z = torch.mm(x.reshape(R, self.in_features), self.lora_A)  # (R, S r)
            z = (z.view(n, T, -1) * bank.mask).view(R, -1)  # each row its own block
            return torch.addmm(y.reshape(R, out), z, self.lora_B.view(-1, out)).view(y.shape)  # (..., out)
        xs, rows = x.reshape(n, T, self.in_features), bank.rows  # gathered
        xs = xs if rows is None else xs.index_select(0, rows)  # (m, T, in)
        z = torch.bmm(xs, self.lora_A_rows.index_select(0, bank.picks))  # (m, T, r)
        d = torch.bmm(z, self.lora_B.index_select(0, bank.picks))  # (m, T, out)
        if rows is None:
            return y + d.view(y.shape)
        return y.reshape(n, T, out).index_add(0, rows, d).view(y.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={len(self.bank.adapters)}"


def enable_multi_lora(model: nn.Module) -> AdapterBank:
    """Swap every block matrix of a float GPT2 for a MultiLoRALinear sharing one AdapterBank, in place
    (model.adapter_bank): the base until adapters are added (checkpoint.adapter.add_adapter) and rows given them."""
    if is_quantized(model) or any(isinstance(m, (LoRALinear, MultiLoRALinear)) for m in model.modules()):
        raise ValueError("many adapters need a plain float model (no int8, no LoRA modules already)")
    bank = AdapterBank()
    for i, block in enumerate(model.h):
        for target in TARGETS:
            parent, attr = block.get_submodule(target.split(".")[0]), target.split(".")[1]
            bank.modules[f"h.{i}.{target}"] = module = MultiLoRALinear(getattr(parent, attr), bank)
            setattr(parent, attr, module)
    bank.restack()
    model.adapter_bank = bank
    return bank


@contextlib.contextmanager
def adapter_rows(model: nn.Module, adapters: Sequence[int]) -> Iterator[None]:
    """Within the block each row b of the model's forwards runs adapter adapters[b] (-1: the base),
    then none again; nothing on a model without an adapter bank. The one place an engine's steps
    give their rows' adapters to the model."""
    bank: AdapterBank | None = getattr(model, "adapter_bank", None)
    if bank is None:
        yield
        return
    bank.set_rows(adapters)
    try:
        yield
    finally:
        bank.set_rows(None)
