"""Where a CPU model's weight matrices sit in memory for fast decoding: one explicit, documented call.

Decoding streams every matrix once per step, and on CPU the GEMM kernels for a handful of rows
stream some layouts much faster than others (docs/benchmarks.md): float32 matrices go column-major,
i.e. stored (in, out) as transformers' Conv1D (MKL then runs the products of a few rows faster);
bfloat16/float16 ones row-major (their mat-vec kernels read rows). Values, shapes and names do not
change. load_model applies it to the models it returns (HF and TF checkpoints arrive column-major
already); a model built in Python can be given it with use_decode_layout(model). Generation never
changes a model's layout itself. Training makes its parameters contiguous (row-major) first.

Huge pages: each large matrix (HUGE_MIN_BYTES or more, the float matrices and the int8 weights of a
quantized model; not wpe, of which a step reads one row) is moved into memory of its own that the
kernel is asked to back with 2 MiB pages (an anonymous mmap with madvise(MADV_HUGEPAGE), the Linux
transparent huge pages that PyTorch's allocator does not request). Streaming every weight per token
through 4 KiB pages costs a TLB miss every 4 KiB; measured on a 2-core EPYC, a step's float32
products ran faster on 2 MiB pages (docs/benchmarks.md, "Huge pages"). Each matrix has its own mapping, so a
matrix that is replaced (quantize_model, an adapter merge) frees its memory when it is dropped. Where the
system gives no huge pages (THP "never", not Linux) the move still happens and costs nothing in
speed; GPT2KIT_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref

import torch
from torch import nn

HUGE_MIN_BYTES = 2 << 20  # one 2 MiB page: smaller matrices stay where they are
_HUGE = 2 << 20
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def use_decode_layout(model: nn.Module) -> nn.Module:
    """Store a CPU model's weight matrices in the layout its decode kernels read fastest, in place
    (a no-op where they already are, and for a model on another device), the large ones on huge
    pages where the system has them (use_huge_pages). Returns the model."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or name == "wpe.weight":
                continue
            if p.dtype == torch.float32 and p.stride() != (1, p.shape[0]):
                p.data = p.data.t().contiguous().t()  # (out, in) view of an (in, out) tensor
            elif p.dtype != torch.float32 and not p.is_contiguous():
                p.data = p.data.contiguous()
    return use_huge_pages(model)


def huge_pages_available() -> bool:
    """Whether matrices are moved to huge pages here: Linux with madvise(MADV_HUGEPAGE), THP not
    "never", and GPT2KIT_HUGE_PAGES not 0."""
    if os.environ.get("GPT2KIT_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def use_huge_pages(model: nn.Module) -> nn.Module:
    """Move the CPU model's large weight matrices (2-D parameters and int8 `weight` buffers of
    HUGE_MIN_BYTES or more, wpe excepted) onto memory backed by huge pages, each in its own mapping,
    keeping values, strides, sharing (a tied head stays tied) and names. Matrices already there are
    left. A no-op where huge_pages_available() is False. Returns the model."""
    if not huge_pages_available():
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _large_matrix(name, p):
                p.data = on_huge_pages(p.data)
        for mod_name, mod in model.named_modules():
            for name, b in list(mod._buffers.items()):
                if b is not None and _large_matrix(f"{mod_name}.{name}".lstrip("."), b):
                    mod._buffers[name] = on_huge_pages(b)
    return model


def _large_matrix(name: str, t: torch.Tensor) -> bool:
    return (t.dim() == 2 and t.is_cpu and name != "wpe.weight" and name.endswith("weight")
            and t.numel() * t.element_size() >= HUGE_MIN_BYTES and not is_on_huge_pages(t))


_MAPS: dict[int, int] = {}  # storage data_ptr of each live mapping on_huge_pages made -> its length


def is_on_huge_pages(t: torch.Tensor) -> bool:
    """Whether t's storage is one of the mappings on_huge_pages made."""
    return t.untyped_storage().data_ptr() in _MAPS


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor t in an anonymous mapping of its own, madvise(MADV_HUGEPAGE)'d before
    it is touched (so the kernel can fault it in as 2 MiB pages), with t's strides where t is dense
    in some order (row-major, or the transpose of a row-major matrix), row-major otherwise. The
    mapping lives as long as the tensor (or any view of it)."""
    nbytes = t.numel() * t.element_size()
    size = nbytes + _HUGE  # room to start on a 2 MiB boundary
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping alive
    start = (-raw.data_ptr()) % _HUGE
    try:  # huge pages for the whole 2 MiB pages only: a partly used one would waste its rest
        mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes // _HUGE * _HUGE)
    except (OSError, ValueError):
        pass  # no huge pages for this mapping: ordinary pages, still correct
    flat = raw[start:start + nbytes].view(t.dtype)
    if t.dim() == 2 and t.stride() == (1, t.shape[0]):
        out = flat.view(t.shape[1], t.shape[0]).t()  # the (out, in) view of an (in, out) matrix
    else:
        out = flat.view(t.shape)
    out.copy_(t)
    ptr = raw.untyped_storage().data_ptr()
    _MAPS[ptr] = size
    weakref.finalize(mm, _MAPS.pop, ptr, None)  # forgotten when the last view of the mapping goes
    return out
