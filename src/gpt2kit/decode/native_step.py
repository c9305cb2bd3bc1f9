"""The batch-1 decode step as one native call (csrc/step.c), where every product of the step already
runs on gpt2kit's own kernels.

decode_step (decode/step.py) is ~100 small PyTorch calls per token besides its products; at batch 1
they and their Python cost 4-6 ms on a 2-core EPYC, a quarter of a float32 token of GPT-2 124M and
half of an int8 one (docs/benchmarks.md). csrc/step.c runs the whole network for one row in C and
calls the same product functions the Python step would call. It is used only where it computes
what the Python step computes with the kernels already chosen for it:

- one row, no attention mask, a float32 model on the CPU with a float32 cache;
- every block product, and the head, is one the Python step would run on a native kernel: a plain
  float32 matrix in the decode layout while decode.f32 chose a native kernel for single rows, or a
  QuantLinear / QuantEmbedding with float activations while decode.int8 chose its native kernel for
  one row. Anything else (torch's products chosen, int8 activations, an adapter, hooks: those take
  the model's forward before this) keeps the Python step.

A NativeStep is made once per binding (decode/bind.py: a swapped module makes a new one) and holds the
tensors whose addresses it passed to C; each call checks that every one is still where it was (a
``.data`` assignment such as use_decode_layout's moves a parameter without a new binding) and is
rebuilt when not. GPT2KIT_NATIVE_STEP=0 turns it off (the Python step runs). The result equals the
Python step's to float32 round-off (tests/test_decode_native_step.py).

Legend: C n_embd, V the head's rows.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

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


class _Unsupported(Exception):
    """The step has a product or tensor csrc/step.c does not take (the Python step runs)."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class NativeStep:
    """csrc/step.c's step for one binding's tensors; call(x (1, C), cache) -> logits (1, V)."""

    def __init__(self, model: nn.Module, bound: Binding, f32_kernel: str) -> None:
        self._fn = native.step()
        if self._fn is None:
            raise _Unsupported("no native step library")
        cfg = model.config
        C, nh = cfg.n_embd, cfg.n_head
        if C % 8 or (C // nh) % 8 or C // nh > 64:
            raise _Unsupported("head size")
        self._held: list[tuple[torch.Tensor, int]] = []  # (tensor, the address C was given)
        native_f32 = f32_kernel.startswith("native-")
        self._f32_isa = native.F32_ISAS.get(f32_kernel.removeprefix("native-")) if native_f32 else None
        self._int8_ok: bool | None = None
        blocks = (_Block * len(bound.blocks))()
        for i, (ln_1w, ln_1b, c_attn, attn_proj, ln_2w, ln_2b, c_fc, mlp_proj) in enumerate(bound.blocks):
            attn, fc = self._mat(c_attn, C), self._mat(c_fc, C)
            if attn.N != 3 * C:
                raise _Unsupported("c_attn's width")
            blocks[i] = _Block(self._vec(ln_1w, C), self._vec(ln_1b, C), self._vec(ln_2w, C), self._vec(ln_2b, C),
                               attn, self._mat(attn_proj, C), fc, self._mat(mlp_proj, fc.N))
        head = self._mat(bound.head, C) if bound.head is not None else self._quant(bound.wte_module, C, head=True)
        f32_fn = native.f32_linear() if self._f32_isa is not None else None
        int8_fn = native.int8_linear() if self._int8_ok else None
        self._blocks = blocks
        self._net = _Net(C, nh, len(bound.blocks), cfg.layer_norm_eps, blocks, self._vec(bound.ln_f_weight, C),
                         self._vec(bound.ln_f_bias, C), head, _address(f32_fn), _address(int8_fn),
                         self._f32_isa or 0)
        self._n_head_rows = head.N

    # --- what C is given, checked -------------------------------------------------------------------

    def _hold(self, t: torch.Tensor) -> int:
        ptr = t.data_ptr()
        self._held.append((t, ptr))
        return ptr

    def _vec(self, t: torch.Tensor, n: int) -> int:
        if t is None or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.numel() != n:
            raise _Unsupported("vector")
        return self._hold(t)

    def _mat(self, m: Mat | nn.Module, k_in: int) -> _Mat:
        if type(m) is not Mat:
            return self._quant(m, k_in)
        w, b = m.weight, m.bias
        N, K = w.shape
        if (self._f32_isa is None or w.dtype != torch.float32 or not w.is_cpu or K != k_in or w.stride(0) != 1
                or w.stride(1) < N):
            raise _Unsupported("float32 matrix")
        bias = self._vec(b, N) if b is not None else None
        return _Mat(F32, self._hold(w), None, bias, K, N, w.stride(1))

    def _quant(self, m: nn.Module, k_in: int, head: bool = False) -> _Mat:
        from gpt2kit.quant.modules import QuantEmbedding, QuantLinear

        if type(m) is not (QuantEmbedding if head else QuantLinear) or m.activations != "float":
            raise _Unsupported("module")
        if self._int8_ok is None:
            import gpt2kit.decode.int8 as int8

            self._int8_ok = (native.int8_linear() is not None
                             and int8.choose(torch.device("cpu"), torch.float32, 1) == "native-avx2")
        w, s, b = m.weight, m.scale, getattr(m, "bias", None)
        N, K = w.shape
        if (not self._int8_ok or w.dtype != torch.int8 or not w.is_contiguous() or not w.is_cpu or K != k_in
                or s.dtype != torch.float32):
            raise _Unsupported("int8 matrix")
        bias = self._vec(b, N) if b is not None else None
        return _Mat(INT8, self._hold(w), self._vec(s, N), bias, K, N, K)

    def current(self) -> bool:
        """Whether every tensor C was given is still where it was."""
        return all(t.data_ptr() == ptr for t, ptr in self._held)

    # --- the call -----------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """Logits (1, V rows of the head) for the embedded token x (1, C) at position cache.length, the
        cache written there and advanced; None (nothing advanced) where the cache is not a plain one
        (`cache.plain`: KVCache, or an engine step that writes at P alone), its layout does not fit,
        or the C side refuses (the caller runs the Python step)."""
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


def _address(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def for_binding(model: nn.Module, bound: Binding, f32_kernel: str) -> NativeStep | None:
    """The binding's NativeStep (made on first use and kept on it), or None where csrc/step.c does
    not cover this step (module doc) or GPT2KIT_NATIVE_STEP=0."""
    if not enabled():
        return None
    step = getattr(bound, "_native_step", False)
    if step is not False and (step is None or step.current()):
        return step
    try:
        step = NativeStep(model, bound, f32_kernel)
    except _Unsupported:
        step = None
    bound._native_step = step
    return step
