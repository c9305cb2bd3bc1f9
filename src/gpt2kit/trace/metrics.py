"""What a patching experiment measures, and the (clean, corrupt) pairs it measures it on.

A metric reads the logits at the last position: `logit-diff:A,B` (logit of A minus logit of B),
`logit:TOKEN`, `prob:TOKEN` (its probability) or `loss` (−log p of the answer). Tokens are texts that must be
one GPT-2 token each (a leading space is part of the token); pairs come from a JSONL file of
{"clean", "corrupt", "answer", "wrong"} lines, all of one token length. Legend: B batch, V vocab.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

METRICS = ("logit-diff", "logit", "prob", "loss")


@dataclass(frozen=True)
class Metric:
    kind: str  # logit-diff | logit | prob | loss
    answer: int
    wrong: int | None = None  # logit-diff only

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) last-position logits -> (B,) in float64 (differentiable)."""
        x = logits.double()
        if self.kind == "logit-diff":
            return x[:, self.answer] - x[:, self.wrong]
        if self.kind == "logit":
            return x[:, self.answer]
        logp = torch.log_softmax(x, dim=-1)[:, self.answer]
        return logp.exp() if self.kind == "prob" else -logp

    def describe(self, text) -> str:
        """In words, with text(id) naming a token."""
        a = json.dumps(text(self.answer), ensure_ascii=False)
        if self.kind == "logit-diff":
            return f"logit difference {a} − {json.dumps(text(self.wrong), ensure_ascii=False)} at the last position"
        return {"logit": f"logit of {a}", "prob": f"p({a})", "loss": f"loss −log p({a})"}[self.kind] + \
            " at the last position"


def one_token(tokenizer, text: str, what: str) -> int:
    """The id of a text that is exactly one token; ValueError saying how it tokenizes otherwise."""
    if tokenizer is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{what} {text!r}: without a tokenizer, give a token id") from None
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        pieces = ", ".join(json.dumps(tokenizer.decode([i]), ensure_ascii=False) for i in ids)
        hint = "" if text.startswith(" ") else " (most words inside a sentence begin with a space, e.g. ' Paris')"
        raise ValueError(f"{what} {text!r} is {len(ids)} tokens, not one: {ids} = {pieces}{hint}")
    return ids[0]


@dataclass(frozen=True)
class MetricSpec:
    """A parsed --metric: its kind and the tokens it names (None: each pair's answer/wrong)."""

    kind: str
    tokens: tuple[str, ...] | None = None


def parse_metric(spec: str | None) -> MetricSpec | None:
    """`logit-diff[:A,B]`, `logit[:TOKEN]`, `prob[:TOKEN]`, `loss[:TOKEN]`; the text after ':' is
    split at ',' verbatim (leading spaces are part of the tokens)."""
    if spec is None:
        return None
    kind, sep, rest = spec.partition(":")
    if kind not in METRICS:
        raise ValueError(f"unknown metric {kind!r}; choose from logit-diff:A,B, logit:TOKEN, prob:TOKEN, loss")
    tokens = tuple(rest.split(",")) if sep else None
    want = 2 if kind == "logit-diff" else 1
    if tokens is not None and len(tokens) != want:
        raise ValueError(f"metric {spec!r}: {kind} names {want} token{'s' if want > 1 else ''}, got {len(tokens)}")
    return MetricSpec(kind, tokens)


def make_metric(spec: MetricSpec, tokenizer, answer: str | int | None = None, wrong: str | int | None = None,
                where: str = "") -> Metric:
    """The metric for one pair: the spec's tokens, else the pair's answer (and wrong)."""
    def tok(t, what):
        return t if isinstance(t, int) else one_token(tokenizer, t, where + what)

    names = spec.tokens or ((answer, wrong) if spec.kind == "logit-diff" else (answer,))
    if any(n is None for n in names):
        need = "answer and wrong" if spec.kind == "logit-diff" else "answer"
        raise ValueError(f"{where}metric {spec.kind} needs the {need} tokens (in --metric or in each pair)")
    a = tok(names[0], "answer")
    w = tok(names[1], "wrong") if spec.kind == "logit-diff" else None
    if w == a:
        raise ValueError(f"{where}the answer and wrong tokens are the same ({a}): their logit difference is always 0")
    return Metric(spec.kind, a, w)


def newline_hint(text: str, other: str, encode, names: tuple[str, str] = ("the text", "the comparison"),
                 cause: str = " (--file and --compare-file keep a file's final newline; the shell's $(...) drops it)"
                 ) -> str:
    """'' or, for two texts of different token lengths where one ends with a newline and the other does
    not, a clause saying so (and whether that is the whole difference)."""
    a, b = text.endswith("\n"), other.endswith("\n")
    if a == b:
        return ""
    has, lacks = names if a else names[::-1]
    whole = len(encode(text.rstrip("\n"))) == len(encode(other.rstrip("\n")))
    return f"; {'the difference is' if whole else 'one difference is'} a trailing newline: {has} ends with one, " \
           f"{lacks} does not{cause}"


@dataclass(frozen=True)
class Pair:
    clean: list[int]
    corrupt: list[int]
    answer: str | int | None
    wrong: str | int | None
    line: int


def read_pairs(path, tokenizer, prepend_eot: bool = False) -> list[Pair]:
    """The JSONL file's pairs; every clean and corrupt text of one token length (the first line's)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the pairs file ({e.strerror or e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not JSON ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path}: no pairs in the file")
    return pairs_from_rows(rows, tokenizer, prepend_eot, f"{path} line ")


def pairs_from_rows(rows, tokenizer, prepend_eot: bool = False, where: str = "pair ") -> list[Pair]:
    """(line number, {"clean", "corrupt", "answer", "wrong"}) rows -> pairs of one token length."""
    pairs: list[Pair] = []
    for n, row in rows:
        if not (isinstance(row, dict) and isinstance(row.get("clean"), str) and isinstance(row.get("corrupt"), str)):
            raise ValueError(f'{where}{n}: each pair is {{"clean": TEXT, "corrupt": TEXT, "answer", "wrong"}}')
        if tokenizer is None:
            raise ValueError("pairs of texts need a tokenizer")
        pre = [tokenizer.eot_token] if prepend_eot else []
        clean, corrupt = pre + tokenizer.encode(row["clean"]), pre + tokenizer.encode(row["corrupt"])
        if len(clean) != len(corrupt):
            hint = newline_hint(row["clean"], row["corrupt"], tokenizer.encode, ("clean", "corrupt"), "")
            raise ValueError(f"{where}{n}: clean has {len(clean)} tokens, corrupt {len(corrupt)}; "
                             f"a patched pair needs one token length{hint}")
        if pairs and len(clean) != len(pairs[0].clean):
            raise ValueError(f"{where}{n}: {len(clean)} tokens, {where}{pairs[0].line} has {len(pairs[0].clean)}; "
                             "every pair needs one token length (the grid's columns are positions)")
        pairs.append(Pair(clean, corrupt, row.get("answer"), row.get("wrong"), n))
    if not pairs:
        raise ValueError("no pairs given")
    return pairs
