"""Products with int8 weights and int8 activations ("W8A8", the opt-in mode of gpt2kit.quant.modules): what
CTranslate2's int8 and ONNX Runtime's dynamic quantization compute, by the kernel that is fastest here.

The arithmetic (one definition, which every kernel computes to the bit on CPU; tests/test_int8act.py):

  per row r of x (R, in):  a = max |x[r, :]|,  sx[r] = a / 127,  q[r, :] = round(x[r, :] * (127 / a))
                           (round half to even, in [-127, 127]; a row with a below float32's smallest
                           normal number is all zeros, sx = 0; a row holding inf or NaN gives NaN)
  acc = q @ W^T            int8 x int8 summed in int32, exactly (in_features <= MAX_IN_FEATURES)
  y = (float(acc) * sx[:, None]) * s[None, :] (+ b)     float32, in this order

The weights are the weight-only scheme's codes and scales (gpt2kit.quant.modules), unchanged: the mode is a
way of running an int8 model, not another checkpoint. Activations of other dtypes are taken as
float32 and the result given back in their dtype. Symmetric per-row (per-token) scales, as CTranslate2
uses: each row's rounding depends on that row alone, so batching never changes a row's result (ONNX
Runtime's DynamicQuantizeLinear uses one asymmetric scale per tensor, and fbgemm's
quantized.linear_dynamic too, which is why neither is a candidate here).

The kernels:

  w8a8-vnni      gpt2kit's C kernel (csrc/int8act_linear.c) with AVX-512 VNNI (vpdpbusd), where the CPU
                 has avx512f, avx512bw and avx512_vnni: the row quantization fused into the one call
  w8a8-avx2      the same C kernel with AVX2 only (int16 activations, vpmaddwd): the fallback on AVX2 CPUs
  w8a8-int-mm    the rows quantized by torch ops, then torch._int_mm (PyTorch's int8 x int8 -> int32
                 GEMM; oneDNN/MKL on CPU, exact), rescaled by torch ops: the library product; on CUDA,
                 where _int_mm needs more than 16 rows and in/out features multiples of 8, fewer rows
                 are padded with zeros and other shapes raise (not yet run on a GPU)
  w8a8-emulated  the codes multiplied in float64 (every int32 sum is exact there): slow, any device; the
                 fallback for a shape another kernel refuses

Which one runs is decided per (device type, rows bucket) as decode/int8.py decides the weight-only kernel:
the choice stored for this machine (decode/kernel_choice.py), else the CPU family's default unless
interleaved rounds of timings say clearly otherwise (candidates checked against a float32 reference
first: a wrong kernel is never chosen), unless GPT2KIT_INT8ACT_KERNEL names one. The defaults: the C
kernel for the CPU's instruction set up to 128 rows (decode steps and small batches, where a fused
call saves the ~9 torch ops of the library path's quantization and rescaling per product), the
library's GEMM for prompts (129 rows and more, where a cache-blocked GEMM wins).

Legend: R rows (batch x tokens), in/out the matrix's features.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch

import gpt2kit.decode.int8 as int8
import gpt2kit.decode.kernel_choice as kernel_choice
import gpt2kit.decode.native as native

KERNELS = ("w8a8-vnni", "w8a8-avx2", "w8a8-int-mm", "w8a8-emulated")
ENV = "GPT2KIT_INT8ACT_KERNEL"
MAX_IN_FEATURES = 1 << 17  # in * 127 * 128 < 2^31: the int32 sums cannot overflow
_FLT_MIN = torch.finfo(torch.float32).tiny
_ISA = {"w8a8-vnni": "avx512-vnni", "w8a8-avx2": "avx2"}
_CHOSEN = kernel_choice.REGISTRY.chosen  # ("int8act", (device type, rows bucket)) -> kernel
_UNAVAILABLE: dict[str, str] = {}


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (R, in) float32 -> (q (R, in) int8, sx (R,) float32): the rows' int8 codes and scales, as
    the module's docstring defines them (x2 ≈ q * sx[:, None])."""
    a = x2.abs().amax(dim=1) if x2.shape[1] else x2.new_zeros(x2.shape[0])  # (R,); NaN where a row has one
    finite = torch.isfinite(a)
    ok = finite & (a >= _FLT_MIN)
    # a tensor divided, not `127.0 / a`: torch computes a number over a tensor as reciprocal(a) * 127,
    # two roundings that differ from the C kernels' one division for a quarter of the rows' a
    inv = torch.where(ok, torch.full_like(a, 127.0) / a, torch.zeros_like(a))
    q = torch.where(ok[:, None], torch.round(x2 * inv[:, None]).clamp_(-127, 127), 0.0).to(torch.int8)
    sx = torch.where(ok, a / 127, torch.where(finite, 0.0, float("nan")))
    return q, sx


