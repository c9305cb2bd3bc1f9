"""Token-constraint libraries at GPT-2's vocabulary (50,257 tokens), side by side, and the chosen one's
per-step cost against a batch-1 decode step of GPT-2 124M (random weights).

    python benchmarks/bench_structured.py            # llguidance, xgrammar, outlines-core, then the engine
    python benchmarks/bench_structured.py --libs llguidance

For each library and schema: the compile time; the per-step mask time (median over the steps of
seeded random walks that draw uniformly among the allowed tokens, stopping as soon as the end is
allowed or after --steps); how many walks ended, and how many of those parse and validate against
the schema (jsonschema_rs). Then, for llguidance (what gpt2kit uses): the median batch-1 greedy
decode step of GPT-2 124M plain and with a JSON-schema constraint (one engine, so its set-up is paid
once), and the constraint's own work per step replayed over the constrained run's tokens.
Prints the CPU, the core count and the load average first: on a shared machine the figures move.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                           "maxItems": 3}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "score": {"type": "number"}}, "required": ["user", "score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
                                                 "ok": {"type": "boolean"}},
                "required": ["date", "ok"], "additionalProperties": False},
}


def vocab_bytes() -> list[bytes]:
    from gpt2kit.tokenizer import Tokenizer

    tok = Tokenizer.default()
    return [tok.decode_bytes([i]) for i in range(tok.n_vocab)]


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: list[bytes]) -> None:
        from gpt2kit.sampling.structured import matcher_factory

        self.factory = matcher_factory()
        self.n = len(vocab)

    def compile(self, schema: dict):
        from gpt2kit.sampling.constraint import Constraint

        return self.factory.matcher(Constraint.json_schema(schema)).matcher

    def mask(self, m) -> torch.Tensor:
        return torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)

    def advance(self, m, t: int) -> None:
        assert m.consume_token(t)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[len(vocab) - 1])
        self.compiler = xgr.GrammarCompiler(info)
        self.bitmask = xgr.allocate_token_bitmask(1, len(vocab))

    def compile(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    def mask(self, m) -> torch.Tensor:
        m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0]

    def advance(self, m, t: int) -> None:
        assert m.accept_token(t)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: list[bytes]) -> None:
        import outlines_core as oc

        self.oc = oc
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab[:-1]):
            tokens.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(len(vocab) - 1, tokens)
        self.bitmask = torch.zeros((len(vocab) + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, m) -> torch.Tensor:
        self.bitmask.zero_()
        m.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), 4)
        return self.bitmask

    def advance(self, m, t: int) -> None:
        m.advance(t)


def _ids_of_bitmask(mask: torch.Tensor, n: int) -> list[int]:
    bits = (mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32)
    return bits.flatten()[:n].nonzero()[:, 0].tolist()


def walk(lib, schema: dict, rng: random.Random, steps: int, vocab: list[bytes]) -> tuple[list[float], bytes | None]:
    """One random walk: the mask times, and the output once the end is allowed (None: it never was)."""
    m, out, times, eos = lib.compile(schema), b"", [], len(vocab) - 1
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = lib.mask(m)  # the library's own bitmask: what a step pays
        times.append(time.perf_counter() - t0)
        ids = _ids_of_bitmask(mask, len(vocab))
        if eos in ids or not ids:
            return times, out
        t = rng.choice(ids)
        lib.advance(m, t)
        out += vocab[t]
    return times, None


def compare(libs: list[str], steps: int, walks: int) -> None:
    import jsonschema_rs

    vocab = vocab_bytes()
    print(f"{'library':<14}{'schema':<9}{'compile ms':>11}{'mask us (median)':>18}{'ended':>7}{'valid':>7}")
    for cls in [c for c in (Llguidance, Xgrammar, OutlinesCore) if c.name in libs]:
        lib = cls(vocab)
        for sname, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            lib.compile(schema)
            compile_ms = (time.perf_counter() - t0) * 1e3
            rng, times, ended, valid = random.Random(0), [], 0, 0
            for _ in range(walks):
                ts, out = walk(lib, schema, rng, steps, vocab)
                times += ts
                if out is not None:
                    ended += 1
                    try:
                        valid += jsonschema_rs.validator_for(schema).is_valid(json.loads(out))
                    except ValueError:
                        pass
            print(f"{cls.name:<14}{sname:<9}{compile_ms:>11.1f}{statistics.median(times) * 1e6:>18.0f}"
                  f"{ended:>7}{valid:>7}")


def decode_cost(trials: int, new_tokens: int) -> None:
    """A batch-1 greedy decode step of GPT-2 124M (random weights) against the constraint's work per
    step (the mask, applying it, advancing the matcher), replayed over a constrained run's tokens."""
    from gpt2kit.config import GPT2Config
    from gpt2kit.engine import Engine
    from gpt2kit.model import GPT2
    from gpt2kit.sampling import SamplingSettings
    from gpt2kit.sampling.constraint import Constraint
    from gpt2kit.sampling.structured import matcher_factory
    from gpt2kit.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name("gpt2")).eval()
    tok = Tokenizer.default()
    prompt = tok.encode("The record, as JSON:")
    # strings that cannot end before max_new_tokens: every step is a constrained step
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 8 * new_tokens}}}
    c = Constraint.json_schema(schema)
    engine = Engine(model, tok, max_batch=1)  # one engine: its kernel choice and packed weights made once
    per_token, out = {}, None
    for label, structured in (("plain", None), ("json_schema", c)):
        s = SamplingSettings(max_new_tokens=new_tokens, temperature=0, structured=structured)
        steps = []
        for _ in range(trials + 1):
            row = engine.new_row(prompt, s)
            engine.submit([row])
            engine.step()  # the prefill
            while engine.has_work:
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)
            out = row
        per_token[label] = statistics.median(steps[new_tokens:]) * 1e3  # the first run warms up
        print(f"batch-1 greedy decode step, {label:<12} {per_token[label]:.2f} ms (median)")
    logits = torch.randn(1, model.config.n_vocab)
    steps = []
    for _ in range(trials):
        m = matcher_factory(tok).matcher(c)
        for t in out.tokens:
            t0 = time.perf_counter()
            logits.masked_fill(m.disallowed(), float("-inf"))
            m.advance(t)
            steps.append(time.perf_counter() - t0)
    cost = statistics.median(steps) * 1e3
    print(f"constraint per step (mask + apply + advance, median): {cost:.3f} ms = "
          f"{cost / per_token['plain']:.1%} of a plain decode step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--libs", nargs="*", default=["llguidance", "xgrammar", "outlines-core"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--walks", type=int, default=6)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    compare(a.libs, a.steps, a.walks)
    if not a.no_decode:
        decode_cost(a.trials, a.new_tokens)


if __name__ == "__main__":
    main()
