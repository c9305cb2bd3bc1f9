"""The `gpt2kit` command: parse, call one library function, map errors to one line and an exit code.

Each subcommand is a `cmd_<name>(args) -> int` function registered in `build_parser`. Errors from
the library (ValueError, OSError, CheckpointError, ...) are printed as one line on stderr with exit
code 1 (2 for usage errors); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from gpt2kit.train_config import TrainConfig


class CLIError(Exception):
    """A user-facing error raised by a subcommand (printed as one line)."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True,
                   help="hub id (gpt2, gpt2-medium, ...), HF directory, or OpenAI TF release directory")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a LoRA adapter directory (peft's format, e.g. gpt2kit train --lora-rank) merged into the "
                        "model's weights at load")
    _add_device_args(p)


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 | auto (the fastest here within bf16 accuracy; default float32)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N | mps (default: cpu)")


_PROG = "gpt2kit"  # "gpt2kit <command>" once parsed: the prefix of every error and warning line


def _warn(message: str) -> None:
    print(f"{_PROG}: warning: {message}", file=sys.stderr)


def _add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default=None, metavar="SCHEME",
                   help="quantize the weights at load time: int8 (weight-only; see docs/quantization.md)")
    p.add_argument("--int8-kernel", default=None, metavar="KERNEL",
                   help="run int8 products with this kernel instead of the measured choice (as GPT2KIT_INT8_KERNEL): "
                        "native-avx2, i8pack-bf16, i8pack, dequant")


def _check_quantize(args: argparse.Namespace) -> None:
    """--quantize's scheme and the int8 kernel asked for (--int8-kernel or GPT2KIT_INT8_KERNEL), before
    anything loads: an unknown or unavailable kernel is one line naming it and the choices."""
    if args.quantize is not None:
        from gpt2kit.quant import check_scheme

        check_scheme(args.quantize)
    flag, env = getattr(args, "int8_kernel", None), os.environ.get("GPT2KIT_INT8_KERNEL")
    if flag or env:
        from gpt2kit.decode.int8 import ENV, check_kernel

        device = args.device if str(getattr(args, "device", None) or "").startswith("cuda") else "cpu"
        os.environ[ENV] = check_kernel(flag or env, device, "--int8-kernel " if flag else None)


def _quantize_loaded(model, args: argparse.Namespace):
    """Apply --quantize to a loaded model (no-op without it); the LM head is quantized too."""
    if getattr(args, "quantize", None) is None:
        return model
    from gpt2kit.quant import quantize_model

    return quantize_model(model, args.quantize)


def _load_for(args: argparse.Namespace):
    """--model's model (--adapter merged; --dtype, --device, --quantize applied) and tokenizer, the
    status line saying so. The line is off while the source is resolved, so a download shows only
    huggingface_hub's own bars."""
    args.status.show(f"loading {args.model}")  # importing torch is part of the wait
    from gpt2kit.checkpoint import load_model, load_tokenizer, resolve_source

    args.status.hide()
    _, path = resolve_source(args.model)
    args.status.show(f"loading {args.model}")
    model = _quantize_loaded(load_model(path, dtype=args.dtype, device=args.device,
                                        adapter=getattr(args, "adapter", None)), args)
    return model, load_tokenizer(path)


def _read_text(path: str | None) -> str:
    """A text file (or stdin for None / "-") as str; bytes that are not UTF-8 become U+FFFD, with a warning."""
    name = "stdin" if path is None or path == "-" else path
    if name == "stdin":
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    else:
        from gpt2kit._io import read_bytes

        data = read_bytes(path)  # its errors name the path; main prints them as one line
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        _warn(f"{name} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
              "invalid bytes were replaced with U+FFFD")
        return data.decode("utf-8", errors="replace")


# --- subcommands ------------------------------------------------------------------------------

def cmd_tokenize(args: argparse.Namespace) -> int:
    from gpt2kit.tokenizer import Tokenizer

    ids = Tokenizer.default().encode(_read_text(args.file), allow_special=args.allow_special)
    if args.count:
        print(len(ids))
    elif args.json:
        print(json.dumps({"tokens": ids}))
    else:
        print(" ".join(map(str, ids)))
    return 0


