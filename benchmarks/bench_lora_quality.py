"""LoRA against full fine-tuning at equal steps: held-out loss, forgetting, adapter size.

Continues a base model (a gpt2kit/HF directory) on a corpus it never saw, once with every parameter
trained and once with LoRA adapters on the block matrices, each at a few learning rates, all with
the same data, seed, steps, batch and schedule (AdamW, linear warmup then cosine to lr/10, float32).
Two optional methods: LoRA with peft's bias "all" (every bias trains beside the adapters,
--lora-bias-lrs) and full fine-tuning with the embeddings frozen (--freeze 'wte.*,wpe.*',
--frozen-emb-lrs: every block parameter and ln_f train, the control for what the embedding holds).

    data      `gpt2kit prepare` (the library call) over the corpus files: directories are searched
              for --glob, minus any path with a part in --exclude-parts (tests) and minus the files
              the base was trained on (--exclude-inputs: the base's prepare.json "inputs"); the
              held-out split is prepare's --val-fraction of the files (a random sample of whole
              files, recorded by name in the JSON), so no held-out file is in the train split
    held-out  the mean loss over the first --eval-batches batches of that split, at step 0 (the
              base) and after the last step
    forgetting the same measure on the base's own validation shards (--base-val), when given
    size      the adapter directory's adapter_model.safetensors against the base's model.safetensors

    python benchmarks/bench_lora_quality.py --base models/stdlib-tiny --base-val data/stdlib \\
        --exclude-inputs data/stdlib/prepare.json --work runs/lora-quality \\
        --corpus /usr/lib/python3.11/{asyncio,email,json,...} --steps 300
    python benchmarks/bench_lora_quality.py --quick --work /tmp/lq   # a tiny random model, seconds

Prints a Markdown table (one row per method and rate, the best rate of each marked) and the gap
between the best LoRA and the best full fine-tuning; --json (default WORK/results.json) keeps it all.
A run whose result is already in WORK/runs/NAME/result.json is not trained again (nor the base
measured again: WORK/step0.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from gpt2kit.checkpoint import load_model, save_model
from gpt2kit.config import GPT2Config
from gpt2kit.data import prepare
from gpt2kit.data.documents import collect_files, iter_tasks, ordered_tasks
from gpt2kit.data.loaders import ShardLoader
from gpt2kit.data.shard import find_shards, shard_token_count
from gpt2kit.machine import describe_cpu
from gpt2kit.model import GPT2
from gpt2kit.train.config import TrainConfig
from gpt2kit.train.finetune import prepare as prepare_model
from gpt2kit.train.loop import train
from gpt2kit.train.loss import TrainingLoss

EXCLUDE_PARTS = "test,tests,idle_test,__pycache__,site-packages"
FROZEN_EMBEDDINGS = "wte.*,wpe.*"
# method -> (run-name prefix, is LoRA, TrainConfig settings beyond the shared ones)
METHODS = {"full": ("full", False, {}), "lora": ("lora", True, {}),
           "lora, bias all": ("lora-biasall", True, {"lora_bias": "all"}),
           "full, embeddings frozen": ("full-frozenemb", False, {"freeze": FROZEN_EMBEDDINGS}),
           # + the embedding rows of the --lora-tokens ids the train split uses most (peft's trainable tokens)
           "lora + tokens": ("lora-tokens", True, {})}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def corpus_files(corpus: list[str], glob: str, exclude_parts: set[str], exclude: set[str]) -> list[Path]:
    """The corpus's files in path order: directories searched for `glob` (leaving out any file with a
    part of its path below the directory in exclude_parts or starting with 'test_'), files taken as
    named; none whose absolute path is in exclude."""
    found: set[Path] = set()
    for item in corpus:
        p = Path(os.path.abspath(item))
        if p.is_file():
            found.add(p)
            continue
        for f in p.rglob(glob):  # the parts below the directory given, not the directory's own path
            parts = f.relative_to(p).parts
            if f.is_file() and not any(part in exclude_parts or part.startswith("test_") for part in parts):
                found.add(f)
    return sorted((f for f in found if str(f) not in exclude), key=str)


def val_files(files: list[Path], n_val: int, shuffle_seed: int) -> list[str]:
    """The files prepare put in the validation split: the first n_val of its shuffled document order
    (text files only: one document each)."""
    listed, once = collect_files(files, "*", exclude=Path("/nonexistent"))
    assert len(list(iter_tasks(listed, once))) == len(listed), "one document per file expected"
    return sorted(task[0] for task in list(ordered_tasks(listed, once, shuffle_seed))[:n_val])


@torch.no_grad()
def held_out_loss(model: GPT2, data: str, batches: int, batch_size: int, seq_len: int) -> tuple[float, int]:
    """Mean loss over the first `batches` sequential batches of data's val split (fewer if it is
    shorter) and the number of batches used."""
    tokens = sum(shard_token_count(f) for f in find_shards(data, "val"))
    n = min(batches, max(1, (tokens - 1) // (batch_size * seq_len)))
    loader = ShardLoader(data, "val", batch_size=batch_size, seq_len=seq_len)
    loss = TrainingLoss(model.eval())
    return sum(loss(*loader.next_batch()).item() for _ in range(n)) / n, n


def _evaluate(model: GPT2, args: argparse.Namespace) -> dict[str, float]:
    out = {"held_out": held_out_loss(model, str(args.work / "data"), args.eval_batches, args.batch_size,
                                     args.seq_len)[0]}
    if args.base_val:
        out["base_val"] = held_out_loss(model, args.base_val, args.eval_batches, args.batch_size, args.seq_len)[0]
    return out


def run_one(method: str, lr: float, args: argparse.Namespace) -> dict:
    prefix, lora, extra = METHODS[method]
    if method == "lora + tokens":
        prefix, extra = f"{prefix}{args.lora_tokens}", {"lora_tokens": args.lora_tokens}
    name = f"{prefix}-lr{lr:g}"
    out = args.work / "runs" / name
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = TrainConfig(data=str(args.work / "data"), out=str(out), model=str(args.base), batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=lr, max_steps=args.steps, warmup_steps=args.warmup,
                      optimizer="adamw", schedule="cosine", eval_every=0, eval_steps=1, save_every=0,
                      log_every=args.log_every, seed=args.seed, device="cpu",
                      lora_rank=args.lora_rank if lora else None, lora_alpha=args.lora_alpha if lora else None,
                      lora_targets=args.lora_targets, **extra)
    probe = load_model(args.base)  # what the run trains, counted on a fresh copy
    prepare_model(probe, cfg)
    trained = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    result = train(cfg)
    model = load_model(args.base, adapter=out) if lora else load_model(out)
    weights = out / ("adapter_model.safetensors" if lora else "model.safetensors")
    config = out / "adapter_config.json"
    record = {"name": name, "method": method, "lr": lr, "steps": result.step, "trained_parameters": trained,
              "train_seconds": result.seconds, "output_bytes": weights.stat().st_size,
              "config_bytes": config.stat().st_size if lora else 0, **_evaluate(model, args)}
    done.write_text(json.dumps(record, indent=1) + "\n")
    return record


def _quick_setup(work: Path) -> tuple[Path, list[str]]:
    """A random gpt2-tiny base (n_ctx 64) and a small random text corpus, for the --quick check."""
    torch.manual_seed(0)
    base = save_model(GPT2(GPT2Config.from_name("gpt2-tiny", n_ctx=64)), work / "base")
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":"]
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        idx = torch.randint(len(words), (400,), generator=g).tolist()
        (corpus / f"mod{i}.py").write_text(" ".join(words[j] for j in idx) + "\n")
    return base, [str(corpus)]


def _table(base: dict, rows: list[dict], model_bytes: int, has_base_val: bool) -> str:
    best = {m: min((r for r in rows if r["method"] == m), key=lambda r: r["held_out"], default=None)
            for m in METHODS}
    head = "| method | lr | trained parameters | held-out, step 0 -> end | base val after | output bytes (vs model) |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (best)" if r is best[r["method"]] else ""
        fv = f"{r['base_val']:.3f} (base {base['base_val']:.3f})" if has_base_val else "-"
        n = f"{r['trained_parameters']:,}" if "trained_parameters" in r else "-"
        lines.append(f"| {r['method']}{mark} | {r['lr']:g} | {n} | {base['held_out']:.3f} -> **{r['held_out']:.3f}** | "
                     f"{fv} | {r['output_bytes']:,} ({100 * r['output_bytes'] / model_bytes:.2f}%) |")
    gaps = [(label, best[m]["held_out"] - best["full"]["held_out"])
            for m, label in (("lora", "LoRA"), ("lora, bias all", "LoRA + bias all"),
                             ("lora + tokens", "LoRA + tokens"))
            if best["full"] and best[m]]
    if gaps:
        lines.append("")
    lines += [f"best {label} - best full = {gap:+.4f} nats (target <= +0.05: {'met' if gap <= 0.05 else 'missed'})"
              for label, gap in gaps]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="the base model directory")
    ap.add_argument("--corpus", nargs="*", default=[], help="files and directories to fine-tune on")
    ap.add_argument("--work", type=Path, required=True, help="data, runs and results go here")
    ap.add_argument("--base-val", help="shard directory whose val split the base was validated on (forgetting)")
    ap.add_argument("--exclude-inputs", help="a prepare.json whose 'inputs' files are left out of the corpus")
    ap.add_argument("--exclude-parts", default=EXCLUDE_PARTS, help="comma list of path parts left out")
    ap.add_argument("--glob", default="*.py")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="files held out (prepare's split)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--full-lrs", type=_floats, default=_floats("3e-4,1e-3,3e-3"))
    ap.add_argument("--lora-lrs", type=_floats, default=_floats("2e-3,4e-3,1e-2,2e-2"))
    ap.add_argument("--lora-bias-lrs", type=_floats, default=[], help="LoRA with bias 'all' at these rates")
    ap.add_argument("--frozen-emb-lrs", type=_floats, default=[],
                    help=f"full fine-tuning with --freeze '{FROZEN_EMBEDDINGS}' at these rates")
    ap.add_argument("--lora-tokens-lrs", type=_floats, default=[],
                    help="LoRA plus the embedding rows of the --lora-tokens most used ids, at these rates")
    ap.add_argument("--lora-tokens", type=int, default=500, help="rows for --lora-tokens-lrs (default 500)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-targets", default="c_attn,attn.c_proj,c_fc,mlp.c_proj")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="default WORK/results.json")
    ap.add_argument("--quick", action="store_true", help="a tiny random base and corpus, 3 steps, one rate each")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch_size, args.seq_len, args.eval_batches = 3, 1, 2, 32, 2
        args.full_lrs, args.lora_lrs, args.val_fraction, args.log_every = [3e-3], [1e-2], 0.25, 1
    elif not args.base or not args.corpus:
        ap.error("--base and --corpus are required (or --quick)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.base, args.corpus = _quick_setup(args.work)
    exclude = set(json.loads(Path(args.exclude_inputs).read_text())["inputs"]) if args.exclude_inputs else set()
    files = corpus_files(args.corpus, args.glob, set(args.exclude_parts.split(",")), exclude)
    data = args.work / "data"
    if not (data / "prepare.json").exists():
        prepare([str(f) for f in files], data, val_fraction=args.val_fraction, glob=args.glob, workers=1,
                progress=False)
    summary = json.loads((data / "prepare.json").read_text())
    held = val_files(files, summary["val_documents"], summary["shuffle_seed"])
    print(f"corpus: {len(files)} files; train {summary['documents'] - summary['val_documents']} files, "
          f"{summary['train_tokens']:,} tokens; held out {len(held)} files, {summary['val_tokens']:,} tokens",
          flush=True)
    step0 = args.work / "step0.json"  # the base's measures, kept like a run's (one invocation per rate)
    cached = json.loads(step0.read_text()) if step0.exists() else {}
    key = {"base": str(args.base), "base_val": args.base_val, "eval_batches": args.eval_batches}
    if cached.get("key") == key:
        base = cached["measures"]
    else:
        base = _evaluate(load_model(args.base), args)
        step0.write_text(json.dumps({"key": key, "measures": base}) + "\n")
    print(f"step 0: {base}", flush=True)
    rows = []
    for method, lrs in zip(METHODS, (args.full_lrs, args.lora_lrs, args.lora_bias_lrs, args.frozen_emb_lrs,
                                     args.lora_tokens_lrs), strict=True):
        for lr in lrs:
            rows.append(run_one(method, lr, args))
            print(f"{rows[-1]['name']}: {rows[-1]}", flush=True)
    model_bytes = (Path(args.base) / "model.safetensors").stat().st_size
    table = _table(base, rows, model_bytes, bool(args.base_val))
    machine = f"{describe_cpu()}, torch {torch.__version__}, {args.threads} thread(s)"
    tokens = args.steps * args.batch_size * args.seq_len
    print(f"\n{machine}; {args.steps} steps x {args.batch_size} x {args.seq_len} = {tokens:,} tokens per run; "
          f"held-out = {args.eval_batches} batches\n{table}")
    record = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
              "files": [str(f) for f in files], "held_out_files": held,
              "prepare": {k: v for k, v in summary.items() if k != "inputs"}, "step0": base, "runs": rows,
              "model_bytes": model_bytes, "table": table}
    (args.json or args.work / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
