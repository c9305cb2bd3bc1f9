"""The model and token tools: tokenize, detokenize, info, convert, quantize, merge."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpt2kit.cli.common import CLIError, read_text


def cmd_tokenize(args: argparse.Namespace) -> int:
    from gpt2kit.tokenizer import Tokenizer

    ids = Tokenizer.default().encode(read_text(args.file), allow_special=args.allow_special)
    if args.count:
        print(len(ids))
    elif args.json:
        print(json.dumps({"tokens": ids}))
    else:
        print(" ".join(map(str, ids)))
    return 0


def register_tokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="print the GPT-2 token ids of a text")
    p.add_argument("file", nargs="?", help="text file (default: stdin)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help='print {"tokens": [...]}')
    g.add_argument("--count", action="store_true", help="print only the number of tokens")
    p.add_argument("--allow-special", action="store_true", help="treat <|endoftext|> in the text as the special token")
    p.set_defaults(func=cmd_tokenize)


def _parse_ids(text: str, where: str) -> list[int]:
    """Token ids written as a JSON list, tokenize --json's {"tokens": [...]}, or separated by spaces/commas."""
    import re

    s = text.strip()
    if s.startswith(("[", "{")):
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise CLIError(f"{where}: not valid JSON ({e.msg} at character {e.pos})") from None
        if isinstance(obj, dict):
            obj = obj.get("tokens")
        if not isinstance(obj, list):
            raise CLIError(f'{where}: expected a JSON list of token ids or {{"tokens": [...]}}')
        for n, i in enumerate(obj, start=1):
            if isinstance(i, bool) or not isinstance(i, int):
                raise CLIError(f"{where}: item {n} ({json.dumps(i)}) is not an integer token id")
        return obj
    ids = []
    for n, item in enumerate((t for t in re.split(r"[\s,]+", s) if t), start=1):
        if not item.isascii() or not item.lstrip("-").isdigit():
            raise CLIError(f"{where}: item {n} ({item!r}) is not an integer token id")
        ids.append(int(item))
    return ids


def cmd_detokenize(args: argparse.Namespace) -> int:
    from gpt2kit.tokenizer import Tokenizer

    if args.ids and args.file is not None:
        raise CLIError("give ids on the line or --file, not both")
    if args.ids:
        ids = _parse_ids(" ".join(args.ids), "ids")
    else:
        ids = _parse_ids(read_text(args.file), "stdin" if args.file in (None, "-") else args.file)
    data = Tokenizer.default().decode_bytes(ids)  # ValueError naming an id outside the vocabulary
    if hasattr(sys.stdout, "buffer"):
        sys.stdout.buffer.write(data)  # the exact bytes, so `tokenize | detokenize` gives the file back
    else:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
    return 0


def register_detokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detokenize", help="print the text of GPT-2 token ids (the inverse of tokenize)",
                       description="Ids as arguments, or from --file / stdin: a JSON list, tokenize --json's "
                                   'output ({"tokens": [...]}), or numbers separated by spaces or commas. The '
                                   "text's exact bytes are written, with no newline added.")
    p.add_argument("ids", nargs="*", help="token ids (default: read them from --file or stdin)")
    p.add_argument("--file", "-f", default=None, help="file of ids ('-' for stdin)")
    p.set_defaults(func=cmd_detokenize)


