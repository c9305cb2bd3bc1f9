"""`gpt2kit bench --kernels`: which kernel each product bucket runs on this machine, and why.

For every rows bucket of the int8 products (float32 activations; with int8_activations, also the
int8-activation products of gpt2kit.decode.int8act), the bfloat16 few-row products and the float32
single-row and 2-8-row products of a GPT-2 124M-shaped model (gpt2kit.decode.f32, on random matrices in the
decode layout) and the float32 prompt products (gpt2kit.decode.dnn),
the choice gpt2kit.decode makes at first use is made here and printed with where it came from
(default: the CPU family's known-good kernel, kept where the measurement was disturbed or not clearly
better; stored: measured earlier on this machine; measured: now; forced: GPT2KIT_INT8_KERNEL or
--int8-kernel, GPT2KIT_F32_KERNEL, GPT2KIT_PROMPT_KERNEL) and the medians behind it. `--remeasure` measures
anew (and stores what a quiet measurement decides).
"""

from __future__ import annotations

import os

import torch

from gpt2kit.decode import dnn, f32, int8, int8act, kernel_choice, plain
from gpt2kit.machine import describe_cpu

ROWS = {"1": 1, "few": 8, "many": 64, "prefill": 256, "long": 1024}


def kernel_choices(remeasure: bool = False, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
                   int8_activations: bool = False) -> list[dict]:
    """One row per bucket: {"what", "bucket", "kernel", "source", "why", "medians_ms"}."""
    rows = []
    if int8_activations:
        forced_a8 = os.environ.get(int8act.ENV)
        for bucket, n in ROWS.items():
            if forced_a8:
                c = kernel_choice.Choice(int8act.choose(torch.device("cpu"), n), "forced", f"{int8act.ENV} is set")
            else:
                c = int8act.decide_for(torch.device("cpu"), n, fresh=remeasure)
            rows.append({"what": "int8 weights, int8 activations", "bucket": bucket, **c.as_json()})
    forced = os.environ.get(int8.ENV)
    for dtype in dtypes:
        for bucket, n in ROWS.items():
            if forced:
                c = kernel_choice.Choice(int8.choose(torch.device("cpu"), dtype, n), "forced", f"{int8.ENV} is set")
            else:
                c = int8.decide_for(torch.device("cpu"), dtype, n, fresh=remeasure)
            rows.append({"what": f"int8, {str(dtype).removeprefix('torch.')} activations", "bucket": bucket,
                         **c.as_json()})
    w = torch.randn(3072, 768).to(torch.bfloat16)  # c_fc's size, row-major as bfloat16 models keep it
    plain.choose_half_kernels(w, remeasure=remeasure)
    for name, c in plain.half_decisions().items():
        dtype, bucket = name.split("/")
        rows.append({"what": f"{dtype} few-row products", "bucket": bucket, **c.as_json()})
    mats = _f32_mats()
    c = f32.decide_for(F32_SHAPE, mats, fresh=remeasure)
    rows.append({"what": f"float32 products, GPT-2 124M ({F32_SHAPE})", "bucket": "1 row", **c.as_json()})
    if dnn.available():
        def pack(w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)  # as decode.packed copies it

        c = f32.decide_few(F32_SHAPE, mats, pack, fresh=remeasure)
        rows.append({"what": f"float32 products, GPT-2 124M ({F32_SHAPE})", "bucket": f"2-{f32.MAX_ROWS} rows",
                     **c.as_json()})
    w, b = mats[2]  # c_fc (3072, 768)
    c = dnn.choose(w, b, fresh=remeasure)
    rows.append({"what": "float32 prompt products (c_fc + GELU)", "bucket": f"{dnn.PROBE_ROWS} rows", **c.as_json()})
    return rows


F32_SHAPE = "768x12x50257"  # n_embd x n_layer x vocabulary, as decode.step names a model's shape


def _f32_mats() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """A GPT-2 124M step's float32 matrices in order, stored (in, out) as decode/layout.py keeps them."""
    def mat(n_in: int, n_out: int, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.randn(n_in, n_out).t(), (torch.randn(n_out) if bias else None)  # (out, in) view

    block = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]
    return [mat(i, o) for _ in range(12) for i, o in block] + [mat(768, 50257, bias=False)]


def format_kernels(rows: list[dict]) -> str:
    lines = [f"machine: {describe_cpu()}; family {kernel_choice.family()}; {torch.get_num_threads()} threads; "
             f"torch {torch.__version__}; stored in {kernel_choice.store_dir() / kernel_choice.STORE_NAME}", "",
             "| products | rows bucket | kernel | from | why | medians, ms per product |", "|---|---|---|---|---|---|"]
    note = kernel_choice.unmeasured()
    if note:
        lines[1:1] = [note]
    for r in rows:
        med = ", ".join(f"{k} {v:.4g}" for k, v in sorted(r["medians_ms"].items(), key=lambda kv: kv[1]))
        lines.append(f"| {r['what']} | {r['bucket']} | {r['kernel']} | {r['source']} | {r['why']} | {med or '-'} |")
    return "\n".join(lines)
