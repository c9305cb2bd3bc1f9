"""What a kernel set is (KernelSet) and a model's decode tensors resolved once for one (Binding), as
llm.c resolves its weight pointers once.

Reading ``model.h[i].attn.c_attn.weight`` walks four nn.Module.__getattr__ calls; a Binding reads every
tensor a step needs once, into one tuple per block whose products are Ops: the function the kernel set
runs the product on and its arguments (the matrix, or the set's copy of it, and the bias), so the flat
loop (decode.step) calls the kernel itself. A swapped-in module (a quantized linear) is an Op of its
own, called as the module it is; one whose product is its plain matrix's plus an update it adds
itself (a many-adapter linear: `add_update`) runs that matrix on the set's kernel like any other
and then adds its update (Adapted), so its base rows cost what a plain model's do.
Whether a binding is still the model's is asked once per
step by the path that holds it (decode.path.Kernels): every module and parameter it read is looked up
again in the dict nn.Module keeps it in (``_modules``, ``_parameters``: plain dict reads, no attribute
machinery), so a module swap, a replaced parameter (``load_state_dict(assign=True)``,
``layer.weight = ...``) or a changed block count makes it stale. A kernel set that computes from copies
of the weights (decode.packed) also has the binding watch each copied parameter's version counter, so
an in-place edit (a training step, load_state_dict's copy) makes it stale too; the plain kernels hold
the parameters themselves, so they see in-place edits and ``.data`` assignments as they happen.

Legend: R rows, C n_embd.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Mat(NamedTuple):
    """A plain nn.Linear's product as a kernel set runs it: its matrix (or the set's copy of it) and bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None


class Adapted(NamedTuple):
    """A swapped-in module whose product is its plain matrix's (`base`, run on the kernel set as any
    Mat) plus what module.add_update(x, y) adds to it (each row's own low-rank update, or nothing
    where module.updating() is False): gpt2kit.lora.MultiLoRALinear."""

    base: Mat
    module: nn.Module


# A bound product: a Mat, an Adapted, or another swapped-in module (a quantized linear), called as itself.
Product = Mat | Adapted | nn.Module


def adds_update(layer: nn.Module) -> bool:
    """Whether a layer's product is its plain `weight` and `bias`'s plus an update it adds (Adapted)."""
    return callable(getattr(layer, "add_update", None))

ROLES = ("linear", "gelu", "add", "head")  # what the flat loop does with a product's result


class Op(NamedTuple):
    """One product of the flat loop: ``fn(x, *args)`` is x (R, in) @ W^T + b. fused: fn takes in what the
    loop would do after it, the tanh-GELU (role "gelu") or the residual add (role "add", called as
    ``fn(x, residual, *args)``), as oneDNN's post-ops do (decode.packed)."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    fused: bool = False


class KernelSet(Protocol):
    """How the flat loop's products run: decode.plain's on the model's own matrices, decode.packed's on
    prepacked copies. A set for one shape of step is picked by for_rows; bind resolves the model's tensors
    in the set's form (Binding(model, set)), which calls matrix and op."""

    watches_versions: bool  # the set computes from copies: in-place edits of their parameters make a binding stale
    f32_kernel: str  # what single float32 rows run on (decode.f32.KERNELS)

    def for_rows(self, rows: int, dtype: torch.dtype, cpu: bool) -> KernelSet:
        """The set a step of `rows` rows of `dtype` runs on (this one, or a sibling)."""
        ...

    def bind(self, model: nn.Module) -> Binding:
        """The model's tensors in this set's form, resolved now."""
        ...

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The set's form of a plain matrix (the weight itself, or a packed copy)."""
        ...

    def op(self, product: Product, role: str) -> Op:
        """The Op the flat loop calls for `product` in `role` (one of ROLES)."""
        ...

    def use_f32(self, kernel: str) -> None:
        """Run single float32 rows on `kernel` (decode.f32.KERNELS)."""
        ...


class Block(NamedTuple):
    ln_1_weight: torch.Tensor
    ln_1_bias: torch.Tensor
    c_attn: Op
    attn_c_proj: Op
    ln_2_weight: torch.Tensor
    ln_2_bias: torch.Tensor
    c_fc: Op
    mlp_c_proj: Op


