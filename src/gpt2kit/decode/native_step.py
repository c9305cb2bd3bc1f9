"""The batch-1 decode step as one native call (csrc/step.c), where every product of the step already
runs on gpt2kit's own kernels.

The flat loop (decode/step.py) makes a hundred small PyTorch calls per token besides its products;
at batch 1 they and their Python are a large share of a float32 token and a larger one of an int8
token (docs/benchmarks.md). csrc/step.c runs the whole network for one row in C and calls the same
product functions the flat loop would call. It is used only where it computes what the flat loop
computes with the kernels already chosen for it:

- one row, no attention mask, a float32 model on the CPU with a float32 cache;
- every block product, and the head, is one the flat loop would run on a native kernel: a plain
  float32 matrix in the decode layout while decode.f32 chose a native kernel for single rows, or a
  module whose product is decode.int8's on float activations (decode.int8.Int8Weights: gpt2kit.quant's
  QuantLinear and QuantEmbedding) while decode.int8 chose its native kernel for one row. Anything
  else (torch's products chosen, int8 activations, an adapter, hooks: those take the model's forward
  before this) keeps the flat loop.

`build` makes a NativeStep for one binding (decode/bind.py), or says None where it does not apply.
The path that holds both (decode.path.Kernels) checks once per step that every tensor C was given is
still where it was (a ``.data`` assignment such as use_decode_layout's moves a parameter without a new
binding) and builds it again when not. GPT2KIT_NATIVE_STEP=0 turns it off (the flat loop runs). The
result equals the flat loop's to float32 round-off (tests/test_decode_native_step.py).

Legend: C n_embd, V the head's rows.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

import gpt2kit.decode.int8 as int8
import gpt2kit.decode.native as native
from gpt2kit.decode.bind import Binding, Mat
from gpt2kit.kv_cache import KVCache

ENV = "GPT2KIT_NATIVE_STEP"
F32, INT8 = 1, 2  # csrc/step.c's Mat.kind


class _Mat(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_long), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("K", ctypes.c_long), ("N", ctypes.c_long), ("ldw", ctypes.c_long)]


class _Block(ctypes.Structure):
    _fields_ = [("ln1_w", ctypes.c_void_p), ("ln1_b", ctypes.c_void_p), ("ln2_w", ctypes.c_void_p),
                ("ln2_b", ctypes.c_void_p), ("attn", _Mat), ("proj", _Mat), ("fc", _Mat), ("mlp", _Mat)]


class _Net(ctypes.Structure):
    _fields_ = [("C", ctypes.c_long), ("nh", ctypes.c_long), ("n_layer", ctypes.c_long), ("eps", ctypes.c_float),
                ("blocks", ctypes.POINTER(_Block)), ("lnf_w", ctypes.c_void_p), ("lnf_b", ctypes.c_void_p),
                ("head", _Mat), ("f32", ctypes.c_void_p), ("int8", ctypes.c_void_p), ("f32_isa", ctypes.c_long)]


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


_DATA_PTR = torch.Tensor.data_ptr


class NativeStep:
    """csrc/step.c's step for one binding's tensors (made by `build`); call(x (1, C), cache) -> logits
    (1, V rows of the head), or None where this call does not fit (the flat loop runs it)."""

    def __init__(self, fn, net: _Net, blocks, held: list[tuple[torch.Tensor, int]], n_head_rows: int) -> None:
        self._fn, self._net, self._blocks = fn, net, blocks  # blocks: the array net points into, kept alive
        self._tensors = tuple(t for t, _ in held)  # what C was given, and the addresses it was given
        self._ptrs = tuple(ptr for _, ptr in held)
        self._n_head_rows = n_head_rows

    def current(self) -> bool:
        """Whether every tensor C was given is still where it was (one pass in C over them all)."""
        return tuple(map(_DATA_PTR, self._tensors)) == self._ptrs

    def __call__(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """Logits (1, V rows of the head) for the embedded token x (1, C) at position cache.length, the
        cache written there and advanced; None (nothing advanced) where the cache is not a plain one
        (`cache.plain`: KVCache, or an engine step that writes at P alone), its layout does not fit,
        or the C side refuses."""
        kv = cache.kv
        if (not getattr(cache, "plain", False) or kv.dtype != torch.float32 or not kv.is_cpu or kv.shape[1] != 1
                or kv.stride(-1) != 1 or x.dtype != torch.float32 or cache.length >= kv.shape[4]):
            return None
        x = x.contiguous().clone()  # (1, C) float32, clobbered by C
        logits = torch.empty(1, self._n_head_rows)
        P = cache.length
        s = kv.stride()  # (L, B, 2, nh, M, hs)
        rc = self._fn(ctypes.addressof(self._net), x.data_ptr(), kv.data_ptr(), s[0], s[2], s[3], s[4], P,
                      logits.data_ptr(), torch.get_num_threads())
        if rc != 0:
            return None
        cache.length = P + 1
        return logits


class _Tables:
    """What C is given, checked: each method returns the table entry, or None where C does not take it."""

    def __init__(self, f32_kernel: str) -> None:
        self.held: list[tuple[torch.Tensor, int]] = []
        native_f32 = f32_kernel.startswith("native-")
        self.f32_isa = native.F32_ISAS.get(f32_kernel.removeprefix("native-")) if native_f32 else None
        self.int8_ok: bool | None = None  # decided at the first int8 product

    def hold(self, t: torch.Tensor) -> int:
        ptr = t.data_ptr()
        self.held.append((t, ptr))
        return ptr

    def vec(self, t: torch.Tensor | None, n: int) -> int | None:
        if t is None or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.numel() != n:
            return None
        return self.hold(t)

    def mat(self, m: Mat | nn.Module | None, k_in: int) -> _Mat | None:
        if m is None:
            return None
        if type(m) is not Mat:
            return self.int8(m, k_in)
        w, b = m.weight, m.bias
        N, K = w.shape
        if (self.f32_isa is None or w.dtype != torch.float32 or not w.is_cpu or K != k_in or w.stride(0) != 1
                or w.stride(1) < N):
            return None
        bias = self.vec(b, N) if b is not None else 0
        return None if bias is None else _Mat(F32, self.hold(w), None, bias or None, K, N, w.stride(1))

    def int8(self, m: nn.Module, k_in: int) -> _Mat | None:
        """A module whose product is decode.int8's int8_linear on float activations (int8.Int8Weights)."""
        got = m.int8_weights() if isinstance(m, int8.Int8Weights) else None
        if got is None:
            return None
        if self.int8_ok is None:
            self.int8_ok = (native.int8_linear() is not None
                            and int8.choose(torch.device("cpu"), torch.float32, 1) == "native-avx2")
        w, s, b = got
        N, K = w.shape
        if (not self.int8_ok or w.dtype != torch.int8 or not w.is_contiguous() or not w.is_cpu or K != k_in
                or s.dtype != torch.float32):
            return None
        scale, bias = self.vec(s, N), self.vec(b, N) if b is not None else 0
        if scale is None or bias is None:
            return None
        return _Mat(INT8, self.hold(w), scale, bias or None, K, N, K)