def _register_tokenize(sub: argparse._SubParsersAction) -> None:
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
        ids = _parse_ids(_read_text(args.file), "stdin" if args.file in (None, "-") else args.file)
    data = Tokenizer.default().decode_bytes(ids)  # ValueError naming an id outside the vocabulary
    if hasattr(sys.stdout, "buffer"):
        sys.stdout.buffer.write(data)  # the exact bytes, so `tokenize | detokenize` gives the file back
    else:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
    return 0


def _register_detokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detokenize", help="print the text of GPT-2 token ids (the inverse of tokenize)",
                       description="Ids as arguments, or from --file / stdin: a JSON list, tokenize --json's "
                                   'output ({"tokens": [...]}), or numbers separated by spaces or commas. The '
                                   "text's exact bytes are written, with no newline added.")
    p.add_argument("ids", nargs="*", help="token ids (default: read them from --file or stdin)")
    p.add_argument("--file", "-f", default=None, help="file of ids ('-' for stdin)")
    p.set_defaults(func=cmd_detokenize)


def cmd_score(args: argparse.Namespace) -> int:
    from gpt2kit.score import score_text

    text = _read_text(args.file)
    _check_quantize(args)  # before the model loads
    model, tok = _load_for(args)
    args.status.show(f"scoring {len(text):,} characters")
    result = score_text(model, tok, text, stride=args.stride)
    args.status.hide()
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"tokens: {len(result.tokens)}  nll: {result.nll:.4f} nats/token  "
              f"perplexity: {result.ppl:.3f}  bits/byte: {result.bits_per_byte:.4f}")
    return 0


def _register_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="how likely a text is under a model (log-probs, NLL, perplexity)")
    p.add_argument("file", nargs="?", help="text file (default: stdin)")
    _add_model_args(p)
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride for long texts (default n_ctx/2)")
    p.add_argument("--json", action="store_true", help='print {"tokens", "logprobs", "nll", "ppl"}')
    _add_quantize_arg(p)
    p.set_defaults(func=cmd_score)


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
    from gpt2kit.quant import parameter_count, quantization

    q = quantization(model)  # an int8 checkpoint is copied as int8 (docs/quantization.md), not dequantized
    what = (f"an {q['scheme']} copy: {parameter_count(model):,} parameters as {q['scheme']} weights with "
            f"{q['scale_dtype']} scales, other tensors {args.dtype or 'float32'}") if q else \
        f"{model.num_parameters():,} parameters, {args.dtype or 'float32'}"
    print(f"wrote {out} ({what})")
    return 0


def _register_convert(sub: argparse._SubParsersAction) -> None:
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


def cmd_merge(args: argparse.Namespace) -> int:
    from gpt2kit.checkpoint import merge_adapter

    out = merge_adapter(args.base, args.adapter, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}: {args.base} with the adapter {args.adapter} merged into its weights")
    return 0


def _register_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model: a plain HF model directory")
    p.add_argument("base", help="the base model: hub id, HF directory or OpenAI TF release directory")
    p.add_argument("adapter", help="the adapter directory (peft's format: adapter_config.json + "
                                   "adapter_model.safetensors)")
    p.add_argument("out", help="output directory (replaced atomically; never the base or the adapter)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT")
    p.set_defaults(func=cmd_merge)


def _register_quantize(sub: argparse._SubParsersAction) -> None:
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
    print(f"dtype:      {info['dtype']}")
    q = info.get("quantization")
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


