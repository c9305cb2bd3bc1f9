"""A corpus that teaches copying with a rename, in bench_decoding.py's code-edit format, from this
Python's own standard library: the training data of the model its prompt-lookup row measures.

    python benchmarks/edit_corpus.py OUT.jsonl [--plain 0.1] [--renames 2] [--max-tokens 480] [--seed 0]
                                     [--scramble 0] [--random-copies 0] [--quick]
    gpt2kit prepare OUT.jsonl --out DATA_DIR --val-fraction 0.01
    gpt2kit train --data DATA_DIR ...   (docs/benchmarks.md, "prompt lookup on a model trained to edit",
                                         has the exact commands)

Every function and method of every stdlib module (tests, idlelib, lib2to3, turtledemo and
site-packages left out), its docstring removed and its body dedented (bench_decoding's
function_source), with a name that occurs at least --min-uses times as a whole word (a parameter
or a local; not self, cls or the function's own name) renamed to another identifier of the
library that the function does not use. Each becomes one prompt/completion line of a JSONL file:
the prompt is bench_decoding's edit_prompt (the function, "# The same function with `OLD` renamed
to `NEW`:", the renamed def line), the completion the rest of the renamed function, so `gpt2kit
prepare` masks the loss to the copy. A --plain fraction of the functions are written instead as
plain code (an empty prompt, the function as the completion: loss on every token). Documents
longer than --max-tokens GPT-2 tokens are skipped, so a whole edit fits a 512-token window.

--scramble P: a share P of the edited functions first get every parameter and local (self and cls
kept) renamed, consistently, to random identifiers of the library, so the prompt's names cannot be
guessed from the language and the copy is the only way to predict them. --random-copies N adds N
documents of pure copying: a prompt of 20-120 random library identifiers and punctuation in
code-like lines, "# The same lines again:", and the same lines as the completion (copying is the
only way down: the loss that teaches induction first; docs/benchmarks.md has the runs).

The modules bench_decoding's lookup row edits (its EDITS, plus --holdout) are never read, so the
benchmark's edits are of functions the model has not seen.

--quick: only the first few modules (checks the script runs).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import keyword
import random
import re
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as bench_lm_eval.py imports bench_serve
from bench_decoding import EDITS, edit_prompt, function_source, rename

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__",
             "ensurepip", "pydoc_data", "unittest"}  # unittest: mostly test machinery, few plain functions
KEEP = {"self", "cls"} | set(dir(builtins)) | set(keyword.kwlist)


def stdlib_files(root: Path, holdout: set[str]) -> list[Path]:
    """The library's .py files, sorted, without the skipped directories and the held-out modules
    (a module `a.b` is held out as a/b.py and a/b/ alike)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        dotted = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if any(dotted == h or dotted.startswith(h + ".") for h in holdout):
            continue
        out.append(p)
    return out


def functions(src: str) -> list[tuple[str, ast.FunctionDef]]:
    """(source without docstring, node) of every function and method in a module's source."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    lines = src.splitlines()
    return [(function_source(lines, n), n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def candidates(source: str, node: ast.FunctionDef, min_uses: int) -> list[str]:
    """The function's parameters and locals that occur at least min_uses times as whole words."""
    names = {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names -= KEEP | {node.name}
    return sorted(n for n in names if len(re.findall(rf"\b{re.escape(n)}\b", source)) >= min_uses)


def scrambled(source: str, node: ast.FunctionDef, pool: list[str], rng: random.Random) -> tuple[str, ast.FunctionDef]:
    """source with every parameter and local renamed, consistently, to a random identifier of `pool`
    that the function does not use, and the node of the renamed source."""
    text = source
    for old in candidates(source, node, 1):
        used = set(re.findall(r"\w+", text))
        new = next((n for n in (rng.choice(pool) for _ in range(100)) if n not in used), None)
        if new is None:  # a pool this function nearly exhausts (a tiny library): leave the name
            continue
        text = rename(text, old, new)
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a name reused as an attribute or keyword argument can clash; keep the original
        return source, node
    return text, next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))


PUNCT = ["(", ")", ", ", ".", " = ", ":", "[", "]", " + ", " == ", "()", " "]