def cmd_info(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import describe

    info = describe(args.model)
    if args.json:
        print(json.dumps(info))
        return 0
    cfg = info["config"]
    print(f"source:     {info['source']} ({info['path']})")
    print(f"config:     {cfg['n_layer']} layers, n_embd {cfg['n_embd']}, {cfg['n_head']} heads, "
          f"n_ctx {cfg['n_ctx']}, n_vocab {cfg['n_vocab']}")
    print(f"parameters: {info['parameters']:,}")
    q = info.get("quantization")
    print(f"dtype:      {_dtype_line(info)}")
    stored, full = f"{info['weight_bytes'] / 1e6:,.1f} MB as stored", info["parameters"] * 4
    if q:  # the parameters are the float model's count; the int8 codes and scales are their storage
        stored += f" ({q['scheme']} codes, scales: {info['weight_bytes'] / full:.0%} of float32's {full / 1e6:,.1f} MB)"
    print(f"weights:    {stored}")
    if q:
        print(f"quantized:  {q['scheme']} weight-only, per output channel, {q['scale_dtype']} scales, "
              f"LM head {'quantized' if q['lm_head'] else 'not quantized'}")
    for name, size in info["files"].items():
        print(f"file:       {name} ({size:,} bytes)")
    return 0


def _dtype_line(info: dict) -> str:
    """The dtype the weights are stored in; for an int8 checkpoint, which share is int8, with what scales."""
    q, rest = info.get("quantization"), info["dtype"]
    rest = rest if isinstance(rest, str) else ", ".join(rest)
    if not q:
        return rest
    n = info["parameters_by_dtype"].get(q["scheme"], 0)
    return (f"{q['scheme']} ({n:,} of the {info['parameters']:,} parameters, with {q['scale_dtype']} scales); "
            f"other tensors {rest}")


def register_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="a checkpoint's config, parameter count, dtype and files")
    p.add_argument("model", help="hub id, HF directory or OpenAI TF release directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)


def cmd_convert(args: argparse.Namespace) -> int:
    from gpt2kit._io import same_path
    from gpt2kit.checkpoint import holds_model, load_model, load_tokenizer, resolve_source, save_model

    dst = Path(args.dst).expanduser()
    if dst.exists() and not dst.is_dir():
        raise CLIError(f"{args.dst}: exists and is not a directory")
    if holds_model(dst) and not args.overwrite:
        raise CLIError(f"{args.dst} already holds a model; pass --overwrite to replace it")
    _, src = resolve_source(args.src)
    if same_path(src, dst):
        raise CLIError(f"{args.dst} is the source being converted; write to another directory")
    args.status.show(f"loading {args.src}")
    model = load_model(src, dtype=args.dtype)
    args.status.show(f"writing {args.dst}")
    out = save_model(model, dst, tokenizer=load_tokenizer(src))
    args.status.hide()
    from gpt2kit.quant.modules import parameter_count, quantization

    q = quantization(model)  # an int8 checkpoint is copied as int8 (docs/quantization.md), not dequantized
    what = (f"an {q['scheme']} copy: {parameter_count(model):,} parameters as {q['scheme']} weights with "
            f"{q['scale_dtype']} scales, other tensors {args.dtype or 'float32'}") if q else \
        f"{model.num_parameters():,} parameters, {args.dtype or 'float32'}"
    print(f"wrote {out} ({what})")
    return 0


def register_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write any loadable checkpoint as an HF-format directory")
    p.add_argument("src", help="hub id, HF directory or OpenAI TF release directory")
    p.add_argument("dst", help="output directory (replaced atomically; never the source)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in DST")
    p.set_defaults(func=cmd_convert)


def cmd_quantize(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import quantize_checkpoint

    scheme = "int8" if args.int8 else args.scheme or ""
    r = quantize_checkpoint(args.src, args.dst, scheme, lm_head=args.lm_head, scale_dtype=args.scale_dtype,
                            overwrite=args.overwrite, progress=args.status.show)
    args.status.hide()
    after, before = r["int8_bytes"], r["float_bytes"]
    print(f"wrote {r['path']} ({scheme}, LM head {'quantized' if args.lm_head else 'float32'}, {args.scale_dtype} "
          f"scales): weights {after / 1e6:.1f} MB, {after / before:.0%} of float32's {before / 1e6:.1f} MB")
    return 0


def register_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write an int8 weight-only copy of a checkpoint (docs/quantization.md)")
    p.add_argument("src", help="hub id, HF directory or OpenAI TF release directory (float weights)")
    p.add_argument("dst", help="output directory (replaced atomically; never the source)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in DST")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--int8", action="store_true", help="symmetric per-output-channel int8 weights")
    g.add_argument("--scheme", default=None, help="the scheme by name (int8)")
    p.add_argument("--lm-head", action=argparse.BooleanOptionalAction, default=True,
                   help="also quantize the tied embedding / LM head (default: yes)")
    p.add_argument("--scale-dtype", default="float32", help="float32 (default) or bfloat16 scales")
    p.set_defaults(func=cmd_quantize)


def cmd_merge(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import merge_adapter

    out = merge_adapter(args.base, args.adapter, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}: {args.base} with the adapter {args.adapter} merged into its weights")
    return 0


def register_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model: a plain HF model directory")
    p.add_argument("base", help="the base model: hub id, HF directory or OpenAI TF release directory")
    p.add_argument("adapter", help="the adapter directory (peft's format: adapter_config.json + "
                                   "adapter_model.safetensors)")
    p.add_argument("out", help="output directory (replaced atomically; never the base or the adapter)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT")
    p.set_defaults(func=cmd_merge)