def _register_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="a checkpoint's config, parameter count, dtype and files")
    p.add_argument("model", help="hub id, HF directory or OpenAI TF release directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)


@contextlib.contextmanager
def _one_line_warnings(command: str) -> Iterator[None]:
    """Warnings as `gpt2kit COMMAND: warning: ...` lines, without Python's file, line and source."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"gpt2kit {command}: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def cmd_prepare(args: argparse.Namespace) -> int:
    from gpt2kit.completions import is_prompt_completion, prepare_completions
    from gpt2kit.data.corpus import prepare

    pairs = [is_prompt_completion(i) for i in args.inputs]
    if any(pairs) and not all(pairs):
        raise CLIError("prompt/completion .jsonl files cannot be mixed with text inputs in one prepare")
    with _one_line_warnings("prepare"):
        if all(pairs):  # {"prompt", "completion"} lines: shards + loss masks (docs/training.md)
            s = prepare_completions(args.inputs, args.out, val_fraction=args.val_fraction,
                                    shard_size=args.shard_size, overwrite=args.overwrite,
                                    shuffle_seed=None if args.no_shuffle else args.shuffle_seed)
        else:
            s = prepare(args.inputs, args.out, val_fraction=args.val_fraction, glob=args.glob,
                        workers=args.workers, shard_size=args.shard_size, progress=sys.stderr.isatty(),
                        overwrite=args.overwrite, shuffle_seed=None if args.no_shuffle else args.shuffle_seed)
    print(f"{s.documents:,} documents: {s.train_tokens:,} train tokens in {len(s.train_shards)} shard(s), "
          f"{s.val_tokens:,} val tokens ({s.val_documents:,} documents) in {len(s.val_shards)} shard(s), "
          f"in {s.out_dir}")
    return 0


def _register_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text / .jsonl into llm.c-format token shards for training")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, directories (searched recursively for --glob) or .jsonl files (a \"text\" field, "
                        "or \"prompt\" + \"completion\": the loss on completions only)")
    p.add_argument("--out", "-o", required=True, help="output directory for train_*.bin / val_*.bin")
    p.add_argument("--val-fraction", type=float, default=0.0005,
                   help="fraction of documents kept for validation (default 0.0005; at least one document)")
    p.add_argument("--glob", default="*.txt", help="file pattern inside directories (default *.txt)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--shard-size", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    p.add_argument("--shuffle-seed", type=int, default=1337,
                   help="seed of the document shuffle before the split, recorded in prepare.json (default 1337)")
    p.add_argument("--no-shuffle", action="store_true",
                   help="keep documents in path order (validation = the first documents)")
    p.set_defaults(func=cmd_prepare)


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from gpt2kit.train import TrainConfig, resume_config, train

    if args.quantize is not None:
        raise CLIError(f"--quantize {args.quantize}: training needs float weights; train, then run "
                       "`gpt2kit quantize` on the result (or pass --quantize to generate/score/bench)")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if not args.resume and args.model and args.out and Path(args.model).expanduser().exists():
        from gpt2kit._io import same_path

        if same_path(args.model, args.out):
            raise CLIError(f"--out {args.out} is the model being fine-tuned; its weights would be overwritten: "
                           "choose another --out")
    if args.resume:
        cfg = resume_config(given.pop("out"), **given)
    elif "data" not in given:
        raise CLIError("--data is required: a directory of shards written by `gpt2kit prepare`")
    else:
        cfg = TrainConfig(**given)
    with _one_line_warnings("train"):
        result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and result.tokens == 0:
        print(f"nothing to do: {result.out} is already at step {result.step}; pass a larger --max-steps "
              f"with --resume to extend the run")
    elif int(os.environ.get("RANK", "0")) == 0:
        val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        loss = f", loss {result.loss:.4f}" if result.loss is not None else ""
        print(f"step {result.step}{loss}{val}: model and checkpoint in {result.out}")
    return 0


_FLAG_TYPES = {"int": int, "float": float, "str": str}


def _add_setting(p: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    """One `train` flag from a TrainConfig field: its name, type, choices and help (with the default).

    Every flag's argparse default is None, so that only the flags given on the line override a
    --resume'd run's settings; the default shown in the help is TrainConfig's."""
    meta = f.metadata
    flags = ["--" + f.name.replace("_", "-"), *([meta["short"]] if "short" in meta else [])]
    kind = str(f.type).split(" | ")[0]
    if f.default is dataclasses.MISSING:
        default = None
    elif "default_text" in meta:
        default = meta["default_text"]
    else:
        default = f.default
    help = meta["help"] + (f" (default: {default})" if default not in (None, False) else "")
    help = help.replace("%", "%%")  # argparse formats help with %
    if kind == "bool":
        p.add_argument(*flags, action="store_true", default=None, help=help)
        return
    # Choices are shown, not enforced here: TrainConfig names a wrong one in the CLI's one-line error.
    metavar = "{" + ",".join(meta["choices"]) + "}" if "choices" in meta else None
    p.add_argument(*flags, type=_FLAG_TYPES[kind], metavar=metavar, default=None, required=f.name == "out",
                   help=help)


def _register_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="pre-train or fine-tune GPT-2 on token shards (torchrun -m gpt2kit train for many GPUs)",
        description="Train from a preset (from scratch) or fine-tune a checkpoint. Writes the model "
                    "(HF format), checkpoint.pt, metrics.jsonl and loss.png to --out.")
    for f in dataclasses.fields(TrainConfig):
        _add_setting(p, f)
    p.add_argument("--quantize", help=argparse.SUPPRESS)  # accepted only to refuse it in one clear line
    p.set_defaults(func=cmd_train)


