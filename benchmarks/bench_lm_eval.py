"""lm-eval through the server, this tree against another: `python benchmarks/bench_lm_eval.py --old TREE`.

What it checks: lm-eval local-completions on a 4-choice task through this tree's server against --old's,
requests/s and log-likelihoods (required: unchanged within 1e-5). lm-evaluation-harness' `local-completions`
model (token ids sent, `echo` + `logprobs` + `max_tokens: 0`: one loglikelihood request per
choice) runs a 4-choice task built offline (--items synthetic items: a context of
--context-words words and four endings of 4-16 words, seeded; or --data, a JSONL of
{"question", "choices", "label"}) against `gpt2kit serve` subprocesses on 127.0.0.1, one per
source tree: this one (new) and --old, a gpt2kit checkout (e.g. `git worktree add /tmp/old
<commit>`), each run with PYTHONPATH=<tree>/src, the same model and flags. Trials alternate old
and new (--trials each, new first); each times lm-eval's loglikelihood call (the requests only,
not the task's loading). Printed: requests/s per trial, the best of each server, the ratio new /
old of the bests, and the largest |log-likelihood difference| between the servers over every
request of every trial (and within each server across its trials).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpt2kit.machine import describe_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import start_server

HERE = Path(__file__).resolve().parents[1]  # this source tree
TASK = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
"""
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be man woman "
         "house city river road water fire light time year day night world hand eye head door room car tree "
         "walks runs opens closes takes gives finds holds turns looks").split()


def _items(n: int, context_words: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [{"question": say(context_words), "choices": [say(rng.randint(4, 16)) for _ in range(4)],
             "label": rng.randrange(4)} for _ in range(n)]


def _start(tree: Path, model_dir: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """A server of the gpt2kit source tree `tree` (its src/ first on the path)."""
    return start_server(model_dir, extra, env={**os.environ, "PYTHONPATH": str(tree / "src")}, cwd=tree,
                        who=f"bench_lm_eval (the server of {tree})")


def _evaluate(url: str, model_dir: str, n_ctx: int, tasks: Path, concurrent: int) -> tuple[float, list[float]]:
    """One lm-eval run: (seconds in loglikelihood, every request's log-likelihood in order)."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions").create_from_arg_string(
        f"model=bench,base_url={url}/v1/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
        f"tokenized_requests=True,num_concurrent={concurrent},max_retries=1,max_length={n_ctx - 1}")
    inner, took = lm.loglikelihood, [0.0]

    def timed(requests, *args, **kwargs):
        t = time.perf_counter()
        out = inner(requests, *args, **kwargs)
        took[0] += time.perf_counter() - t
        return out

    lm.loglikelihood = timed  # simple_evaluate calls the instance's method
    out = lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=TaskManager(include_path=str(tasks)),
                                  log_samples=True, cache_requests=False)
    samples = sorted(out["samples"]["bench_mc"], key=lambda s: s["doc_id"])
    return took[0], [resp[0][0] for s in samples for resp in s["resps"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, type=Path, help="the other gpt2kit source tree (its src/ is used)")
    p.add_argument("--new", type=Path, default=HERE, help=f"this side's source tree (default {HERE})")
    p.add_argument("--preset", default="gpt2", help="model shape (random weights), default gpt2 (124M)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of a random preset")
    p.add_argument("--items", type=int, default=100, help="synthetic 4-choice items (default 100: 400 requests)")
    p.add_argument("--context-words", type=int, default=60, help="words per synthetic context (default 60)")
    p.add_argument("--data", type=Path, default=None, help="a JSONL task (question, choices, label) instead")
    p.add_argument("--trials", type=int, default=3, help="runs of each server, alternating (default 3)")
    p.add_argument("--concurrent", type=int, default=1, help="lm-eval's num_concurrent (default 1, lm-eval's)")
    p.add_argument("--serve-args", default="", help="extra `gpt2kit serve` flags for both servers, one string")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the servers (OMP_NUM_THREADS)")
    args = p.parse_args(argv)
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ[k] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from gpt2kit.checkpoint import save_model
            from gpt2kit.model import GPT2

            model_dir = str(tmp / args.preset)
            save_model(GPT2.from_name(args.preset), model_dir)
        n_ctx = json.loads((Path(model_dir) / "config.json").read_text())["n_ctx"]
        data = args.data
        if data is None:
            data = tmp / "items.jsonl"
            data.write_text("".join(json.dumps(x) + "\n" for x in _items(args.items, args.context_words, 0)))
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / "bench_mc.yaml").write_text(TASK.format(data=data))
        extra = args.serve_args.split()
        trees = {"new": args.new.resolve(), "old": args.old.resolve()}
        servers = {k: _start(tree, model_dir, extra) for k, tree in trees.items()}
        runs: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in servers}
        try:
            for trial in range(args.trials):
                for k, (_, url) in servers.items():
                    s, lls = _evaluate(url, model_dir, n_ctx, tmp / "tasks", args.concurrent)
                    runs[k].append((s, lls))
                    print(f"trial {trial + 1} {k}: {len(lls)} requests in {s:.2f} s, {len(lls) / s:.2f} requests/s",
                          file=sys.stderr)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)

    def commit(tree: Path) -> str:
        r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return (r.stdout.strip() or "?") + (" (modified)" if dirty else "")

    ref = runs["new"][0][1]
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b, strict=True))  # noqa: E731
    across = max(diff(ref, lls) for _, lls in runs["old"])
    within = {k: max(diff(rs[0][1], lls) for _, lls in rs) for k, rs in runs.items()}
    n = len(ref)
    best = {k: max(n / s for s, _ in rs) for k, rs in runs.items()}
    print(f"# bench_lm_eval: {args.model or args.preset + ' (random weights)'}, lm-eval local-completions, "
          f"4-choice task of {n // 4} items ({n} loglikelihood requests), num_concurrent {args.concurrent}, "
          f"{args.trials} trials each, serve flags: {args.serve_args or '(none)'}")
    print(f"# CPU: {describe_cpu()}; torch threads: {args.threads or 'default'}; "
          f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print("| server | tree (commit) | requests/s per trial | best | max abs LL diff across its trials |")
    print("|---|---|---|---|---|")
    for k, rs in runs.items():
        print(f"| {k} | {trees[k]} ({commit(trees[k])}) | {', '.join(f'{n / s:.2f}' for s, _ in rs)} | "
              f"{best[k]:.2f} | {within[k]:.2e} |")
    print(f"\nmax |log-likelihood difference| new vs old: {across:.2e} (target <= 1e-5)")
    print(f"new / old, requests/s (best trials): {best['new'] / best['old']:.2f}x (target >= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