def build(model: nn.Module, bound: Binding, f32_kernel: str) -> NativeStep | None:
    """csrc/step.c's step for the binding's tensors, or None where it does not cover this step (the
    module doc: a product or tensor C does not take, no native library) or GPT2KIT_NATIVE_STEP=0."""
    fn = native.step() if enabled() else None
    cfg = model.config
    C, nh = cfg.n_embd, cfg.n_head
    if fn is None or C % 8 or (C // nh) % 8 or C // nh > 64:
        return None
    t = _Tables(f32_kernel)
    blocks = (_Block * len(bound.blocks))()
    for i, (block, (c_attn, attn_proj, c_fc, mlp_proj)) in enumerate(zip(bound.blocks, bound.products, strict=True)):
        attn, proj, fc = t.mat(c_attn, C), t.mat(attn_proj, C), t.mat(c_fc, C)
        mlp = t.mat(mlp_proj, fc.N) if fc is not None else None
        vecs = [t.vec(v, C) for v in (block.ln_1_weight, block.ln_1_bias, block.ln_2_weight, block.ln_2_bias)]
        if attn is None or proj is None or fc is None or mlp is None or None in vecs or attn.N != 3 * C:
            return None
        blocks[i] = _Block(*vecs, attn, proj, fc, mlp)
    head = t.mat(bound.head_mat, C) if bound.head_mat is not None else t.int8(bound.wte_module, C)
    ln_f = (t.vec(bound.ln_f_weight, C), t.vec(bound.ln_f_bias, C))
    if head is None or None in ln_f:
        return None
    f32_fn = native.f32_linear() if t.f32_isa is not None else None
    int8_fn = native.int8_linear() if t.int8_ok else None
    net = _Net(C, nh, len(bound.blocks), cfg.layer_norm_eps, blocks, *ln_f, head, _address(f32_fn),
               _address(int8_fn), t.f32_isa or 0)
    return NativeStep(fn, net, blocks, t.held, head.N)


def _address(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value
