"""Which way a model's decode steps run: the one place that decides it.

kernels_for(model, rows) chooses once, when a batch's shape changes, and hands back a Kernels that
says which path runs:

  forward  the spec's own forward (model.py): a model in training (dropout) or with hooks registered,
           so hooks and dropout behave as everywhere else
  flat     the flat loop of decode/step.py on a kernel set (decode.bind.KernelSet): decode.packed's
           prepacked copies where packing applies and pays, else decode.plain's products on the
           model's own matrices
  native   the flat loop, and for a step of one unmasked row whose every product runs on a native
           kernel the whole step in C (decode.native_step, csrc/step.c)

A Kernels holds what its steps run on, bound once (decode.bind.Binding, and the native step's table
of addresses), and checks once per step, in `bound`, that all of it is still the model's; a step of
another shape (a batch that finished down to one row, a prompt's chunk) runs on the kernel set's
sibling for that shape, bound on first use. int8 and int8-activation models keep their modules
(gpt2kit.quant.modules): the flat loop calls each swapped module as the module it is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

import gpt2kit.decode.dnn as dnn
import gpt2kit.decode.f32 as f32
import gpt2kit.decode.native_step as native_step
from gpt2kit.decode.bind import Binding, KernelSet, adds_update
from gpt2kit.decode.packed import PackedWeights, packed_weights
from gpt2kit.decode.plain import PlainKernels, choose_half_kernels
from gpt2kit.model import GPT2


class Kernels:
    """The path a model's decode steps run on (module doc): `kind` is "forward", "flat" or "native";
    `kernel_set` the flat loop's (None: the forward). keep=False binds the model's tensors on every
    step and keeps nothing (PLAIN, shared by every model: it must not hold one model's tensors)."""

    def __init__(self, kernel_set: KernelSet | None, *, keep: bool = True) -> None:
        self.kernel_set = kernel_set
        self.forward = kernel_set is None  # a plain attribute: read on every step
        self.cudnn = torch.backends.cudnn.enabled  # what F.layer_norm would pass (unused on CPU)
        self.native: native_step.NativeStep | None = None  # the bound step's, where it applies
        self._native_ok = keep and not self.forward and native_step.enabled()
        self._keep = keep
        self._key: tuple | None = None  # (rows, dtype, cpu) of the last step
        self._bound: Binding | None = None
        # id(set) -> (the set, its binding, its native step: None where it does not apply, False: not tried)
        self._held: dict[int, tuple[KernelSet, Binding, native_step.NativeStep | None | bool]] = {}

    @property
    def kind(self) -> str:
        """The path: "forward", "native" (the last step's binding runs one row in C) or "flat"."""
        return "forward" if self.forward else "native" if self.native is not None else "flat"

    def bound(self, model: nn.Module, rows: int, kv: torch.Tensor) -> Binding:
        """The model's tensors for a step of `rows` rows on a cache like `kv`, in the form of the kernel
        set for that shape: the one currency check of the step (the binding still the model's and, for
        one row, every address given to C still where it was), bound again where it is not. Sets
        `native` (a step of one row may run in C)."""
        key = (rows, kv.dtype, kv.is_cpu)
        if key != self._key:
            self._select(key)
        b = self._bound
        # Every module and parameter the binding read is looked up again in the dict nn.Module keeps it
        # in (plain dict reads, no attribute machinery, no calls); copies' parameters keep their versions.
        if b is None or b.model() is not model or b.next_block in b.blocks_dict:
            return self._bind(model, rows, kv)
        try:
            for d, name, held in b.reads:
                if d[name] is not held:
                    return self._bind(model, rows, kv)
        except KeyError:  # deleted, or moved elsewhere (torch.nn.utils.parametrize)
            return self._bind(model, rows, kv)
        for weight, version in b.versions:
            if weight._version != version:
                return self._bind(model, rows, kv)
        if rows == 1 and self.native is not None and not self.native.current():
            return self._bind(model, rows, kv)
        return b

    def _select(self, key: tuple) -> None:
        self._key = key
        held = self._held.get(id(self.kernel_set.for_rows(*key)))
        if held is None or (key[0] == 1 and held[2] is False):  # a first row count of 1: try C
            self._bound, self.native = None, None
        else:
            self._bound, self.native = held[1], held[2] or None

    def _bind(self, model: nn.Module, rows: int, kv: torch.Tensor) -> Binding:
        k_set = self.kernel_set.for_rows(rows, kv.dtype, kv.is_cpu)
        b = k_set.bind(model)
        native = native_step.build(model, b, k_set.f32_kernel) if self._native_ok and rows == 1 else None
        if self._keep:
            self._held[id(k_set)] = (k_set, b, native if rows == 1 else False)
            self._bound, self.native = b, native
        else:
            self._key, self.native = None, None
        return b


FORWARD = Kernels(None)  # the spec's forward, for every model
PLAIN = Kernels(PlainKernels(), keep=False)  # the flat loop on the plain products, bound on every call
_PROMPT = Kernels(dnn.DnnKernels(PlainKernels()), keep=False)  # many float32 rows on oneDNN, bound on every call


def kernels_for(model: GPT2, batch_size: int, pack: bool | None = None) -> Kernels:
    """The path for decode steps of batch_size rows (module doc): the forward when the model is
    training or has hooks; else the flat loop on the packed matrices where packing applies (pack=None:
    where it is faster and the copy fits; gpt2kit.decode.packed), else on the plain kernels, with the
    whole step in C where a step of one row can take it. The Kernels keeps the model's tensors bound
    between steps (bound again when one is replaced: decode.bind)."""
    if model.training or _has_hooks(model):
        return FORWARD
    largest = _largest_matrix(model)
    if largest is not None:
        choose_half_kernels(largest)
    k_set = packed_weights(model, batch_size, pack) or PlainKernels()
    k_set.use_f32(f32_kernel(model))  # single float32 rows (a batch of 1, or one finished down to 1)
    if isinstance(k_set, PackedWeights):
        k_set.use_few(f32_few_kernel(model, k_set))  # float32 batches of 2..f32.MAX_ROWS rows
    return Kernels(k_set)


def prompt_kernels(model: GPT2) -> Kernels:
    """The path of a prefill given none: the forward for a model in training or with hooks, or whose
    MLP is not a plain float32 CPU nn.Linear; else the flat loop, its products of many rows on oneDNN
    where decode.dnn chose it for this CPU (measured once per process, stored per machine), else on
    the plain products. The loop takes the last block's attention and MLP at the last position alone."""
    if model.training or _has_hooks(model):
        return FORWARD
    fc = model.h[0].mlp.c_fc if len(model.h) else None
    if type(fc) is not nn.Linear or fc.weight.dtype != torch.float32 or not fc.weight.is_cpu:
        return FORWARD
    if not dnn.available() or dnn.choose(fc.weight, fc.bias).kernel == "torch":
        return PLAIN
    return _PROMPT


F32_MIN_BYTES = 64 << 20  # smaller models' matrices stay in cache: no single-row choice is made for them


def f32_kernel(model: GPT2) -> str:
    """The kernel single float32 rows of this model run on (decode.f32): GPT2KIT_F32_KERNEL when set;
    else, for a CPU float32 model in the decode layout whose matrices are F32_MIN_BYTES or more, the
    choice decode.f32 makes (stored per machine and model shape; measured on the model's own matrices);
    else "torch"."""
    forced = f32.forced()  # the override, checked (ValueError naming the choices)
    if forced is not None:
        return forced
    mats = _f32_matrices(model)
    if not mats or sum(w.numel() * 4 for w, _ in mats) < F32_MIN_BYTES:
        return "torch"
    cfg = model.config
    shape = f"{cfg.n_embd}x{cfg.n_layer}x{model.wte.weight.shape[0]}"
    kernel = f32.chosen_kernel(shape)
    return kernel if kernel is not None else f32.decide_for(shape, mats).kernel


def f32_few_kernel(model: GPT2, packed: PackedWeights) -> str:
    """What float32 steps of 2..f32.MAX_ROWS rows of this model run on: "packed" (oneDNN on `packed`'s
    copies) or a C kernel, decode.f32.decide_few's choice for a CPU float32 model in the decode layout
    whose matrices are F32_MIN_BYTES or more; "packed" for any other."""
    mats = _f32_matrices(model)
    if not mats or sum(w.numel() * 4 for w, _ in mats) < F32_MIN_BYTES or not all(packed.holds(w) for w, _ in mats):
        return "packed"
    cfg = model.config
    shape = f"{cfg.n_embd}x{cfg.n_layer}x{model.wte.weight.shape[0]}"
    kernel = f32.chosen_few(shape)
    return kernel if kernel is not None else f32.decide_few(shape, mats, packed.matrix).kernel


def _f32_matrices(model: GPT2) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of a single-row step's products in order, the tied head last, where every one
    is a plain float32 CPU nn.Linear (or the base of an update, decode.bind.Adapted) in the decode
    layout (stored (in, out)); [] otherwise."""
    if type(model.wte) is not nn.Embedding:
        return []
    mats = []
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if type(layer) is not nn.Linear and not adds_update(layer):
                return []
            mats.append((layer.weight, layer.bias))
    mats.append((model.wte.weight, None))
    ok = all(w.dtype == torch.float32 and w.is_cpu and w.stride(0) == 1 for w, _ in mats)
    return mats if ok else []


def _has_hooks(model: nn.Module) -> bool:
    """Whether any forward hook would fire in the model's forward (the flat loop would skip it)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())


def _largest_matrix(model: GPT2) -> torch.Tensor | None:
    """A float matrix to measure the half-precision kernels on (None when all are swapped, e.g. int8)."""
    fc = model.h[0].mlp.c_fc
    if type(fc) is nn.Linear or adds_update(fc):
        return fc.weight
    return model.wte.weight if type(model.wte) is nn.Embedding else None