def _sampling_settings(args: argparse.Namespace):
    from gpt2kit.config import EOT_ID
    from gpt2kit.sampling import SamplingSettings

    return SamplingSettings(
        max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k, top_p=args.top_p, top_p_mode=args.top_p_mode,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
        stop_token_ids=() if args.ignore_eot else (EOT_ID,), stop_strings=tuple(args.stop or ()),
        num_samples=args.num_samples, strict=args.strict, window=args.window,
        pack_weights=False if args.no_pack_weights else None,
        min_p=args.min_p, typical_p=args.typical_p, epsilon_cutoff=args.epsilon_cutoff, eta_cutoff=args.eta_cutoff,
        no_repeat_ngram_size=args.no_repeat_ngram_size, min_new_tokens=args.min_new_tokens,
        bad_words=tuple(_token_ids("--bad-words-ids", s) for s in args.bad_words_ids or ()),
        suppress_tokens=_token_ids("--suppress-tokens", args.suppress_tokens) if args.suppress_tokens else ())


def _token_ids(flag: str, text: str) -> tuple[int, ...]:
    """Comma-separated token ids ("262,3290") as a tuple."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated token ids such as 262,3290, got {text!r}") from None


def _with_bad_words(settings, tok, args: argparse.Namespace):
    """settings with --bad-words text added as token sequences (gpt2kit.sampling.bad_words_ids)."""
    if not args.bad_words:
        return settings
    from gpt2kit.sampling import bad_words_ids

    return dataclasses.replace(settings, bad_words=settings.bad_words + bad_words_ids(tok, args.bad_words))


def _read_prompts(path: str) -> list[str]:
    """One prompt per non-blank line, or JSONL objects with a "prompt" field (.jsonl or a leading '{')."""
    lines = [(n, line) for n, line in enumerate(_read_text(path).splitlines(), start=1) if line.strip()]
    if not lines:
        raise CLIError(f"{path}: no prompts (the file is empty)")
    if not (path.endswith(".jsonl") or lines[0][1].lstrip().startswith("{")):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"{path}: line {n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CLIError(f'{path}: line {n}: expected a JSON object with a string "prompt" field')
        prompts.append(obj["prompt"])
    return prompts


def _quoted(prompt: str, limit: int = 60) -> str:
    """A prompt for a header line: JSON-quoted (newlines visible), cut to `limit` characters."""
    return json.dumps(prompt if len(prompt) <= limit else prompt[: limit - 1] + "…", ensure_ascii=False)


def _generate_and_print(model, tok, texts: list[str], settings, args: argparse.Namespace) -> None:
    """Run one generation and print its samples in order; the first unfinished one streams live.

    Headers (several samples, or --prompts-file) and --json lines name the prompt each sample
    belongs to; with stdout redirected and stderr a terminal, a bar counts the tokens."""
    from gpt2kit.generate import encode_prompts, generate_stream
    from gpt2kit.progress import is_terminal

    ids = encode_prompts(tok, texts)
    n_rows = len(ids) * settings.num_samples
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    text = [""] * n_rows
    done: dict[int, str] = {}
    head = 0  # the next sample to print; its text goes out as it arrives
    many_prompts = len(ids) > 1 or args.prompts_file is not None

    def header(k: int) -> None:
        if (n_rows > 1 or many_prompts) and not args.json:
            i, j = divmod(k, settings.num_samples)
            label = f"PROMPT {i + 1} SAMPLE {j + 1}: {_quoted(texts[i])}" if many_prompts else f"SAMPLE {k + 1}"
            print(f"{'=' * 40} {label} {'=' * 40}")

    def finish(k: int) -> None:
        if args.json:
            i, j = divmod(k, settings.num_samples)
            print(json.dumps({"prompt_index": i, "sample_index": j, "prompt": texts[i], "prompt_tokens": ids[i],
                              "tokens": tokens[k], "text": text[k], "finish_reason": done[k]}), flush=True)
        else:
            print(flush=True)

    args.status.hide()  # the samples (or the token bar) take the terminal from here
    bar = None if is_terminal(sys.stdout) else args.status.bar(n_rows * settings.max_new_tokens, unit="token",
                                                                  desc="generating")
    try:
        header(0)
        for step in generate_stream(model, ids, settings, tokenizer=tok, batch_size=args.batch_size):
            for k, t in step.tokens.items():
                tokens[k].append(t)
            if bar is not None:
                bar.update(len(step.tokens))
            for k, piece in step.text.items():
                text[k] += piece
                if k == head and piece and not args.json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            done.update(step.finished)
            while head in done:
                finish(head)
                head += 1
                if head < n_rows:
                    header(head)
                    if not args.json and text[head]:
                        sys.stdout.write(text[head])  # buffered while an earlier sample was printing
                        sys.stdout.flush()
    finally:
        if bar is not None:
            bar.close()


def cmd_generate(args: argparse.Namespace) -> int:
    settings = _sampling_settings(args)  # bad values fail before the model loads
    if args.prompt is not None and args.prompts_file is not None:
        raise CLIError("give a PROMPT or --prompts-file, not both")
    if args.interactive and (args.prompt is not None or args.prompts_file is not None):
        raise CLIError("--interactive reads its prompts from stdin; drop PROMPT / --prompts-file")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    _check_quantize(args)  # before the model loads
    if any(not w.strip() for w in args.bad_words or ()):
        raise CLIError("--bad-words must be non-empty text")
    texts = _read_prompts(args.prompts_file) if args.prompts_file is not None else [args.prompt or ""]
    model, tok = _load_for(args)
    settings = _with_bad_words(settings, tok, args)
    if not args.interactive:  # no prompt: unconditional samples from <|endoftext|>
        _generate_and_print(model, tok, texts, settings, args)
        return 0
    while True:  # as openai/gpt-2's interactive_conditional_samples.py, until EOF or Ctrl-C at the prompt
        if sys.stdin.isatty():
            print("Model prompt >>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        try:
            _generate_and_print(model, tok, [line.rstrip("\r\n")], settings, args)
        except KeyboardInterrupt:  # Ctrl-C stops this sample only
            print(flush=True)
            print("(sample stopped; Ctrl-C at the prompt or end of input quits)", file=sys.stderr, flush=True)


class _DefaultsShown(argparse.HelpFormatter):
    """Help lines that name each option's default (argparse's ArgumentDefaultsHelpFormatter also
    tags the flags whose default is None or False, and repeats a default the text already gives)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not unset and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a model (KV-cached, batched, streamed)",
                       formatter_class=_DefaultsShown)
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (default: unconditional samples starting from <|endoftext|>)")
    _add_model_args(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=128, help="tokens to generate per sample")
    p.add_argument("--temperature", "-t", type=float, default=1.0, help="0 (or below 1e-5) = greedy (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1] (1 = off)")
    p.add_argument("--top-p-mode", choices=("openai", "hf"), default="openai",
                   help="openai: keep tokens with cumulative prob <= p (sample.py); hf: also the one crossing p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty (1 = off; >= 0.01)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="min-p sampling: drop tokens less likely than MIN_P x the top token (0 = off)")
    p.add_argument("--typical-p", type=float, default=1.0, help="locally typical sampling's mass in (0, 1] (1 = off)")
    p.add_argument("--epsilon-cutoff", type=float, default=0.0,
                   help="epsilon sampling: drop tokens less likely than this, in [0, 1) (0 = off)")
    p.add_argument("--eta-cutoff", type=float, default=0.0, help="eta sampling's eta in [0, 1) (0 = off)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0,
                   help="never repeat an n-gram of this size, the prompt's included (0 = off)")
    p.add_argument("--bad-words", action="append", metavar="TEXT",
                   help="text never generated, tokenized with and without a leading space (repeatable)")
    p.add_argument("--bad-words-ids", action="append", metavar="IDS",
                   help="a token-id sequence never generated, e.g. 262,3290 (repeatable)")
    p.add_argument("--min-new-tokens", type=int, default=0, help="no stop token before this many new tokens")
    p.add_argument("--suppress-tokens", default=None, metavar="IDS",
                   help="token ids never generated, e.g. 13,198 (default: none)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed (same seed, same text; default: none, a different sample each run)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--batch-size", type=int, default=8, help="rows generated together (default 8)")
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--ignore-eot", action="store_true", help="do not stop at <|endoftext|>")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help='one prompt per line, or JSONL with a "prompt" field')
    p.add_argument("--json", action="store_true",
                   help='one line per sample: {"prompt_index", "sample_index", "prompt", "prompt_tokens", '
                        '"tokens", "text", "finish_reason"} (indexes from 0)')
    p.add_argument("--interactive", "-i", action="store_true",
                   help="read prompts from stdin until EOF; Ctrl-C stops a sample, Ctrl-C at the prompt quits")
    p.add_argument("--strict", action="store_true",
                   help="error if prompt + new tokens exceed the context (default: re-encode a recent window)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens kept when re-encoding past the context (default n_ctx/2)")
    p.add_argument("--no-pack-weights", action="store_true",
                   help="CPU: no prepacked second copy of the weights (slower decode, less memory)")
    _add_quantize_arg(p)
    p.set_defaults(func=cmd_generate)


def cmd_bench(args: argparse.Namespace) -> int:
    from gpt2kit.bench import run_from_args

    return run_from_args(args)


def _register_bench(sub: argparse._SubParsersAction) -> None:
    from gpt2kit.bench import add_arguments

    p = sub.add_parser("bench", help="generation speed vs transformers, side by side (needs transformers)")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_trace(args: argparse.Namespace) -> int:
    from gpt2kit.trace import parse_what, trace

    if args.text is not None and args.file is not None:
        raise CLIError("give a TEXT or --file, not both")
    if not (args.out or args.json or args.npz):
        raise CLIError("nothing to write: give --out report.html, --json FILE and/or --npz FILE")
    if args.top_k < 1:
        raise CLIError(f"--top-k must be >= 1, got {args.top_k}")
    if args.text is None and args.file is None and args.pairs is not None:
        text = None  # the first pair's clean text is traced
    else:
        text = args.text if args.text is not None else _read_text(args.file)
        if not text:
            raise CLIError("the text is empty: nothing to trace")
    parse_what(args.what)  # a bad --what fails before the model loads
    from gpt2kit.trace.metrics import parse_metric
    from gpt2kit.trace.patching import MODES

    metric = parse_metric(args.metric)
    if args.patch not in MODES:
        raise CLIError(f"unknown --patch {args.patch!r}; choose from {', '.join(MODES)}")
    if args.compare is not None and args.pairs is not None:
        raise CLIError("give --compare TEXT or --pairs FILE, not both")
    _check_quantize(args)  # before the model loads
    from gpt2kit.trace.intervene import parse_ablate, parse_replace, parse_steer

    interventions = ([parse_ablate(s) for s in args.ablate] + [parse_steer(s) for s in args.steer]
                     + [parse_replace(s) for s in args.replace])  # a bad form or file fails before loading
    model, tok = _load_for(args)
    args.status.show(f"tracing {len(text):,} characters" if text is not None else f"tracing the pairs in {args.pairs}")
    tr = trace(model, tok, text, top_k=args.top_k, layers=args.layers, what=args.what,
               prepend_eot=args.prepend_eot, patch_from=args.compare, name=str(args.model),
               interventions=interventions, mean_over=args.mean_over, patch_mode=args.patch, metric=metric,
               pairs=args.pairs, attribution=args.attribution, sae=args.sae)
    wrote = []
    args.status.show("writing " + ", ".join(p for p in (args.out, args.json, args.npz) if p))
    if args.out:
        tr.save_html(args.out)
        wrote.append(args.out)
    if args.json:
        from gpt2kit._io import atomic_write

        payload = json.dumps(tr.to_json()).encode("utf-8")
        atomic_write(args.json, lambda f: f.write(payload))
        wrote.append(args.json)
    if args.npz:
        tr.save_npz(args.npz)
        wrote.append(args.npz)
    args.status.hide()
    print(f"traced {len(tr.ids)} tokens, {len(tr.tensors)} tensors; wrote {', '.join(wrote)}")
    return 0


def _register_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record one forward pass exactly and write an offline HTML report")
    p.add_argument("text", nargs="?", default=None, help="the text to trace (or --file)")
    p.add_argument("--file", "-f", default=None, help="read the text from a file ('-' for stdin)")
    _add_model_args(p)
    p.add_argument("--out", "-o", default=None, metavar="HTML", help="write the self-contained HTML report")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report's data at full precision")
    p.add_argument("--npz", default=None, metavar="FILE", help="write every recorded tensor (float32)")
    p.add_argument("--top-k", type=int, default=10, help="next-token predictions shown per position (default 10)")
    p.add_argument("--compare", default=None, metavar="TEXT",
                   help="a corrupted text of the same token length: residual-stream activation patching")
    p.add_argument("--pairs", default=None, metavar="FILE.jsonl",
                   help='patching averaged over (clean, corrupt) pairs: lines {"clean","corrupt","answer","wrong"}')
    p.add_argument("--patch", default="resid", metavar="MODE",
                   help="what --compare/--pairs patch: resid (default), attn, mlp, heads, heads-pos")
    p.add_argument("--metric", default=None, metavar="SPEC",
                   help="the patching metric: logit-diff:A,B | logit:T | prob:T | loss[:T] (A, B, T one token "
                        "each, taken verbatim: ' Paris'); default the clean - corrupted top-1 logit difference")
    p.add_argument("--attribution", action="store_true",
                   help="also estimate every patching cell by attribution patching (gradient x difference)")
    p.add_argument("--layers", default=None, help="blocks to record: all (default), N, N-M, comma list; -1 = last")
    p.add_argument("--what", default=None,
                   help="tensors to record: all (default) or a comma list of attn, mlp, embed, resid, ln, qkv, "
                        "scores, probs, z, attn_out, mlp_pre, mlp_post, mlp_out")
    p.add_argument("--prepend-eot", action="store_true", help="put <|endoftext|> before the text (and --compare)")
    p.add_argument("--sae", default=None, metavar="DIR",
                   help="a sparse autoencoder saved in SAELens's format (cfg.json + sae_weights.safetensors): "
                        "its features at its hook point")
    p.add_argument("--ablate", action="append", default=[], metavar="NAME[@POS][:mean]",
                   help="zero (or mean-) ablate at a trace or TransformerLens name, e.g. h.5.attn.head.3, "
                        "h.7.mlp:mean, resid.2@4 (repeatable; docs/trace.md)")
    p.add_argument("--steer", action="append", default=[], metavar="NAME[@POS]:VEC.npy[*SCALE]",
                   help="add SCALE x the vector at a name, e.g. h.6.resid:happy.npy*4 (repeatable)")
    p.add_argument("--replace", action="append", default=[], metavar="NAME[@POS]:VALUE.npy",
                   help="set the tensor at a name to the array (repeatable)")
    p.add_argument("--mean-over", default=None, metavar="TEXT",
                   help="the text a :mean ablation averages over (default: the traced text)")
    _add_quantize_arg(p)
    p.set_defaults(func=cmd_trace)


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise CLIError(f"gpt2kit serve needs FastAPI, uvicorn and prometheus_client ({module} is missing): "
                           f"pip install 'gpt2kit[serve]'") from None
    from gpt2kit.serve import ServeOptions, serve
    from gpt2kit.serve.auth import resolve_api_key

    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue)):
        if value < (1 if flag == "--max-batch" else 0):
            raise CLIError(f"{flag} must be >= {1 if flag == '--max-batch' else 0}, got {value}")
    if args.max_tokens_per_request is not None and args.max_tokens_per_request < 1:
        raise CLIError(f"--max-tokens-per-request must be >= 1, got {args.max_tokens_per_request}")
    _check_quantize(args)  # before the model loads
    if args.adapter is not None:
        from gpt2kit.checkpoint import read_adapter

        read_adapter(args.adapter)  # a bad adapter fails before the server starts
    template = _read_text(args.chat_template) if args.chat_template is not None else None
    api_key, warnings = resolve_api_key(args.api_key, args.api_key_file)
    for w in warnings:
        print(f"gpt2kit serve: warning: {w}", file=sys.stderr)
    hosts = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    opts = ServeOptions(served_model_name=args.served_model_name or args.model, max_batch=args.max_batch,
                        max_queue=args.max_queue, max_tokens_per_request=args.max_tokens_per_request,
                        api_key=api_key, chat_template=template,
                        pack_weights=False if args.no_pack_weights else None, shutdown_grace=args.shutdown_grace,
                        read_timeout=args.read_timeout, keep_alive_timeout=args.keep_alive_timeout,
                        allowed_hosts=hosts)
    print(f"gpt2kit serve: loading {args.model} as {opts.served_model_name!r} on http://{args.host}:{args.port}"
          f" (/health answers 503 until it is ready)", file=sys.stderr, flush=True)
    serve(args.model, host=args.host, port=args.port, dtype=args.dtype, device=args.device, opts=opts,
          quantize=args.quantize, adapter=args.adapter)
    return 0


