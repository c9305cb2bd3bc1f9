"""docs/DESIGN.md stays true: its import arrows are the real graph's, wing by wing, and its reference
generation loop (the model's forward on a KVCache, greedy) gives the engine's tokens.

`python tests/test_design.py` prints the arrows block as the code has it, to paste when it changes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from helpers import random_model
from test_structure import _module_graph

from gpt2kit import SamplingSettings, generate

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md"


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def wing_arrows() -> dict[str, set[str]]:
    """{wing: the wings its modules import}, from every import in src/ (gpt2kit's face left out)."""
    arrows: dict[str, set[str]] = {}
    for module, deps in _module_graph().items():
        src = _wing(module)
        if src == "__init__":
            continue
        arrows.setdefault(src, set()).update(_wing(d) for d in deps if _wing(d) not in (src, "__init__"))
    return arrows


def arrows_block(arrows: dict[str, set[str]]) -> str:
    return "\n".join(f"{w} -> {', '.join(sorted(arrows[w])) or '(nothing)'}" for w in sorted(arrows))


def _documented() -> dict[str, set[str]]:
    block = re.search(r"```text arrows\n(.*?)```", DESIGN.read_text(encoding="utf-8"), re.S)
    assert block, "docs/DESIGN.md has no ```text arrows block"
    out = {}
    for line in block.group(1).splitlines():
        wing, _, deps = line.partition(" -> ")
        out[wing.strip()] = set() if deps.strip() == "(nothing)" else {d.strip() for d in deps.split(",")}
    return out


def test_the_documented_arrows_are_the_real_ones():
    real, said = wing_arrows(), _documented()
    assert said == real, "docs/DESIGN.md's arrows differ from the code's; they are now:\n" + arrows_block(real)


def _reference_loop():
    text = DESIGN.read_text(encoding="utf-8")
    code = re.search(r"## The generation loop, for reference\n.*?```python\n(.*?)```", text, re.S)
    assert code, "docs/DESIGN.md has no reference loop"
    scope: dict = {}
    exec(compile(code.group(1), str(DESIGN), "exec"), scope)  # our own doc's code, run as the docs test runs it
    return scope["reference_generate"]


def test_the_reference_loop_gives_the_engines_greedy_tokens():
    reference_generate = _reference_loop()
    model = random_model()
    prompts = [[464, 268, 786], [999], list(range(100, 130))]
    s = SamplingSettings(temperature=0, max_new_tokens=12, stop_token_ids=())
    for prompt, completion in zip(prompts, generate(model, prompts, s), strict=True):
        assert reference_generate(model, prompt, 12) == completion.tokens


def test_the_reference_loops_draw_is_the_softmax_of_the_logits():
    reference_generate = _reference_loop()
    model = random_model()
    torch.manual_seed(0)
    a = reference_generate(model, [1, 2, 3], 8, temperature=1.0, seed=7)
    assert a == reference_generate(model, [1, 2, 3], 8, temperature=1.0, seed=7)  # seeded
    assert all(0 <= t < model.config.n_vocab for t in a)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(arrows_block(wing_arrows()))
