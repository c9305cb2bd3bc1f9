"""LoRA adapter files as data (gpt2kit.checkpoint.adapter, adapter_config): every field and tensor is
checked and refused naming the file and the field or tensor, nothing in the file runs or can make
reading slow, and a merge is checked before anything is written.

Adapters are written by save_adapter from tiny random models (tests/helpers.py), then edited as a
downloaded file could be. The crafted-pattern cases run the CLI in a subprocess with a timeout, so
a loader that hangs fails the test instead of hanging the suite.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, error_lines, random_model
from safetensors.torch import load_file, save_file

from gpt2kit.checkpoint import CheckpointError, apply_adapter, load_model, read_adapter, save_adapter, save_model
from gpt2kit.lora import apply_lora, lora_state

CRAFTED = "(.*.*.*.*.*.*.*.*.*.*.*.*)*Z"  # catastrophic backtracking if run as a regular expression
PEFT_KEY = "base_model.model.transformer.{}.lora_{}.weight"
TOKENS_KEY = "base_model.model.transformer.wte.token_adapter.trainable_tokens_delta"


def _adapter(tmp_path: Path, name: str = "adapter", *, base: Path | None = None, **kw) -> Path:
    """An adapter of rank 2 on c_attn (kw: apply_lora's), random lora_A / lora_B (std 0.1)."""
    model = apply_lora(random_model(), 2, targets=kw.pop("targets", "c_attn"), **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in lora_state(model, kw.get("bias", "none")).values():
            if t.is_floating_point():  # not the token ids
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return save_adapter(model, tmp_path / name, base=None if base is None else str(base),
                        bias=kw.get("bias", "none"))


def _config(d: Path, **changes) -> Path:
    cfg_file = d / "adapter_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | changes))  # NaN written as NaN, as Python does
    return cfg_file


def _tensors(d: Path, change) -> Path:
    weights = d / "adapter_model.safetensors"
    state = load_file(weights)
    change(state)
    save_file(state, weights)
    return weights


@pytest.fixture
def base(tmp_path) -> Path:
    return save_model(random_model(), tmp_path / "base")


def _run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2kit", *map(str, argv)], capture_output=True, text=True,
                          timeout=180)


# --- rank_pattern / alpha_pattern keys: module names, compared as text -----------------------------------------


@pytest.mark.parametrize("command", ["generate", "merge", "serve"])
def test_a_regular_expression_key_is_refused_at_once_through_the_cli(tmp_path, base, command):
    if command == "serve":
        pytest.importorskip("fastapi")
    ad = _adapter(tmp_path, base=base)
    cfg_file = _config(ad, alpha_pattern={CRAFTED: 4})
    argv = {"generate": ["generate", "hello", "--model", base, "--adapter", ad, "-n", "2"],
            "merge": ["merge", base, ad, tmp_path / "out"],
            "serve": ["serve", "--model", base, "--adapter", ad, "--port", "0"]}[command]
    proc = _run(*argv)  # a loader running the key as a pattern never returns: the timeout fails the test
    assert proc.returncode == 1, proc.stderr
    assert len(error_lines(proc.stderr)) == 1
    assert f"{cfg_file}: alpha_pattern key {CRAFTED!r} is not a module name" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, key", [("alpha_pattern", "("), ("rank_pattern", "("), ("rank_pattern", "h.*"),
                                        ("alpha_pattern", "^transformer"), ("alpha_pattern", "c_attn$"),
                                        ("alpha_pattern", "h..1"), ("alpha_pattern", "")])
def test_a_pattern_key_that_is_not_a_module_name_is_refused_by_name(tmp_path, field, key):
    cfg_file = _config(_adapter(tmp_path), **{field: {key: 2}})
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{cfg_file}: {field} key {key!r} is not a module name")):
        read_adapter(cfg_file.parent)


def test_pattern_keys_match_module_names_and_their_ends(tmp_path):
    ad = _adapter(tmp_path, targets="c_attn,attn.c_proj,mlp.c_proj")
    _config(ad, lora_alpha=4, alpha_pattern={"h.1.attn.c_attn": 6, "attn.c_attn": 12,
                                             "transformer.h.0.attn.c_proj": 10, "n.c_proj": 100, "c_fc": 50},
            rank_pattern={"h.1.attn.c_attn": 2})
    scalings = read_adapter(ad).scalings
    # rank 2 everywhere: alpha / 2; the first key that is the name or its end after a "." wins
    assert scalings == {"h.0.attn.c_attn": 6.0, "h.1.attn.c_attn": 3.0, "h.0.attn.c_proj": 5.0,
                        "h.1.attn.c_proj": 2.0, "h.0.mlp.c_proj": 2.0, "h.1.mlp.c_proj": 2.0}


# --- non-finite values -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, bad, count, kind", [
    (PEFT_KEY.format("h.0.attn.c_attn", "A"), float("nan"), 64, "NaN"),
    (PEFT_KEY.format("h.1.attn.c_attn", "B"), float("inf"), 192, "infinite"),
    (TOKENS_KEY, float("nan"), 1, "NaN"),
    ("base_model.model.transformer.ln_f.bias", float("-inf"), 1, "infinite"),
])
def test_a_non_finite_tensor_is_refused_naming_it_and_merge_writes_nothing(tmp_path, base, capsys, key, bad, count,
                                                                           kind):
    from gpt2kit.cli import main

    ad = _adapter(tmp_path, bias="all", tokens=[3, 5])

    def spoil(state):
        flat = state[key].view(-1)
        flat[: count] = bad

    weights = _tensors(ad, spoil)
    words = f"{weights}: tensor {key} holds {count:,} {kind} value(s); a model built from it computes nan"
    with pytest.raises(CheckpointError, match=f"^{words}$".replace("(", r"\(").replace(")", r"\)")):
        read_adapter(ad)
    assert main(["merge", str(base), str(ad), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and words in err
    assert not (tmp_path / "out").exists()
    assert main(["generate", "hi", "--model", str(base), "--adapter", str(ad), "-n", "2"]) == 1
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("field, value, words", [
    ("lora_alpha", float("nan"), "lora_alpha must be a number > 0, got nan"),
    ("lora_alpha", float("inf"), "lora_alpha must be a number > 0, got inf"),
    ("lora_alpha", 0, "lora_alpha must be a number > 0, got 0"),
    ("lora_alpha", -8, "lora_alpha must be a number > 0, got -8"),
    ("lora_alpha", None, "lora_alpha must be a number > 0, got None"),
    ("lora_alpha", "8", "lora_alpha must be a number > 0, got '8'"),
    ("lora_alpha", True, "lora_alpha must be a number > 0, got True"),
    pytest.param("lora_alpha", 10 ** 400, "lora_alpha must be a number > 0, got 1000000", id="lora_alpha-10**400"),
    ("alpha_pattern", {"c_attn": float("nan")}, "alpha_pattern['c_attn'] must be a number > 0, got nan"),
    ("alpha_pattern", {"c_attn": -1}, "alpha_pattern['c_attn'] must be a number > 0, got -1"),
    ("alpha_pattern", ["c_attn"], "alpha_pattern must be an object of module name: value, got ['c_attn']"),
    ("rank_pattern", {"c_attn": 0}, "rank_pattern['c_attn'] must be an integer >= 1, got 0"),
    ("rank_pattern", {"c_attn": "2"}, "rank_pattern['c_attn'] must be an integer >= 1, got '2'"),
    ("lora_dropout", "lots", "lora_dropout must be a number in [0, 1), got 'lots'"),
    ("lora_dropout", 1.5, "lora_dropout must be a number in [0, 1), got 1.5"),
    ("r", "8", "r must be an integer >= 1, got '8'"),
    ("use_rslora", "yes", "use_rslora must be true or false, got 'yes'"),
    ("base_model_name_or_path", 5, "base_model_name_or_path must be a string, got 5"),
])
def test_a_config_value_of_the_wrong_type_or_range_names_the_file_and_the_field(tmp_path, field, value, words):
    cfg_file = _config(_adapter(tmp_path), **{field: value})
    with pytest.raises(CheckpointError) as e:
        read_adapter(cfg_file.parent)
    assert str(e.value).startswith(f"{cfg_file}: {words}"), str(e.value)


def test_empty_token_indices_and_rank_zero_tensors_are_refused_by_name(tmp_path, base):
    ad = _adapter(tmp_path, tokens=[3, 5])
    cfg_file = _config(ad, trainable_token_indices=[])
    _tensors(ad, lambda state: state.update({TOKENS_KEY: torch.zeros(0, TINY.n_embd)}))
    with pytest.raises(CheckpointError, match=f"^{cfg_file}: trainable_token_indices must be a non-empty list of "
                                              r"distinct token ids, got \[\]$"):
        load_model(base, adapter=ad)
    ad = _adapter(tmp_path, "rank0")
    key = PEFT_KEY.format("h.0.attn.c_attn", "A")
    weights = _tensors(ad, lambda state: state.update({key: torch.zeros(0, 32),
                                                      PEFT_KEY.format("h.0.attn.c_attn", "B"): torch.zeros(96, 0)}))
    with pytest.raises(CheckpointError, match=f"^{weights}: {key} must be a 2-D floating tensor with no empty "
                                              r"dimension \(a LoRA rank is at least 1\), got \(0, 32\)"):
        load_model(base, adapter=ad)


def test_an_update_beyond_float32_is_refused_at_read(tmp_path):
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    cfg_file = _config(_adapter(tmp_path), lora_alpha=1e308)
    with pytest.raises(CheckpointError, match=f"^{weights}: h.0.attn.c_attn's scaling \\(alpha / rank\\) is "
                                              r"5e\+307, beyond float32's range"):
        read_adapter(cfg_file.parent)
    _config(cfg_file.parent, lora_alpha=2e36)  # scaling 1e36: finite; lora_B x 1e6 makes B A about 1e5
    _tensors(cfg_file.parent, lambda state: state[PEFT_KEY.format("h.1.attn.c_attn", "B")].mul_(1e6))
    with pytest.raises(CheckpointError, match=f"^{weights}: h.1.attn.c_attn's update \\(1e\\+36 x lora_B @ lora_A\\) "
                                              r"overflows float32 in [0-9,]+ value\(s\)"):
        read_adapter(cfg_file.parent)


def test_a_merge_beyond_the_dtype_is_refused_before_anything_changes(tmp_path, base, capsys):
    from gpt2kit.cli import main

    ad = _adapter(tmp_path, bias="all")
    # h.1's update reaches 1e5 and more: finite in float32, beyond float16's 65,504
    weights = _tensors(ad, lambda state: state[PEFT_KEY.format("h.1.attn.c_attn", "B")].mul_(1e7))
    model = load_model(base, dtype="float16")
    before = {k: t.clone() for k, t in model.state_dict().items()}
    words = (f"{weights}: tensor h.1.attn.c_attn.weight holds [0-9,]+ infinite value\\(s\\) once the adapter is "
             r"merged into it \(float16: out of its range\)")
    with pytest.raises(CheckpointError, match=f"^{words}"):
        apply_adapter(model, ad)
    after = model.state_dict()  # all or nothing: h.0 (fine) was not merged, the biases not replaced
    assert all(torch.equal(after[k], t) for k, t in before.items())
    assert main(["merge", str(base), str(ad), str(tmp_path / "out"), "--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "tensor h.1.attn.c_attn.weight holds" in err and "float16" in err
    assert not (tmp_path / "out").exists()
    assert main(["merge", str(base), str(ad), str(tmp_path / "out")]) == 0  # float32 holds it
    _tensors(ad, lambda state: state["base_model.model.transformer.ln_f.bias"].fill_(1e5))
    with pytest.raises(CheckpointError, match=r"tensor base_model.model.transformer.ln_f.bias holds 32 infinite "
                                              r"value\(s\) once cast to float16 \(out of its range\)"):
        apply_adapter(model, ad, merge=False)
    assert all(torch.equal(model.state_dict()[k], t) for k, t in before.items())


# --- writing the merged model; an adapter where a model belongs ------------------------------------------------


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_merge_on_a_full_disk_names_the_output(tmp_path, base, capsys, monkeypatch, failure):
    import safetensors.torch

    from gpt2kit.cli import main

    def full(*args, **kwargs):
        if failure == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        from safetensors import SafetensorError

        raise SafetensorError("I/O error: No space left on device (os error 28)")  # what safetensors says

    ad = _adapter(tmp_path)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "merged"
    assert main(["merge", str(base), str(ad), str(out)]) == 1
    assert error_lines(capsys.readouterr().err) == [f"gpt2kit merge: error: [Errno 28] no space left on {out} while "
                                                    f"writing the merged model; nothing was written to {out}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # no output, no staging left


def test_an_adapter_given_as_the_model_says_whose_it_is_and_how_to_use_it(tmp_path, base, capsys):
    from gpt2kit.cli import main

    ad = _adapter(tmp_path, base=base)
    words = (f"{ad}: a LoRA adapter (peft's format), not a model; made for the base {str(base)!r}: use --model "
             f"{base} --adapter {ad}, or gpt2kit merge")
    with pytest.raises(CheckpointError) as e:
        load_model(ad)
    assert str(e.value) == words
    assert main(["generate", "hi", "--model", str(ad)]) == 1
    assert error_lines(capsys.readouterr().err) == [f"gpt2kit generate: error: {words}"]
    _config(ad, base_model_name_or_path=None)
    with pytest.raises(CheckpointError) as e:
        load_model(ad)
    assert str(e.value) == (f"{ad}: a LoRA adapter (peft's format), not a model; its base is not recorded "
                            f"(base_model_name_or_path): use --model BASE --adapter {ad}, or gpt2kit merge")