class Binding:
    """What a decode step reads from `model`, resolved once for the kernel set `kernels`: per block the
    layer norms' tensors and the four products as Ops (`blocks`), and as the products they are
    (`products`: Mat or module, what decode.native_step hands to C); the embeddings, the final norm and
    the head (an Op, and `head_mat`, the tied table's Mat, None where wte is swapped). `model`, `reads`,
    `versions`, `blocks_dict` and `next_block` are what the path holding it checks once per step
    (decode.path.Kernels.bound)."""

    def __init__(self, model: nn.Module, kernels: KernelSet) -> None:
        self.model = weakref.ref(model)
        self.reads: list[tuple[dict, str, object]] = []  # (the dict, the key, what it held)
        self.versions: list[tuple[torch.Tensor, int]] = []  # (a copied parameter, its version then)
        self._kernels = kernels
        wte = self._module(model, "wte")
        # The tied head and the lookups run on wte's table where it is a plain nn.Embedding; a swapped-in
        # embedding (int8 rows, trained rows) looks its rows up and the model's lm_head runs its head.
        self.wte: torch.Tensor | None = self._param(wte, "weight") if type(wte) is nn.Embedding else None
        self.wte_module = wte
        self.head_mat: Mat | None = None if self.wte is None else Mat(self._matrix(self.wte), None)
        self.head = kernels.op(self.head_mat, "head") if self.head_mat is not None else Op(model.lm_head, ())
        self.wpe = self._param(self._module(model, "wpe"), "weight")
        ln_f = self._module(model, "ln_f")
        self.ln_f_weight, self.ln_f_bias = self._param(ln_f, "weight"), self._param(ln_f, "bias")
        h = self._module(model, "h")
        self.blocks_dict, self.next_block = h._modules, str(len(h._modules))  # a block appended: stale
        self.products: list[tuple[Product, Product, Product, Product]] = []
        self.blocks = [self._block(self._module(h, name)) for name in h._modules]
        self._kernels = None  # only needed while binding (a packed set's lookup: no cycle through it)

    def _block(self, block: nn.Module) -> Block:
        attn, mlp = self._module(block, "attn"), self._module(block, "mlp")
        ln_1, ln_2 = self._module(block, "ln_1"), self._module(block, "ln_2")
        products = (self._product(attn, "c_attn"), self._product(attn, "c_proj"),
                    self._product(mlp, "c_fc"), self._product(mlp, "c_proj"))
        self.products.append(products)
        op = self._op
        return Block(self._param(ln_1, "weight"), self._param(ln_1, "bias"),
                     op(products[0], "linear"), op(products[1], "add"),
                     self._param(ln_2, "weight"), self._param(ln_2, "bias"),
                     op(products[2], "gelu"), op(products[3], "add"))

    def _op(self, product: Product, role: str) -> Op:
        if product.__class__ is Adapted:
            return adapted_op(self._kernels, product, role)
        return self._kernels.op(product, role)

    def _module(self, owner: nn.Module, name: str) -> nn.Module:
        d = owner._modules
        self.reads.append((d, name, d[name]))
        return d[name]

    def _param(self, owner: nn.Module, name: str) -> torch.Tensor:
        d = owner._parameters
        if name not in d:  # not a parameter here (a buffer of a swapped-in module): read it as it is
            return getattr(owner, name)
        self.reads.append((d, name, d[name]))
        return d[name]

    def _product(self, owner: nn.Module, name: str) -> Product:
        layer = self._module(owner, name)
        if type(layer) is not nn.Linear and not adds_update(layer):
            return layer
        mat = Mat(self._matrix(self._param(layer, "weight")), self._param(layer, "bias"))
        return mat if type(layer) is nn.Linear else Adapted(mat, layer)

    def _matrix(self, weight: torch.Tensor) -> torch.Tensor:
        if self._kernels.watches_versions:
            self.versions.append((weight, weight._version))
        return self._kernels.matrix(weight)


def adapted_op(kernels: KernelSet, product: Adapted, role: str) -> Op:
    """The set's Op for the base matrix, the module's update added to what it gives: after a fused
    residual add (the sum's order the only change), and before the GELU, so a set that fuses the GELU
    runs its unfused product in a step where the module adds something, its fused one where not."""
    module, op = product.module, kernels.op(product.base, role)
    updating = module.updating

    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The update's products are a few rows by r columns: on one thread, as splitting them costs more than
        # they do (and on a busy machine each split waits for the other threads).
        threads = torch.get_num_threads()
        if threads == 1 or not updating():
            return module.add_update(x, y)
        torch.set_num_threads(1)
        try:
            return module.add_update(x, y)
        finally:
            torch.set_num_threads(threads)

    if role == "gelu" and op.fused:
        plain = kernels.op(product.base, "linear")

        def gelu_after_update(x, *_):
            if updating():
                return F.gelu(add(x, plain.fn(x, *plain.args)), approximate="tanh")
            return op.fn(x, *op.args)
        return Op(gelu_after_update, (), True)
    if role == "add" and op.fused:
        return Op(lambda x, residual, *args: add(x, op.fn(x, residual, *args)), op.args, True)
    return Op(lambda x, *args: add(x, op.fn(x, *args)), op.args, False)
