"""benchmarks/edit_corpus.py: its edit documents are bench_decoding.py's code-edit prompt followed by
the function correctly renamed, and the modules the benchmark edits are never read."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus():
    return _load("edit_corpus")  # it imports bench_decoding's edit format


MODULE = '''
def area(width, height):
    """A docstring the documents leave out."""

    result = width * height
    # width times height
    return result if width else 0


class Box:
    def grow(self, amount):
        self.size += amount
        return amount * amount


def one(x): return x
'''


def test_the_documents_are_the_benchmarks_edit_format(corpus, tmp_path):
    (tmp_path / "shapes.py").write_text(MODULE)
    docs = list(corpus.documents([tmp_path / "shapes.py"], plain=0.0, renames=9, min_uses=3,
                                 max_tokens=10_000, seed=0, encode=lambda s: s.split()))
    edits = {(d["prompt"].split("`")[1], d["prompt"].split("`")[3]): d for d in docs}
    assert {old for old, _ in edits} == {"width", "height", "amount"}  # >= 3 uses (not result, self, x)
    (old, new), d = next((k, v) for k, v in edits.items() if k[0] == "width")
    want_prompt = ("def area(width, height):\n    result = width * height\n    # width times height\n"
                   "    return result if width else 0\n\n\n"
                   f"# The same function with `width` renamed to `{new}`:\ndef area({new}, height):\n")
    assert d["prompt"] == want_prompt
    assert d["completion"] == (f"    result = {new} * height\n    # {new} times height\n"
                               f"    return result if {new} else 0")
    grow = next(v for k, v in edits.items() if k[0] == "amount")
    assert grow["prompt"].startswith("def grow(self, amount):\n    self.size += amount\n")  # dedented
    plain = list(corpus.documents([tmp_path / "shapes.py"], plain=1.0, renames=1, min_uses=3,
                                  max_tokens=10_000, seed=0, encode=lambda s: s.split()))
    assert [d["prompt"] for d in plain] == ["", "", ""]
    assert plain[0]["completion"].startswith("def area(width, height):\n    result")


def test_held_out_modules_are_never_read(corpus, tmp_path):
    for rel in ("textwrap.py", "pkg/__init__.py", "pkg/sub.py", "other.py", "test/test_x.py", "idlelib/a.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    files = corpus.stdlib_files(tmp_path, {"textwrap", "pkg"})
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["other.py"]


def test_quick_writes_prompt_completion_jsonl(tmp_path):
    out = tmp_path / "edit.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / "edit_corpus.py"), str(out), "--quick"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    edits = [d for d in docs if d["prompt"]]
    assert edits and len(edits) < len(docs)
    assert all("\n# The same function with `" in d["prompt"] and d["completion"].strip() for d in edits)
    assert "held out: colorsys, fnmatch, getpass, textwrap" in r.stdout


def test_scramble_renames_every_local_consistently(corpus, tmp_path):
    names = "\n".join(f"def f{i}(alpha{i}, beta{i}):\n    return alpha{i} + beta{i}\n" for i in range(30))
    (tmp_path / "shapes.py").write_text(MODULE + names)  # a pool of names to draw from
    docs = list(corpus.documents([tmp_path / "shapes.py"], plain=0.0, renames=1, min_uses=3,
                                 max_tokens=10_000, seed=0, encode=lambda s: s.split(), scramble=1.0))
    area = next(d for d in docs if d["prompt"].startswith("def area("))
    source = area["prompt"].split("\n\n\n")[0]
    tree = ast.parse(source).body[0]  # still a function
    width, height = (a.arg for a in tree.args.args)
    assert {width, height} <= {f"alpha{i}" for i in range(30)} | {f"beta{i}" for i in range(30)}
    result = tree.body[0].targets[0].id
    assert result.startswith(("alpha", "beta")) and len({width, height, result}) == 3
    assert source == (f"def area({width}, {height}):\n    {result} = {width} * {height}\n"
                      f"    # {width} times {height}\n    return {result} if {width} else 0")  # consistently
    grow = next(d for d in docs if d["prompt"].startswith("def grow("))
    assert grow["prompt"].startswith("def grow(self, ")  # self is kept


def test_random_copies_are_their_own_prompt(corpus, tmp_path):
    (tmp_path / "shapes.py").write_text(MODULE)
    docs = list(corpus.documents([tmp_path / "shapes.py"], plain=0.0, renames=1, min_uses=3,
                                 max_tokens=10_000, seed=0, encode=lambda s: s.split(), random_copies=5))
    copies = docs[-5:]
    for d in copies:
        head, sep, tail = d["prompt"].partition("\n\n# The same lines again:\n")
        assert sep and not tail and head == d["completion"] and head.endswith("\n")
    assert len({d["completion"] for d in copies}) == 5
