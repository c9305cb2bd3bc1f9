"""oneDNN-prepacked copies of a model's weight matrices, for CPU decode steps.

A decode step pushes a handful of rows through every matrix, so the matrices' bytes are its whole
cost, and how fast a kernel streams them depends on their memory layout. oneDNN can reorder a
weight once into the blocked layout its kernels read best ("prepacking", what inductor's
freezing and IPEX do); that makes float32 steps of 2-16 rows and bfloat16 steps faster than the
plain kernels (figures in docs/benchmarks.md). A float32 single row
is faster without it (MKL's mat-vec), so it keeps the plain path.

The price is a second copy of the matrices (the embedding/LM head included) while packed copies
exist. They are made on first use, kept for the next generation (keyed by the model, checked
against each weight's storage and version, so training or model.to() invalidates them) and
dropped with the model or by release(model). packed_weights(model, ..., enabled=None) packs only
where it helps and the copy fits: CPU, oneDNN present, float32 (batches of 2+) or bfloat16 on a
CPU with native bf16, and MemAvailable at least twice the copy's size.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import gpt2kit.decode.f32 as f32
from gpt2kit.decode.bind import Binding, KernelSet, Mat, Op, Product, adds_update
from gpt2kit.decode.plain import PlainKernels, cpu_has_native_bfloat16
from gpt2kit.machine import mem_available

_PACKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # model -> PackedWeights


def _reorder(weight: torch.Tensor, hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, hint)


class PackedWeights:
    """Packed copies of a model's matrices, looked up by the Parameter they copy: a KernelSet
    (decode.bind) whose products run on oneDNN with the GELU and the residual add fused in. A layer
    that is not a plain nn.Linear is called as its module; steps the packing does not cover (a float32
    single row) run on decode.plain's set."""

    watches_versions = True  # copies: an in-place edit of a parameter makes a binding stale

    def __init__(self, hint: int) -> None:
        self.hint = hint  # the row count the packing was tuned for (1, or 8 for "a few")
        # id(param) -> (weakref to param, data_ptr, version, packed copy)
        self._mats: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}
        self._plain = PlainKernels()  # what a step the packing does not cover runs on (for_rows)
        self._unary = self._binary = None  # the oneDNN ops, resolved with the first copies
        self._wide = _Bucketed(self)  # steps of more than EXACT_ROWS rows
        self._few: PlainKernels | None = None  # float32 steps of 2..f32.MAX_ROWS rows on a C kernel (use_few)

    def refresh(self, params: list[torch.Tensor]) -> None:
        """Keep exactly `params` packed: repack those whose storage or contents changed since they
        were packed (training steps, load_state_dict, model.to), drop the ones no longer there."""
        mats = {}
        with torch.no_grad():
            for p in params:
                have = self._mats.get(id(p))
                if have is not None and have[0]() is p and have[1:3] == (p.data_ptr(), p._version):
                    mats[id(p)] = have
                else:
                    # The LM head uses the first n_vocab rows; padding rows are packed too (harmless).
                    packed = _reorder(p.detach().contiguous(), self.hint)
                    mats[id(p)] = (weakref.ref(p), p.data_ptr(), p._version, packed)
        self._mats = mats
        if self._unary is None:
            op = torch.ops.mkldnn._linear_pointwise
            self._unary, self._binary = op.default, op.binary

    @property
    def f32_kernel(self) -> str:
        return self._plain.f32_kernel

    def use_f32(self, kernel: str) -> None:
        """The kernel single float32 rows (which the packing does not cover) run on (decode.f32)."""
        self._plain.use_f32(kernel)

    def use_few(self, kernel: str) -> None:
        """What float32 steps of 2..f32.MAX_ROWS rows run on: "packed" (these copies) or a C kernel
        (decode.f32.decide_few), on the model's own matrices."""
        self._few = None if kernel == "packed" else PlainKernels(_product=f32.product(kernel))

    def covers(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a step of `rows` rows should use the packed matrices (a float32 single row
        is faster on MKL's mat-vec, e.g. when a batch has finished down to one row)."""
        return bool(self._mats) and not (rows == 1 and dtype == torch.float32)

    def for_rows(self, rows: int, dtype: torch.dtype, cpu: bool) -> KernelSet:
        if self._few is not None and 1 < rows <= f32.MAX_ROWS and dtype == torch.float32 and cpu:
            return self._few
        if not self.covers(rows, dtype):
            return self._plain.for_rows(rows, dtype, cpu)
        return self if rows <= EXACT_ROWS else self._wide

    def bind(self, model: nn.Module) -> Binding:
        """The model's decode tensors with the packed copies in place of its plain matrices, repacked
        first where a matrix was replaced or edited in place since (its version counter moved)."""
        self.refresh(_matrices(model))
        return Binding(model, self)

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        return self._mats[id(weight)][3]

    def op(self, product: Product, role: str) -> Op:
        """x (R, in) @ W^T + b on the packed W, with the GELU or the residual add fused in (oneDNN
        post-ops: one kernel instead of two, the same math); the head's rows are cut by the loop."""
        if product.__class__ is not Mat:
            return Op(product, ())
        w, b = product
        if role == "gelu":
            return Op(self._unary, (w, b, "gelu", [], "tanh"), True)
        if role == "add":
            return Op(self._binary, (w, b, "add"), True)  # fn(x, residual, w, b, "add")
        return Op(self._unary, (w, b, "none", [], ""))

    def holds(self, param: torch.Tensor) -> bool:
        """Whether a packed copy of this very parameter is held."""
        have = self._mats.get(id(param))
        return have is not None and have[0]() is param

    def nbytes(self) -> int:
        return sum(t.shape.numel() * t.element_size() for *_, t in self._mats.values())


class _Bucketed:
    """A PackedWeights' products for steps of more than EXACT_ROWS rows: run on the rows padded to
    their bucket (rows_bucket), the result cut back."""

    watches_versions = True

    def __init__(self, packed: PackedWeights) -> None:
        self._packed = packed
        self.f32_kernel = "torch"  # never single rows

    def for_rows(self, rows: int, dtype: torch.dtype, cpu: bool) -> KernelSet:
        return self._packed.for_rows(rows, dtype, cpu)

    def use_f32(self, kernel: str) -> None:
        self._packed.use_f32(kernel)

    def bind(self, model: nn.Module) -> Binding:
        self._packed.refresh(_matrices(model))
        return Binding(model, self)

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        return self._packed.matrix(weight)

    def op(self, product: Product, role: str) -> Op:
        op = self._packed.op(product, role)
        if product.__class__ is not Mat:
            return op
        fn = op.fn
        if role == "add":
            def run(x, residual, *args):
                return fn(rows_bucket(x), rows_bucket(residual), *args)[:x.shape[0]]
        else:
            def run(x, *args):
                return fn(rows_bucket(x), *args)[:x.shape[0]]
        return Op(run, op.args, op.fused)


EXACT_ROWS = 64  # row counts up to this many get oneDNN kernels of their own (a decode step's batch)


def rows_bucket(x: torch.Tensor) -> torch.Tensor:
    """x (R, K) with zero rows appended up to R's bucket: R itself up to EXACT_ROWS, beyond it R rounded
    up to a multiple of an eighth of the power of two below it (at most 12.5% more rows). The packed
    products keep memory for every row count they have run (measured, docs/serving.md "Memory"; the
    mechanism inside oneDNN not pinned down), so prompts and scored texts of every length would each
    add theirs; in buckets a few dozen row counts serve every length."""
    R = x.shape[0]
    if R <= EXACT_ROWS:
        return x
    step = 1 << (R.bit_length() - 4)  # an eighth of the power of two at or below R
    rows = -(-R // step) * step
    if rows == R:
        return x
    out = x.new_empty(rows, x.shape[1])
    out[:R] = x
    out[R:] = 0
    return out


CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cache_entries(max_batch: int, engines: int = 1) -> int:
    """How many compiled products a process whose batches reach max_batch rows keeps (bound_caches):
    a step of R rows runs five (the four block products and the LM head, each with its fused
    op), so every row count up to max_batch, twice over (prompt chunks bring row counts of their
    own between a batch's steps, and a step's products must not be the ones that go), plus 64;
    twice that for a speculating server (engines=2: the draft's products, and verifications of
    several tokens a row)."""
    return engines * (10 * max_batch + 64)


def bound_caches(entries: int) -> dict[str, str]:
    """Keep at most `entries` compiled products in each of oneDNN's two caches (its primitive cache and
    ideep's cache of primitive descriptors), where the environment does not set them already; the
    values now in force. A long-lived process (a server) calls it before its first oneDNN call: both
    read their capacity once, from these variables.

    Why: both default to 1,024 entries and both keep each product's descriptor for every row count
    it has run (an entry pair's size for GPT-2 124M's products: docs/serving.md "Memory"). Prompt
    chunks and scored texts bring new row counts for a long time, so a server's memory grew with every
    request and had not levelled off after thousands of them (the same section). Bounded, the least
    recently used go; a product run again after its entry went is compiled again (a cost that section
    gives beside a cached call's), and the rows of a decode step, run every step, stay."""
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in CACHE_VARIABLES}


def _matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The matrices a decode step multiplies by: the blocks' four and the tied LM head (wte), where
    they are plain or the base of an update (decode.bind.Adapted; a swapped-in module, e.g. a quantized
    linear, keeps its own product)."""
    mats = [model.wte.weight] if isinstance(model.wte, nn.Embedding) else []
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if type(layer) is nn.Linear or adds_update(layer):
                mats.append(layer.weight)
    return mats


def supported(dtype: torch.dtype, batch_size: int) -> bool:
    """Whether packing speeds up a CPU decode step of this dtype and batch size here."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return batch_size >= 2  # MKL's mat-vec is faster for one row
    if dtype == torch.bfloat16:
        return cpu_has_native_bfloat16()
    return False


def packed_weights(model: torch.nn.Module, batch_size: int, enabled: bool | None = None) -> PackedWeights | None:
    """The model's packed matrices for decode steps of batch_size rows, or None where packing is
    off (enabled=False), does not apply (not CPU, dtype, no oneDNN) or, when enabled is None
    (auto), the copy would not fit twice in the available memory."""
    if enabled is False:
        return None
    w = model.wte.weight
    if w.device.type != "cpu" or not supported(w.dtype, max(batch_size, 2)):
        _PACKS.pop(model, None)  # moved or cast since it was packed: the copies are stale
        return None
    if not supported(w.dtype, batch_size):
        return None  # a float32 single row: the plain kernel (any copies stay for the next batch)
    hint = 1 if batch_size == 1 else 8
    mats = _matrices(model)
    pack = _PACKS.get(model)
    # A copy packed for the other hint serves too: any row count runs on either, and packing again
    # (seconds) each time a bfloat16 batch shrinks to one row and grows again costs far more.
    if pack is None:
        if enabled is None:
            need = sum(p.numel() * p.element_size() for p in mats)
            have = mem_available()
            if have is not None and have < 2 * need:
                return None
        pack = PackedWeights(hint)
    try:
        pack.refresh(mats)
    except (AttributeError, RuntimeError):  # a torch/oneDNN build that cannot pack this: plain kernels
        _PACKS.pop(model, None)
        return None
    _PACKS[model] = pack
    return pack


def release(model: torch.nn.Module) -> None:
    """Drop the model's packed copies (they are rebuilt on the next packed generation)."""
    _PACKS.pop(model, None)


def is_packed(model: torch.nn.Module) -> bool:
    """Whether packed copies of the model's matrices are held now."""
    return model in _PACKS
