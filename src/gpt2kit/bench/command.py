"""`gpt2kit bench`'s options (the one definition) and what the command runs: light to import (no
torch), so the CLI can build its parser without loading the benchmark."""

from __future__ import annotations

import argparse
import importlib.util
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options: the one definition, for `gpt2kit bench`."""
    p.add_argument("--quick", action="store_true",
                   help="a short run (T=128 prefill, 16 new tokens, 2-3 trials each, no peak memory): "
                        "a first look, not figures to quote")
    p.add_argument("--size", default="gpt2", metavar="PRESET",
                   help="the model's size, a preset (gpt2 default; gpt2-tiny for a short check of the command; "
                        "gpt2-mini, gpt2-medium, ...); random weights; peak memory is measured for gpt2 only")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="before each trial, wait up to S seconds for other processes to leave the CPU")
    p.add_argument("--quantize", default=None, metavar="SCHEME",
                   help="add a gpt2kit column with int8 weights (weight-only, LM head included)")
    p.add_argument("--kernels", action="store_true",
                   help="print which kernel each product bucket runs here, from where (default / stored / "
                        "measured / forced) and the measured medians, then exit (no transformers needed)")
    p.add_argument("--remeasure", action="store_true", help="with --kernels: measure anew, whatever is stored")
    p.add_argument("--int8-activations", action="store_true",
                   help="with --quantize int8: run the int8 column with int8 activations too (speed only: random "
                        "weights, no quality gate); with --kernels: also show the int8-activation kernels' choice")
    p.add_argument("--int8-kernel", default=None, metavar="KERNEL",
                   help="run int8 products with this kernel (as GPT2KIT_INT8_KERNEL): native-avx2, i8pack-bf16, "
                        "i8pack, dequant")
    p.add_argument("--_memory-worker", nargs=6, default=None, help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {args.threads}")
    if getattr(args, "int8_kernel", None) is not None:
        from gpt2kit.decode.int8 import ENV, check_kernel

        os.environ[ENV] = check_kernel(args.int8_kernel, getattr(args, "device", "cpu"), "--int8-kernel ")
    if getattr(args, "int8_activations", False):
        if not (getattr(args, "kernels", False) or getattr(args, "quantize", None)):
            raise ValueError("--int8-activations runs an int8 model: add --quantize int8 (or --kernels)")
        if os.environ.get("GPT2KIT_INT8ACT_KERNEL"):
            from gpt2kit.decode.int8act import ENV, check_kernel

            check_kernel(os.environ[ENV], getattr(args, "device", "cpu"))
    if os.environ.get("GPT2KIT_F32_KERNEL"):
        from gpt2kit.decode import f32

        f32.forced()  # an unknown or unavailable float32 kernel: one line naming the choices
    if getattr(args, "kernels", False):
        return _print_kernels(args)
    if not getattr(args, "_memory_worker", None):
        require_transformers()
    from gpt2kit.bench.runner import measure_from_args

    return measure_from_args(args)


def _print_kernels(args: argparse.Namespace) -> int:
    import torch

    from gpt2kit.bench.kernels import format_kernels, kernel_choices

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(format_kernels(kernel_choices(remeasure=args.remeasure,
                                        int8_activations=getattr(args, "int8_activations", False))))
    return 0


def require_transformers() -> None:
    """ImportError naming the extra that installs transformers, the peer every run measures against."""
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("gpt2kit bench compares with transformers, which is not installed: "
                          "pip install 'gpt2kit[bench]'")

