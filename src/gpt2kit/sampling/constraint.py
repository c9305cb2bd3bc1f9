"""Structured outputs: a constraint on what a row may generate (a JSON schema, any JSON object, a
regular expression, one of fixed choices, or a grammar), checked when the settings are made.

The constraint is compiled by llguidance (the `structured` extra), which turns each kind into one
grammar and, per step, the set of tokens that keep the output inside it (gpt2kit.sampling.structured
applies that set). This module is torch-free; it imports llguidance only to check a constraint.

- json_schema: spec is the schema as JSON text. Whitespace is compact (no runs of spaces or
  newlines between tokens), and keywords llguidance does not implement are refused, not ignored.
- json_object: any JSON object (OpenAI's response_format {"type": "json_object"}); spec is "".
- regex: spec is a regular expression (Rust's regex syntax) the whole output matches.
- choice: spec is a tuple of strings; the output is exactly one of them.
- grammar: spec is a Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's, with
  `root ::= ...`), converted to Lark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpt2kit.validate import SettingError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
INSTALL_HINT = "structured outputs need llguidance: pip install 'gpt2kit[structured]'"
# Compact JSON: a random or weak model given flexible whitespace can spend its whole budget on it.
JSON_OPTIONS = {"whitespace_flexible": False}


def require_llguidance():
    """The llguidance module, or ImportError with the install hint."""
    try:
        import llguidance
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a row's output must be (the module doc): kind in KINDS and its spec. Invalid specs raise
    ValueError (SettingError naming `structured`) with the compiler's message."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SettingError(f"structured kind must be one of {', '.join(KINDS)}, got {self.kind!r}", "structured")
        if self.kind == "choice":
            if isinstance(self.spec, str) or not self.spec:
                raise SettingError(f"a choice constraint needs a non-empty list of strings, got {self.spec!r}",
                                   "structured")
            for c in self.spec:
                if not isinstance(c, str) or not c:
                    raise SettingError(f"each choice must be non-empty text, got {c!r}", "structured")
            object.__setattr__(self, "spec", tuple(self.spec))
        elif not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise SettingError(f"a {self.kind} constraint needs its text, got {self.spec!r}", "structured")
        error = require_llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise SettingError(f"invalid {self.kind} constraint: {error.strip()}", "structured")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        """A JSON-schema constraint from a dict or its JSON text (ValueError if it is not JSON)."""
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise SettingError(f"the JSON schema is not JSON: {e}", "structured") from None
            return cls("json_schema", schema)
        if not isinstance(schema, dict):
            raise SettingError(f"a JSON schema must be an object, got {type(schema).__name__}", "structured")
        return cls("json_schema", json.dumps(schema))

    def grammar(self) -> str:
        """The constraint as one llguidance grammar (what LLMatcher compiles)."""
        m = require_llguidance().LLMatcher
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise SettingError(f"the JSON schema is not JSON: {e}", "structured") from None
            if not isinstance(schema, dict):
                raise SettingError(f"a JSON schema must be an object, got {self.spec!r}", "structured")
            return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return m.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.spec)
            return m.grammar_from_lark(f"start: {alternatives}\n")
        return m.grammar_from_lark(_lark(self.spec))


def _lark(text: str) -> str:
    """A grammar's Lark text: GBNF (rules written `name ::= ...`) is converted."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as e:
        raise SettingError(f"invalid grammar constraint: {e}", "structured") from None
