"""gpt2kit prepare and gpt2kit train: token shards, then a run whose flags are TrainConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from gpt2kit.cli.common import FLAG_TYPES, CLIError, field_kind
from gpt2kit.train.config import TrainConfig


def cmd_prepare(args: argparse.Namespace) -> int:
    from gpt2kit.data.completions import is_prompt_completion, prepare_completions
    from gpt2kit.data.corpus import prepare

    pairs = [is_prompt_completion(i) for i in args.inputs]
    if any(pairs) and not all(pairs):
        raise CLIError("prompt/completion .jsonl files cannot be mixed with text inputs in one prepare")
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


def register_prepare(sub: argparse._SubParsersAction) -> None:
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
    import os

    from gpt2kit.train.loop import resume_config, train

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
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and result.tokens == 0:
        print(f"nothing to do: {result.out} is already at step {result.step}; pass a larger --max-steps "
              f"with --resume to extend the run")
    elif int(os.environ.get("RANK", "0")) == 0:
        val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        loss = f", loss {result.loss:.4f}" if result.loss is not None else ""
        print(f"step {result.step}{loss}{val}: model and checkpoint in {result.out}")
    return 0


def _add_setting(p: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    """One `train` flag from a TrainConfig field: its name, type, choices and help (with the default).

    Every flag's argparse default is None, so that only the flags given on the line override a
    --resume'd run's settings; the default shown in the help is TrainConfig's."""
    meta = f.metadata
    flags = ["--" + f.name.replace("_", "-"), *([meta["short"]] if "short" in meta else [])]
    kind = field_kind(f)
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
    p.add_argument(*flags, type=FLAG_TYPES[kind], metavar=metavar, default=None, required=f.name == "out",
                   help=help)


def register_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="pre-train or fine-tune GPT-2 on token shards (torchrun -m gpt2kit train for many GPUs)",
        description="Train from a preset (from scratch) or fine-tune a checkpoint. Writes the model "
                    "(HF format), checkpoint.pt, metrics.jsonl and loss.png to --out.")
    for f in dataclasses.fields(TrainConfig):
        _add_setting(p, f)
    p.add_argument("--quantize", help=argparse.SUPPRESS)  # accepted only to refuse it in one clear line
    p.set_defaults(func=cmd_train)
