"""Loading for inference, in one place: the model and device flags, --quantize, --int8-kernel and
--int8-activations checked before anything loads, then load_model (an --adapter merged), quantize,
load_tokenizer, the int8-activation quality gate, the status line saying so. generate, score, trace
and serve use it; torch is imported only here, when a command loads."""

from __future__ import annotations

import argparse
import os


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True,
                   help="hub id (gpt2, gpt2-medium, ...), HF directory, or OpenAI TF release directory")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a LoRA adapter directory (peft's format, e.g. gpt2kit train --lora-rank) merged into the "
                        "model's weights at load")
    add_device_args(p)


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 | auto (the fastest here within bf16 accuracy; default float32)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N | mps (default: cpu)")


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default=None, metavar="SCHEME",
                   help="quantize the weights at load time: int8 (weight-only; see docs/quantization.md)")
    p.add_argument("--int8-kernel", default=None, metavar="KERNEL",
                   help="run int8 products with this kernel instead of the measured choice (as GPT2KIT_INT8_KERNEL): "
                        "native-avx2, native-a16, i8pack-bf16, i8pack, dequant")
    p.add_argument("--int8-activations", action="store_true",
                   help="run the int8 model with int8 activations too (per-row scales, int8 x int8 products, as "
                        "CTranslate2 and ONNX Runtime do), if it passes its quality gate on --gate-data "
                        "(docs/quantization.md); without this flag int8 is weight-only")
    p.add_argument("--gate-data", default=None, metavar="PATH",
                   help="held-out text for --int8-activations' quality gate: a text file, a .bin shard, or a "
                        "directory of val_*.bin shards (gpt2kit prepare)")


def check_load_args(args: argparse.Namespace) -> None:
    """--quantize's scheme and the int8 kernel asked for (--int8-kernel or GPT2KIT_INT8_KERNEL) and the
    float32 one (GPT2KIT_F32_KERNEL), before anything loads: an unknown or unavailable kernel is one
    line naming it and the choices."""
    if args.quantize is not None:
        from gpt2kit.quant.modules import check_scheme

        check_scheme(args.quantize)
    flag, env = getattr(args, "int8_kernel", None), os.environ.get("GPT2KIT_INT8_KERNEL")
    if flag or env:
        from gpt2kit.decode.int8 import ENV, check_kernel

        device = args.device if str(getattr(args, "device", None) or "").startswith("cuda") else "cpu"
        os.environ[ENV] = check_kernel(flag or env, device, "--int8-kernel " if flag else None)
    if os.environ.get("GPT2KIT_F32_KERNEL"):
        from gpt2kit.decode import f32

        f32.forced()  # an unknown or unavailable float32 kernel: one line naming the choices
    check_activation_args(args)


def check_activation_args(args: argparse.Namespace) -> None:
    """--int8-activations needs --gate-data, a file or directory (and --gate-data needs it); a kernel forced by
    GPT2KIT_INT8ACT_KERNEL must be one that runs here."""
    on, data = getattr(args, "int8_activations", False), getattr(args, "gate_data", None)
    if on and data is None:
        raise ValueError("--int8-activations needs --gate-data PATH: held-out text to measure its quality gate on "
                         "(a text file, a .bin shard or a directory of val_*.bin shards; docs/quantization.md)")
    if data is not None and not on:
        raise ValueError("--gate-data is the held-out text of --int8-activations' quality gate; add "
                         "--int8-activations, or drop --gate-data")
    if data is not None:
        from gpt2kit._io import check_input

        check_input(data, "--gate-data", directory=True)  # a FIFO or a device is named as such, never read
    if on and os.environ.get("GPT2KIT_INT8ACT_KERNEL"):
        from gpt2kit.decode.int8act import ENV, check_kernel

        check_kernel(os.environ[ENV])


def check_adapter(args: argparse.Namespace) -> None:
    """A bad --adapter fails before a model loads (or a server starts)."""
    if getattr(args, "adapter", None) is not None:
        from gpt2kit.checkpoint import read_adapter

        read_adapter(args.adapter)


def quantize_loaded(model, args: argparse.Namespace):
    """Apply --quantize to a loaded model (no-op without it); the LM head is quantized too."""
    if getattr(args, "quantize", None) is None:
        return model
    from gpt2kit.quant.modules import quantize_model

    return quantize_model(model, args.quantize)


def load_for(args: argparse.Namespace):
    """--model's model (--adapter merged; --dtype, --device, --quantize applied) and tokenizer, the
    status line saying so. The line is off while the source is resolved, so a download shows only
    huggingface_hub's own bars."""
    args.status.show(f"loading {args.model}")  # importing torch is part of the wait
    from gpt2kit.checkpoint import load_model, load_tokenizer, resolve_source

    args.status.hide()
    _, path = resolve_source(args.model)
    args.status.show(f"loading {args.model}")
    model = quantize_loaded(load_model(path, dtype=args.dtype, device=args.device,
                                       adapter=getattr(args, "adapter", None)), args)
    tokenizer = load_tokenizer(path)
    if getattr(args, "int8_activations", False):
        import sys

        from gpt2kit.quant.gate import gate_activations

        args.status.show("measuring the int8-activation quality gate")
        line = gate_activations(model, tokenizer, args.gate_data)
        args.status.hide()
        print(f"gpt2kit: {line}", file=sys.stderr)
    return model, tokenizer
