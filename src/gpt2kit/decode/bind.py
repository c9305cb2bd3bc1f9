"""A model's decode tensors resolved once per kernel set, as llm.c resolves its weight pointers once.

Reading ``model.h[i].attn.c_attn.weight`` walks four nn.Module.__getattr__ calls; a decode step of a
12-layer model did that 276 times per token for the same tensors. A Binding reads them once, into
one tuple per block, and on each step tells whether they are still the model's: every module and
parameter it read is looked up again in the dict nn.Module keeps it in (``_modules``,
``_parameters``: plain dict reads, no attribute machinery), so a module swap, a replaced parameter
(``load_state_dict(assign=True)``, ``layer.weight = ...``) or a changed block count makes it stale.
A kernel set that computes from copies of the weights (decode.packed) also has the binding watch
each copied parameter's version counter, so an in-place edit (a training step, load_state_dict's
copy) makes it stale too (a ``.data`` assignment moves no version: packed_weights, which generation
calls for each kernel set, compares the storage too); the plain kernels hold the parameters
themselves, so they see in-place edits and ``.data`` assignments (model.to, use_decode_layout) as
they happen. A binding is kept by the kernel set that made it: kernels_for makes a plain set per
generation, so what a binding holds is let go with the generation (PLAIN, shared, keeps none).

Legend: B rows, C n_embd.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn


class Mat(NamedTuple):
    """A plain nn.Linear's product as a kernel set runs it: its matrix (or the set's copy of it) and bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None


# A bound product: a Mat, or a swapped-in module (a quantized or adapted linear), called as itself.
Product = Mat | nn.Module


class Block(NamedTuple):
    ln_1_weight: torch.Tensor
    ln_1_bias: torch.Tensor
    c_attn: Product
    attn_c_proj: Product
    ln_2_weight: torch.Tensor
    ln_2_bias: torch.Tensor
    c_fc: Product
    mlp_c_proj: Product


def _same(p: torch.Tensor) -> torch.Tensor:
    return p


class Binding:
    """What a decode step reads from `model`, resolved once. mat(weight) gives the kernel set's form
    of a plain nn.Linear's matrix (or of the tied wte, for the head); versions=True when those are
    copies, so in-place edits of their parameters make the binding stale."""

    def __init__(self, model: nn.Module, mat: Callable[[torch.Tensor], torch.Tensor] = _same,
                 versions: bool = False) -> None:
        self._model = weakref.ref(model)
        self._reads: list[tuple[dict, str, object]] = []  # (the dict, the key, what it held)
        self._versions: list[tuple[torch.Tensor, int]] = []
        self._mat, self._watch_versions = mat, versions
        wte = self._module(model, "wte")
        # The tied head and the lookups run on wte's table where it is a plain nn.Embedding; a
        # swapped-in embedding (int8 rows, gpt2kit.quant.modules) looks its rows up and runs the head itself.
        self.wte: torch.Tensor | None = self._param(wte, "weight") if type(wte) is nn.Embedding else None
        self.head: Mat | None = None if self.wte is None else Mat(self._matrix(self.wte), None)
        self.wte_module = wte
        self.wpe = self._param(self._module(model, "wpe"), "weight")
        ln_f = self._module(model, "ln_f")
        self.ln_f_weight, self.ln_f_bias = self._param(ln_f, "weight"), self._param(ln_f, "bias")
        h = self._module(model, "h")
        self._blocks_dict, self._n_blocks = h._modules, len(h._modules)
        self.blocks = [self._block(self._module(h, name)) for name in h._modules]
        self._mat = None  # only needed while binding (a kernel set's lookup: no cycle through it)

    def _block(self, block: nn.Module) -> Block:
        attn, mlp = self._module(block, "attn"), self._module(block, "mlp")
        ln_1, ln_2 = self._module(block, "ln_1"), self._module(block, "ln_2")
        return Block(self._param(ln_1, "weight"), self._param(ln_1, "bias"),
                     self._product(attn, "c_attn"), self._product(attn, "c_proj"),
                     self._param(ln_2, "weight"), self._param(ln_2, "bias"),
                     self._product(mlp, "c_fc"), self._product(mlp, "c_proj"))

    def _module(self, owner: nn.Module, name: str) -> nn.Module:
        d = owner._modules
        self._reads.append((d, name, d[name]))
        return d[name]

    def _param(self, owner: nn.Module, name: str) -> torch.Tensor:
        d = owner._parameters
        if name not in d:  # not a parameter here (a buffer of a swapped-in module): read it as it is
            return getattr(owner, name)
        self._reads.append((d, name, d[name]))
        return d[name]

    def _product(self, owner: nn.Module, name: str) -> Product:
        layer = self._module(owner, name)
        if type(layer) is not nn.Linear:
            return layer
        return Mat(self._matrix(self._param(layer, "weight")), self._param(layer, "bias"))

    def _matrix(self, weight: torch.Tensor) -> torch.Tensor:
        if self._watch_versions:
            self._versions.append((weight, weight._version))
        return self._mat(weight)

    def current(self, model: nn.Module) -> bool:
        """Whether this is `model`'s binding and every module and parameter it read is still the
        model's (and, for copies, unchanged)."""
        if self._model() is not model or len(self._blocks_dict) != self._n_blocks:
            return False
        try:
            for d, name, held in self._reads:
                if d[name] is not held:
                    return False
        except KeyError:  # deleted, or moved elsewhere (torch.nn.utils.parametrize)
            return False
        for weight, version in self._versions:
            if weight._version != version:
                return False
        return True