def rescale(acc: torch.Tensor, sx: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """acc (R, out) int32 sums -> y (R, out) float32: (float(acc) * sx) * scale (+ bias)."""
    y = acc.float() * sx[:, None] * scale.float()
    return y if bias is None else y + bias.float()


def _int_mm(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """q (R, in) int8 @ weight (out, in)^T -> (R, out) int32 by torch._int_mm."""
    if q.is_cuda:  # _int_mm's CUDA contract: more than 16 rows, in and out multiples of 8
        if q.shape[1] % 8 or weight.shape[0] % 8:
            raise NotImplementedError(f"torch._int_mm on CUDA needs in/out features multiples of 8, got "
                                      f"{tuple(weight.shape)}")
        if q.shape[0] <= 16:
            return torch._int_mm(torch.cat([q, q.new_zeros(17 - q.shape[0], q.shape[1])]), weight.t())[:q.shape[0]]
    return torch._int_mm(q, weight.t())


def _int_mm_native(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """w8a8-int-mm on the CPU with the rows quantized and the sums rescaled by csrc/int8act_linear.c (the
    same bits as quantize_rows and rescale, without their dozen passes over the rows)."""
    quantize, rescale_c = native.int8act_rows()
    R, K = x2.shape
    N = weight.shape[0]
    threads = torch.get_num_threads()
    q, sx = torch.empty(R, K, dtype=torch.int8), torch.empty(R)
    quantize(x2.data_ptr(), R, K, q.data_ptr(), sx.data_ptr(), threads)
    acc = _int_mm(q, weight).contiguous()  # (R, N) int32
    b = bias.float().contiguous() if bias is not None else None
    y = torch.empty(R, N)
    rescale_c(acc.data_ptr(), R, N, sx.data_ptr(), scale.data_ptr(), None if b is None else b.data_ptr(),
              y.data_ptr(), threads)
    return y


def run_kernel(kernel: str, x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (R, in) float, weight (out, in) int8, scale (out,) [, bias (out,)] -> (R, out) in x2's dtype,
    by `kernel`; NotImplementedError or RuntimeError where it cannot run these tensors here."""
    if weight.shape[1] > MAX_IN_FEATURES:
        raise ValueError(f"int8 activations take in_features up to {MAX_IN_FEATURES} (int32 sums), "
                         f"got {weight.shape[1]}")
    dtype = x2.dtype
    xf = x2.float()
    if kernel in _ISA:
        if not xf.is_cpu or xf.dim() != 2:
            raise NotImplementedError(f"{kernel} takes 2-D CPU activations, not {x2.device.type}")
        plain = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.is_cpu)
        y = native.run_int8act_linear(xf.contiguous(), weight.contiguous(),
                                      int8._scale_as(scale, torch.float32).contiguous(), bias if plain else None,
                                      _ISA[kernel])
        y = y if plain else y + bias.float()
    elif kernel == "w8a8-int-mm" and xf.is_cpu and native.int8act_rows() is not None:
        y = _int_mm_native(xf.contiguous(), weight, int8._scale_as(scale, torch.float32).contiguous(), bias)
    elif kernel in ("w8a8-int-mm", "w8a8-emulated"):
        q, sx = quantize_rows(xf)
        acc = (_int_mm(q, weight) if kernel == "w8a8-int-mm"
               else (q.double() @ weight.double().t()).to(torch.int32))  # (R, out)
        y = rescale(acc, sx, int8._scale_as(scale, torch.float32), bias)
    else:
        raise ValueError(f"unknown int8-activation kernel {kernel!r}; valid choices: {', '.join(KERNELS)}")
    return y if dtype == torch.float32 else y.to(dtype)


def int8act_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) with int8 activations @ (weight (out, in) int8 * scale (out,))^T + bias -> (..., out),
    in x's dtype, by the kernel chosen for this device and rows bucket."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (R, in)
    kernel = choose(x2.device, x2.shape[0])
    try:
        y = run_kernel(kernel, x2, weight, scale, bias)
    except (NotImplementedError, RuntimeError) as e:
        if kernel == "w8a8-emulated" or isinstance(e, torch.OutOfMemoryError):
            raise
        where = f"{x2.device.type} {kernel} {tuple(weight.shape)}"
        if where not in _UNAVAILABLE:
            _UNAVAILABLE[where] = int8._first_line(e)
            warnings.warn(f"int8-activation kernel {kernel} failed on {where} ({int8._first_line(e)}); "
                          "using w8a8-emulated there", RuntimeWarning, stacklevel=2)
        y = run_kernel("w8a8-emulated", x2, weight, scale, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


# --- the choice ----------------------------------------------------------------------------------

# The family's default per rows bucket, in order of preference (the first that runs here and passes
# the measurement's check): the C kernel for the CPU's instruction set while the rows are few enough
# that a fused call matters, the library's GEMM for prompts.
_FEW = ("w8a8-vnni", "w8a8-avx2", "w8a8-int-mm", "w8a8-emulated")
_GEMM = ("w8a8-int-mm", "w8a8-vnni", "w8a8-avx2", "w8a8-emulated")
DEFAULTS = {"1": _FEW, "few": _FEW, "many": _FEW, "prefill": _GEMM, "long": _GEMM}


def _why_not(kernel: str, device: torch.device) -> str | None:
    if kernel in _ISA:
        if device.type != "cpu":
            return f"gpt2kit's native kernel runs on CPU, not {device.type}"
        return native.why_int8act_unavailable(_ISA[kernel])
    if kernel == "w8a8-int-mm" and not hasattr(torch, "_int_mm"):
        return f"this torch ({torch.__version__}) has no _int_mm"
    return None


def check_kernel(name: str, device: torch.device | str = "cpu", given_as: str | None = None) -> str:
    """`name` if it is an int8-activation kernel that can run on `device` here; ValueError naming it
    (as `given_as`, default GPT2KIT_INT8ACT_KERNEL=) and the choices otherwise."""
    return kernel_choice.check_named(name, KERNELS, _why_not, device, f"{given_as or ENV + '='}{name!r}",
                                     "an int8-activation kernel")


def _default(bucket: str, measured: Mapping[str, object]) -> str:
    prefs = DEFAULTS[bucket] if kernel_choice.family() != "other" else ("w8a8-int-mm", "w8a8-emulated")
    return next((k for k in prefs if k in measured), next(iter(measured)))


def choose(device: torch.device, rows: int) -> str:
    """The kernel for int8-activation products of `rows` rows on `device`: GPT2KIT_INT8ACT_KERNEL when
    set (checked), else `decide_for`'s choice, made once per process and rows bucket."""
    forced = os.environ.get(ENV)
    if forced:
        return check_kernel(forced, device)
    kernel = _CHOSEN.get(("int8act", (device.type, int8._bucket(rows))))
    return kernel if kernel is not None else decide_for(device, rows).kernel


def _candidates(device: torch.device) -> dict:
    return {k: (lambda x, w, s, k=k: run_kernel(k, x, w, s)) for k in KERNELS
            if k != "w8a8-emulated" and not _why_not(k, device)}


def decide_for(device: torch.device | str, rows: int, *, fresh: bool = False) -> kernel_choice.Choice:
    """How int8-activation products of `rows` rows run here, and why: the stored choice for this
    machine and bucket (checked against the float32 reference first), else interleaved rounds of
    int8.sample over the candidates that can run here, decided by kernel_choice against DEFAULTS
    (and, for a few rows, the float32 product); a measured choice is stored. `fresh`: measure even
    where a choice is stored."""
    device = torch.device(device)
    bucket = int8._bucket(rows)
    name = f"int8act {device.type} {bucket} threads={torch.get_num_threads()}"

    def still_right(kernel: str) -> bool:
        return kernel in KERNELS and not _why_not(kernel, device) and _still_right(kernel, device)

    def measure() -> kernel_choice.Choice:
        cands = _candidates(device)
        if not cands:
            return kernel_choice.Choice("w8a8-emulated", "default", "no other kernel runs here")

        def take():
            got = int8.sample(device, torch.float32, int8._BUCKET_ROWS[bucket], candidates=cands,
                              float32=bucket in int8._BOUNDED)
            for k in [k for k in cands if k not in got]:  # left out by the measurement's checks
                _UNAVAILABLE[f"{device.type} {k}"] = "failed the measurement's check (int8.unavailable())"
            return got
        return kernel_choice.measured(take, "w8a8-emulated", lambda m: _default(bucket, m), "float32")

    return kernel_choice.REGISTRY.settle("int8act", (device.type, bucket), name, still_right, measure, fresh=fresh)


@torch.inference_mode()
def _still_right(kernel: str, device: torch.device) -> bool:
    """Whether a stored kernel still computes the product here (a library rebuilt wrong is never kept)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (192, 768), dtype=torch.int8, generator=g).to(device)
    s = (torch.rand(192, generator=g) / 127).to(device)
    x = torch.randn(8, 768, generator=g).to(device)
    try:
        wrong = int8.disagreement(run_kernel(kernel, x, w, s), run_kernel("w8a8-emulated", x, w, s))
    except (NotImplementedError, RuntimeError) as e:
        wrong = int8._first_line(e)
    if wrong is not None:
        _UNAVAILABLE[f"{device.type} {kernel}"] = f"wrong result: {wrong}"
    return wrong is None


def chosen() -> dict[str, str]:
    """The kernels chosen so far in this process, e.g. {'cpu 1': 'w8a8-vnni'} (for bench)."""
    return {f"{d} {b}": c.kernel for (d, b), c in kernel_choice.REGISTRY.decisions("int8act").items()}


def decisions() -> dict[str, kernel_choice.Choice]:
    """How each of chosen()'s kernels was chosen (source default / stored / measured, the medians)."""
    return {f"{d} {b}": c for (d, b), c in kernel_choice.REGISTRY.decisions("int8act").items()}


def unavailable() -> dict[str, str]:
    """Kernels that failed in this process, by where they were tried, with the error's first line."""
    return dict(_UNAVAILABLE)


def forget() -> None:
    """Forget this process's choices and failures: the next product decides again."""
    kernel_choice.REGISTRY.forget("int8act")
    _UNAVAILABLE.clear()