def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (needs gpt2kit[serve])")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="rows waiting at most; beyond: 429 (default 64)")
    p.add_argument("--max-tokens-per-request", type=int, default=None, help="cap on max_tokens (default: n_ctx)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (all but /health); visible in the process list: "
                        "prefer --api-key-file or $GPT2KIT_API_KEY")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from PATH (one line; keep it chmod 600)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma list of Host names (name or name:port) accepted besides localhost, 127.0.0.1 and "
                        "[::1]; checked on loopback addresses always, elsewhere only if given; '*': any")
    p.add_argument("--shutdown-grace", type=float, default=20.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: refuse new requests (503) and let in-flight ones finish for up to "
                        "SECONDS, then end them with an error (default 20)")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's headers, then its body, must arrive within SECONDS, else 408 (default 30)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="close a connection idle this long after a response (default 5)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja2 template over `messages`: enables /v1/chat/completions")
    p.add_argument("--no-pack-weights", action="store_true", help="CPU: no prepacked second copy of the weights")
    _add_quantize_arg(p)
    p.set_defaults(func=cmd_serve)


REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_tokenize, _register_detokenize, _register_score, _register_convert, _register_info,
    _register_prepare, _register_train, _register_generate, _register_bench, _register_trace, _register_serve,
    _register_quantize, _register_merge,
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpt2kit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpt2kit", description="GPT-2, complete, exact and fast.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"gpt2kit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    global _PROG
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line, not only before the subcommand.
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.debug = debug
    _PROG = f"gpt2kit {args.command}"
    from gpt2kit.progress import Status

    try:
        with Status(_PROG) as args.status:  # a status line while the command works, on a terminal only
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed stdout shows up here, not at interpreter exit
        return code
    except KeyboardInterrupt:
        print("gpt2kit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`gpt2kit tokenize big.txt | head`): stop quietly
        _detach_stdout()
        return 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)
    except Exception as e:  # the CLI's one place that turns errors into exit codes
        if debug:
            raise
        print(f"{_PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _detach_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot raise about the closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests, notebooks)
        pass


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