def random_copy(pool: list[str], rng: random.Random) -> dict:
    """A pure copying document: lines of random identifiers and punctuation, then the same lines."""
    lines, n = [], rng.randint(8, 40)
    while n > 0:
        k = rng.randint(2, 6)
        words = [rng.choice(pool) + (rng.choice(PUNCT) if rng.random() < 0.6 else " ") for _ in range(k)]
        lines.append(" " * rng.choice((0, 4, 8)) + "".join(words).rstrip())
        n -= k
    body = "\n".join(lines) + "\n"
    return {"prompt": f"{body}\n\n# The same lines again:\n", "completion": body}


def documents(files: list[Path], plain: float, renames: int, min_uses: int, max_tokens: int, seed: int, encode,
              scramble: float = 0.0, random_copies: int = 0):
    """Yield JSONL records: per function, `renames` edits (prompt + completion) of different names
    where it has them, or, for a `plain` share of the functions, the function as plain code; a
    `scramble` share of the edited functions with every local renamed first; then `random_copies`
    pure copying documents (random_copy)."""
    rng = random.Random(seed)
    found = [(f, s, n) for f in files for s, n in functions(f.read_text(encoding="utf-8", errors="replace"))]
    pool = sorted({c for _, s, n in found for c in candidates(s, n, 1) if len(c) > 1})
    yield from _edits(found, pool, rng, plain, renames, min_uses, max_tokens, encode, scramble)
    for _ in range(random_copies):
        yield random_copy(pool, rng)


def _edits(found, pool, rng, plain, renames, min_uses, max_tokens, encode, scramble):
    for _, source, node in found:
        if rng.random() < plain:
            if len(encode(source)) <= max_tokens:
                yield {"prompt": "", "completion": source + "\n"}
            continue
        if scramble and rng.random() < scramble:
            source, node = scrambled(source, node, pool, rng)
        olds = candidates(source, node, min_uses)
        if not olds or "\n" not in source.strip():  # a one-line def has nothing to copy after its def line
            continue
        for old in rng.sample(olds, min(renames, len(olds))):
            new = rng.choice(pool)
            while re.search(rf"\b{re.escape(new)}\b", source):
                new = rng.choice(pool)
            prompt, completion = edit_prompt(source, old, new)
            if len(encode(prompt + completion)) > max_tokens:
                break
            yield {"prompt": prompt, "completion": completion}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the JSONL file to write (gpt2kit prepare's prompt/completion input)")
    ap.add_argument("--plain", type=float, default=0.1, help="share of functions written as plain code (default 0.1)")
    ap.add_argument("--renames", type=int, default=2, help="edits per function, of different names (default 2)")
    ap.add_argument("--min-uses", type=int, default=3, help="a renamed name occurs at least this often (default 3)")
    ap.add_argument("--max-tokens", type=int, default=480, help="longest document in GPT-2 tokens (default 480)")
    ap.add_argument("--holdout", default="", help="comma list of further modules never read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scramble", type=float, default=0.0,
                    help="share of edited functions whose locals are all renamed at random first (default 0)")
    ap.add_argument("--random-copies", type=int, default=0, help="pure copying documents to add (default 0)")
    ap.add_argument("--quick", action="store_true", help="only the first 20 modules")
    args = ap.parse_args()
    from gpt2kit.checkpoint import load_tokenizer

    enc = load_tokenizer()
    holdout = {e.split(":")[0] for e in EDITS} | {h for h in args.holdout.split(",") if h}
    files = stdlib_files(Path(sysconfig.get_path("stdlib")), holdout)[:20 if args.quick else None]
    n = edits = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for doc in documents(files, args.plain, args.renames, args.min_uses, args.max_tokens, args.seed, enc.encode,
                             args.scramble, args.random_copies):
            f.write(json.dumps(doc) + "\n")
            n, edits = n + 1, edits + bool(doc["prompt"])
    print(f"{args.out}: {n} documents ({edits} edits, {n - edits} plain) from {len(files)} modules; "
          f"held out: {', '.join(sorted(holdout))}")


if __name__ == "__main__":
    main()
