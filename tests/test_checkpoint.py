"""Loading every published layout (HF dirs, hub cache, OpenAI TF) and saving for transformers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, cached_real_gpt2, needs_real_gpt2, random_hf_model

from gpt2kit.checkpoint import CheckpointError, describe, load_model, load_tokenizer, save_model
from gpt2kit.config import GPT2Config

FIXTURE_TF = Path(__file__).parent / "fixtures" / "openai_tf_tiny"
ATOL = 1e-4


def _ids(n_vocab: int = TINY.n_vocab, T: int = 24) -> torch.Tensor:
    return torch.randint(0, n_vocab, (2, T), generator=torch.Generator().manual_seed(0))


def _same_logits(model, hf, x=None) -> float:
    x = _ids(model.config.n_vocab) if x is None else x
    with torch.no_grad():
        return (model(x).logits - hf(x).logits).abs().max().item()


# --- HF directories -------------------------------------------------------------------------

def test_hf_dir_with_transformer_prefix(tmp_path):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path)
    keys = json.loads((tmp_path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (tmp_path / "model.safetensors").read_bytes()[:8], "little")])
    assert any(k.startswith("transformer.") for k in keys)
    assert _same_logits(load_model(tmp_path), hf) < ATOL


def test_hf_dir_without_prefix(tmp_path):
    hf = random_hf_model()
    hf.transformer.save_pretrained(tmp_path)  # GPT2Model: keys without "transformer."
    assert _same_logits(load_model(tmp_path), hf) < ATOL


def test_hf_dir_pytorch_bin_with_mask_buffers(tmp_path):
    hf = random_hf_model()
    hf.config.save_pretrained(tmp_path)
    sd = dict(hf.state_dict())
    for i in range(TINY.n_layer):  # what older transformers versions wrote
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    assert _same_logits(load_model(tmp_path), hf) < ATOL


def test_hf_dir_sharded_safetensors(tmp_path):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert _same_logits(load_model(tmp_path), hf) < ATOL


def test_dtype_and_eval_mode(tmp_path):
    random_hf_model().save_pretrained(tmp_path)
    m = load_model(tmp_path, dtype="bfloat16")
    assert not m.training
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="unknown dtype 'int7'"):
        load_model(tmp_path, dtype="int7")


# --- strictness -----------------------------------------------------------------------------

def _rewrite_safetensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(path / "model.safetensors")
    edit(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit,needle", [
    (lambda sd: sd.pop("transformer.h.1.mlp.c_fc.weight"), "missing tensor.*h.1.mlp.c_fc.weight"),
    (lambda sd: sd.__setitem__("transformer.h.0.attn.extra", torch.zeros(3)), "unexpected.*h.0.attn.extra"),
    (lambda sd: sd.__setitem__("transformer.ln_f.weight", torch.ones(31)), r"ln_f.weight has shape \(31,\)"),
    (lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(1000, 32)), "lm_head.weight differs"),
])
def test_strict_loading_names_the_tensor(tmp_path, edit, needle):
    random_hf_model().save_pretrained(tmp_path)
    _rewrite_safetensors(tmp_path, edit)
    with pytest.raises(CheckpointError, match=needle):
        load_model(tmp_path)


def test_nan_or_infinite_float_tensors_are_refused_naming_file_and_tensor(tmp_path):
    random_hf_model().save_pretrained(tmp_path / "st")
    _rewrite_safetensors(tmp_path / "st", lambda sd: sd["transformer.h.1.attn.c_proj.bias"].__setitem__(3, torch.nan))
    with pytest.raises(CheckpointError, match=r"st/model.safetensors: tensor h.1.attn.c_proj.bias holds 1 NaN"):
        load_model(tmp_path / "st")
    hf = random_hf_model()
    with torch.no_grad():
        hf.transformer.wpe.weight[2, :4] = torch.inf
    hf.config.save_pretrained(tmp_path / "bin")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"bin/pytorch_model.bin: tensor wpe.weight holds 4 infinite"):
        load_model(tmp_path / "bin")
    hf = random_hf_model()
    with torch.no_grad():
        hf.transformer.ln_f.weight[0] = 1e6  # finite in float32, beyond float16's 65,504
    hf.save_pretrained(tmp_path / "big")
    assert load_model(tmp_path / "big").ln_f.weight[0] == 1e6
    with pytest.raises(CheckpointError, match=r"tensor ln_f.weight holds 1 infinite value\(s\) once cast to float16"):
        load_model(tmp_path / "big", dtype="float16")


def test_truncated_safetensors_names_the_file(tmp_path):
    random_hf_model().save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def test_corrupt_pytorch_bin_and_missing_pieces(tmp_path):
    hf = random_hf_model()
    hf.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_model(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="not a GPT-2 checkpoint directory"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_model(tmp_path / "nope")


# --- saving ---------------------------------------------------------------------------------

def test_saved_dir_loads_in_transformers_with_identical_logits(tmp_path):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    ours = load_model(FIXTURE_TF)
    save_model(ours, tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"} <= names
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert _same_logits(ours, hf) < ATOL
    tok = GPT2TokenizerFast.from_pretrained(tmp_path)
    assert tok.encode("Hello world") == [15496, 995]
    again = load_model(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_saving_drops_padded_vocab_rows(tmp_path):
    from gpt2kit.model import GPT2

    model = GPT2(TINY.replace(n_vocab_padded=1024)).eval()
    save_model(model, tmp_path)
    again = load_model(tmp_path)
    assert again.wte.weight.shape == (1000, 32)
    assert torch.equal(again.wte.weight, model.wte.weight[:1000])


# --- OpenAI's TF release --------------------------------------------------------------------

def test_openai_tf_fixture_equals_same_weights_in_hf_layout():
    """Build the HF model from the reference arrays TF wrote (independent of our key map)."""
    from helpers import hf_config
    from transformers import GPT2LMHeadModel

    ref = np.load(FIXTURE_TF / "reference.npz")
    hp = json.loads((FIXTURE_TF / "hparams.json").read_text())
    cfg = GPT2Config.from_openai(hp)
    hf = GPT2LMHeadModel(hf_config(cfg)).eval()
    sd = {"transformer.wte.weight": ref["model/wte"], "transformer.wpe.weight": ref["model/wpe"],
          "transformer.ln_f.weight": ref["model/ln_f/g"], "transformer.ln_f.bias": ref["model/ln_f/b"]}
    for i in range(cfg.n_layer):
        for mod in ("ln_1", "ln_2"):
            sd[f"transformer.h.{i}.{mod}.weight"] = ref[f"model/h{i}/{mod}/g"]
            sd[f"transformer.h.{i}.{mod}.bias"] = ref[f"model/h{i}/{mod}/b"]
        for mod in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            dotted = mod.replace("/", ".")
            sd[f"transformer.h.{i}.{dotted}.weight"] = ref[f"model/h{i}/{mod}/w"][0]  # Conv1D keeps (in, out)
            sd[f"transformer.h.{i}.{dotted}.bias"] = ref[f"model/h{i}/{mod}/b"]
    hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False)
    hf.tie_weights()
    ours = load_model(FIXTURE_TF)
    assert ours.config == cfg
    assert _same_logits(ours, hf, _ids(cfg.n_vocab, cfg.n_ctx)) < ATOL


def test_openai_dir_tokenizer_files_win(tmp_path):
    d = tmp_path / "124M"
    shutil.copytree(FIXTURE_TF, d)
    assert load_tokenizer(d).encode("Hello world") == [15496, 995]  # packaged files
    pkg = Path(__file__).parents[1] / "src" / "gpt2kit" / "vocab"
    (d / "vocab.bpe").write_text((pkg / "vocab.bpe").read_text(encoding="utf-8"), encoding="utf-8")
    (d / "encoder.json").write_text("{broken", encoding="utf-8")
    with pytest.raises(ValueError, match="encoder.json"):
        load_tokenizer(d)


def test_openai_dir_missing_or_truncated_data(tmp_path):
    d = tmp_path / "124M"
    shutil.copytree(FIXTURE_TF, d)
    data = d / "model.ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.ckpt.data"):
        load_model(d)
    data.unlink()
    with pytest.raises(CheckpointError, match="model.ckpt.data"):
        load_model(d)


def test_describe_reports_config_and_counts():
    info = describe(FIXTURE_TF)
    assert info["source"] == "openai-tf"
    assert info["config"]["n_layer"] == 2
    ours = load_model(FIXTURE_TF)
    assert info["parameters"] == ours.num_parameters() == 59520


# --- the hub, through a pre-populated local cache --------------------------------------------

def _populate_hub_cache(cache: Path, repo: str, src: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo_dir / "snapshots" / commit)


def test_hub_id_from_local_cache_offline(tmp_path, monkeypatch):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "src")
    _populate_hub_cache(tmp_path / "hub", "openai-community/gpt2-tiny-test", tmp_path / "src")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model("openai-community/gpt2-tiny-test")
    assert _same_logits(model, hf) < ATOL
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        load_model("openai-community/not-cached")


def test_hf_home_is_honoured(tmp_path, monkeypatch):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "src")
    _populate_hub_cache(tmp_path / "home" / "hub", "gpt2-tiny-test", tmp_path / "src")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _same_logits(load_model("gpt2-tiny-test"), hf) < ATOL


# --- real weights: only when they are already cached -----------------------------------------

@needs_real_gpt2
def test_golden_greedy_continuation_of_the_dog(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = cached_real_gpt2()
    model = load_model(name)
    assert model.num_parameters() == 124_439_808
    ids = torch.tensor([[464, 3290]])
    with torch.no_grad():
        for _ in range(18):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    assert ids[0].tolist() == [464, 3290, 373, 1043, 287, 257, 2214, 1474, 262, 16246, 286, 2688, 290, 2688,
                               27262, 13, 198, 198, 464, 3290]


def test_saved_files_get_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        save_model(load_model(FIXTURE_TF), tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o644


# --- directory-level saves are atomic ------------------------------------------------------------

def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(model.config.n_vocab)).logits


def _hidden_siblings(d: Path) -> list[str]:
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}"))


def test_save_failing_midway_leaves_the_old_model_whole(tmp_path, monkeypatch):
    from helpers import random_model

    from gpt2kit.tokenizer import Tokenizer

    d = tmp_path / "model"
    old = random_model(TINY, seed=1)
    save_model(old, d)
    (d / "checkpoint.pt").write_bytes(b"a training run's file")
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    def fail(self, directory):  # the weights are written by now; the tokenizer and config are not
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Tokenizer, "save", fail)
    new = random_model(TINY.replace(n_layer=3), seed=2)
    with pytest.raises(OSError, match="No space left"):
        save_model(new, d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # not one byte changed
    assert torch.equal(_logits(load_model(d)), _logits(old))
    assert _hidden_siblings(d) == []  # the staging directory is gone


def test_save_replaces_the_model_whole_and_keeps_other_files(tmp_path):
    from helpers import random_model

    d = tmp_path / "model"
    save_model(random_model(TINY, seed=1), d)
    (d / "pytorch_model.bin").write_bytes(b"stale weights")  # would contradict the new ones
    (d / "notes.txt").write_text("mine")
    inode = (d / "notes.txt").stat().st_ino
    new = random_model(TINY.replace(n_layer=3), seed=2)
    save_model(new, d)
    assert torch.equal(_logits(load_model(d)), _logits(new))
    assert not (d / "pytorch_model.bin").exists()
    assert (d / "notes.txt").read_text() == "mine" and (d / "notes.txt").stat().st_ino == inode  # hard link
    assert _hidden_siblings(d) == []


def test_stale_staging_dirs_of_dead_writers_are_removed(tmp_path):
    from helpers import random_model

    d = tmp_path / "model"
    stale = tmp_path / ".model.saving-999999999-abc"  # no such pid: a writer killed with -9
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    save_model(random_model(TINY), d)
    assert not stale.exists() and _hidden_siblings(d) == []


def test_save_through_a_symlink_replaces_its_target(tmp_path):
    from helpers import random_model

    real, link = tmp_path / "real", tmp_path / "link"
    save_model(random_model(TINY, seed=1), real)
    link.symlink_to(real)
    new = random_model(TINY, seed=2)
    save_model(new, link)
    assert link.is_symlink() and torch.equal(_logits(load_model(real)), _logits(new))


# --- the config is checked against the headers before anything is read or built ------------------

def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | changes))


def _no_tensor_data(monkeypatch) -> None:
    import safetensors.torch

    def refuse(*a, **k):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


@pytest.mark.parametrize("n_layer,needle", [
    (1000, r"config.json says n_layer=1000, but the weights hold 2 layer\(s\) \(h.0 .. h.1\)"),
    (1000000, r"config.json says n_layer=1000000, but the weights hold 2 layer"),
    (10**7, r"config.json: n_layer=10000000 is beyond the limit 1,048,576"),
    (1, r"config.json says n_layer=1, but the weights hold 2 layer"),
])
def test_config_that_does_not_match_the_weights_fails_before_reading_them(tmp_path, monkeypatch, n_layer, needle):
    random_hf_model().save_pretrained(tmp_path)
    _edit_config(tmp_path, n_layer=n_layer)
    _no_tensor_data(monkeypatch)
    with pytest.raises(ValueError, match=needle):
        load_model(tmp_path)


def test_config_width_mismatch_names_tensor_and_file(tmp_path, monkeypatch):
    random_hf_model().save_pretrained(tmp_path)
    _edit_config(tmp_path, n_embd=64)
    _no_tensor_data(monkeypatch)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor wte.weight has shape \(1000, 32\), "
                                              r"config.json implies \(1000, 64\)"):
        load_model(tmp_path)


def test_info_reads_headers_only(tmp_path, monkeypatch):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    _no_tensor_data(monkeypatch)
    info = describe(tmp_path / "hf")
    assert info["parameters"] == sum(p.numel() for p in hf.transformer.parameters()) == 59520
    assert info["dtype"] == "float32"
    d = tmp_path / "tf"  # the TF index alone: data cut to nothing still describes, and fails to load
    shutil.copytree(FIXTURE_TF, d)
    (d / "model.ckpt.data-00000-of-00001").write_bytes(b"")
    assert describe(d)["parameters"] == 59520
    with pytest.raises(CheckpointError, match="model.ckpt.data"):
        load_model(d)


def test_info_imports_no_torch_and_reads_headers_only(tmp_path):
    # `gpt2kit info` is arithmetic on headers: without torch's import (most of what it cost) it takes a
    # fraction of a second, whatever the config claims (a million layers: refused from the layer count).
    import subprocess
    import sys

    from helpers import random_model

    from gpt2kit.quant.modules import quantize_model

    save_model(random_model(TINY), tmp_path / "f")
    save_model(quantize_model(random_model(TINY)), tmp_path / "q")
    shutil.copytree(tmp_path / "f", tmp_path / "huge")
    _edit_config(tmp_path / "huge", n_layer=1_000_000)
    code = ("import sys\nfrom gpt2kit.cli import main\nrc = [main(['info', d]) for d in sys.argv[1:]]\n"
            "print(rc, 'TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    dirs = [str(tmp_path / n) for n in ("f", "q", "huge")] + [str(FIXTURE_TF)]
    proc = subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "[0, 0, 1, 0] NO-TORCH", proc.stderr
    assert "says n_layer=1000000, but the weights hold 2 layer(s)" in proc.stderr
    assert proc.stdout.count("parameters: 59,520") == 3, proc.stdout  # the int8 one counts as its float model


def test_a_safetensors_header_that_does_not_fit_its_file_is_named(tmp_path):
    random_hf_model().save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    for cut, needle in ((data[:5], "shorter than its 8-byte header length"), (data[:200], "a header of"),
                        (data[:-4], "tensor .* lies at bytes")):
        f.write_bytes(cut)
        with pytest.raises(CheckpointError, match=f"model.safetensors: cannot read safetensors file \\({needle}"):
            describe(tmp_path)


def test_expected_shapes_equal_the_models_own():
    from gpt2kit.checkpoint.keymap import expected_shapes
    from gpt2kit.model import GPT2

    for cfg in (TINY, TINY.replace(n_vocab_padded=1024, n_layer=3)):
        with torch.device("meta"):
            model = GPT2(cfg)
        assert expected_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert cfg.n_params == model.num_parameters()


@pytest.mark.parametrize("bad,needle", [
    ({"n_layer": "12"}, r"config.json: n_layer must be an integer, got '12' \(str\)"),
    ({"layer_norm_epsilon": "1e-5"}, "config.json: layer_norm_epsilon must be a number"),
    ({"n_embd": True}, "config.json: n_embd must be an integer, got True"),
    ({"n_positions": 2 ** 30}, "config.json: n_positions=1073741824 is beyond the limit"),
])
def test_config_json_values_of_the_wrong_kind_name_file_and_key(tmp_path, bad, needle):
    random_hf_model().save_pretrained(tmp_path)
    _edit_config(tmp_path, **bad)
    with pytest.raises(ValueError, match=needle):
        load_model(tmp_path)


def test_config_json_not_utf8_empty_or_unreadable(tmp_path):
    random_hf_model().save_pretrained(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"n_layer": 2, "x": "\xff"}')
    with pytest.raises(ValueError, match=r"config.json: not UTF-8 text \(byte 0xff at offset 21\)"):
        load_model(tmp_path)
    cfg.write_bytes(b"")
    with pytest.raises(ValueError, match=r"config.json: empty file"):
        load_model(tmp_path)


# --- names that do not resolve are reported as local problems, never sent to the hub -------------

@pytest.fixture
def no_hub(monkeypatch):
    from gpt2kit.checkpoint import hub

    def refuse(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(hub, "download", refuse)


@pytest.mark.parametrize("name,needle", [
    ("./mdl", r"^\./mdl: no such directory$"),
    ("models/gpt2x", r"models/gpt2x: no such directory \(models exists; gpt2x does not\)"),
    ("loop", "loop: a symlink loop"),
    ("dangling", "dangling: a symlink to nowhere, which does not exist"),
    ("gpt2-mediun", r"not a published GPT-2 name \(gpt2, gpt2-medium, .*did you mean gpt2-medium\?"),
    ("mdl", r"mdl: no such directory, and not a published GPT-2 name"),
    ("gpt2-tiny", "a preset for training from scratch"),
])
def test_a_local_name_that_does_not_resolve_is_not_a_hub_id(tmp_path, monkeypatch, no_hub, name, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("nowhere")
    with pytest.raises(FileNotFoundError, match=needle):
        load_model(name)


def test_empty_and_unreadable_weights_are_named_as_such(tmp_path, monkeypatch):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == st else real_access(p, mode))
    with pytest.raises(CheckpointError, match=r"model.safetensors: exists but cannot be read \(permission denied\)"):
        load_model(tmp_path)
    monkeypatch.undo()
    st.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model.safetensors: empty file \(0 bytes\)"):
        load_model(tmp_path)
    st.unlink()
    torch.save({}, tmp_path / "pytorch_model.bin")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: empty file \(0 bytes\)"):
        load_model(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_checkpoint_dir_is_not_called_missing(tmp_path):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "m")
    (tmp_path / "m").chmod(0)
    try:
        with pytest.raises(PermissionError, match="permission denied"):
            load_model(tmp_path / "m")
    finally:
        (tmp_path / "m").chmod(0o755)


# --- paths a checkpoint names are taken inside its directory -------------------------------------

@pytest.mark.parametrize("named", ['"/home/someone/gpt-2/models/124M/model.ckpt"', '"../../elsewhere/model.ckpt"'])
def test_tf_checkpoint_file_naming_another_place_loads_the_files_beside_it(tmp_path, named):
    d = tmp_path / "124M"
    shutil.copytree(FIXTURE_TF, d)
    (d / "checkpoint").write_text(f"model_checkpoint_path: {named}\nall_model_checkpoint_paths: {named}\n")
    x = _ids(1000, 16)
    with torch.no_grad():
        assert torch.equal(load_model(d)(x).logits, load_model(FIXTURE_TF)(x).logits)
    (d / "checkpoint").write_text('model_checkpoint_path: "model-other.ckpt"\n')
    with pytest.raises(CheckpointError, match="names 'model-other.ckpt', but there is no model-other.ckpt.index"):
        load_model(d)


@pytest.mark.parametrize("index_name,shard", [
    ("model.safetensors.index.json", "../../outside.safetensors"),
    ("model.safetensors.index.json", "/etc/outside.safetensors"),
    ("pytorch_model.bin.index.json", "sub/../../outside.bin"),
])
def test_shard_index_entries_outside_the_directory_are_refused(tmp_path, index_name, shard):
    d = tmp_path / "a" / "b"
    random_hf_model().save_pretrained(d)
    outside = (d / shard) if not shard.startswith("/") else Path(shard)
    if not shard.startswith("/"):
        outside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(d / "model.safetensors", outside)
    (d / "model.safetensors").unlink()
    (d / index_name).write_text(json.dumps({"weight_map": {"transformer.wte.weight": shard}}))
    with pytest.raises(CheckpointError, match=f"shard '{shard}' lies outside the checkpoint directory"):
        load_model(d)


def test_every_saved_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        save_model(load_model(FIXTURE_TF), tmp_path / "m")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert set(modes) >= {"model.safetensors", "config.json", "generation_config.json", "vocab.json", "merges.txt"}
    assert set(modes.values()) == {0o640}, modes
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o750  # the directory as mkdir would make it


def test_checkpoint_api_is_typed_and_its_init_only_reexports():
    import inspect

    import gpt2kit.checkpoint as ck
    from gpt2kit.model import GPT2

    assert inspect.signature(ck.load_model).return_annotation in (GPT2, "GPT2")
    assert inspect.signature(ck.save_model).parameters["model"].annotation in (GPT2, "GPT2")
    public = [getattr(ck, n) for n in ck.__all__]
    assert all(getattr(obj, "__module__", "") != "gpt2kit.checkpoint" for obj in public)


def test_kill_9_during_saves_leaves_one_whole_model(tmp_path):
    """A writer killed at arbitrary moments while replacing a model: the directory always loads as
    exactly one of the two models, and the next save clears what the dead writer left."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import random_model

    d = tmp_path / "model"
    a, b = random_model(TINY, seed=1), random_model(TINY.replace(n_layer=3), seed=2)
    save_model(a, d)
    script = (
        "import sys; sys.path.insert(0, sys.argv[2]); from helpers import TINY, random_model; "
        "from gpt2kit.checkpoint import save_model; "
        "ms = [random_model(TINY, seed=1), random_model(TINY.replace(n_layer=3), seed=2)]; "
        "print('ready', flush=True); i = 0\n"
        "while True:\n    save_model(ms[i % 2], sys.argv[1]); i += 1")
    wanted = {_logits(a).sum().item(), _logits(b).sum().item()}
    for delay in (0.05, 0.13, 0.29):
        proc = subprocess.Popen([sys.executable, "-c", script, str(d), str(Path(__file__).parent)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _logits(load_model(d)).sum().item() in wanted
    save_model(a, d)
    assert torch.equal(_logits(load_model(d)), _logits(a)) and _hidden_siblings(d) == []


def test_save_into_a_dir_whose_parent_is_read_only_says_why(tmp_path, monkeypatch):
    import tempfile

    from helpers import random_model

    d = tmp_path / "model"
    d.mkdir()

    def denied(*a, **k):  # what mkdtemp raises in a parent the user cannot write (root can write anywhere)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(PermissionError, match="needs write access to the parent directory"):
        save_model(random_model(TINY), d)


def test_many_missing_tensors_make_one_short_line(tmp_path):
    from safetensors.torch import load_file, save_file

    random_hf_model(TINY.replace(n_layer=2)).save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    kept = {k: v for k, v in load_file(st).items() if ".mlp." not in k}  # 8 missing
    kept |= {f"transformer.extra.{i}": torch.zeros(1) for i in range(30)}
    save_file(kept, st)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): .* \.\.\. and 18 more$"):
        load_model(tmp_path)


def test_a_lock_held_on_a_file_in_the_dir_survives_a_save(tmp_path):
    """train holds an flock on OUT/.lock and keeps metrics.jsonl open while it saves the model into OUT."""
    import fcntl

    from helpers import random_model

    d = tmp_path / "run"
    d.mkdir()
    lock = open(d / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    metrics = open(d / "metrics.jsonl", "a")
    try:
        save_model(random_model(TINY), d)
        save_model(random_model(TINY, seed=3), d)
        with open(d / ".lock") as again, pytest.raises(BlockingIOError):
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second run still sees the lock
        metrics.write('{"step": 1}\n')
        metrics.flush()
        assert (d / "metrics.jsonl").read_text() == '{"step": 1}\n'  # appends land in the new directory
    finally:
        lock.close()
        metrics.close()


# --- the published GPT-2 names' tokenizer is the packaged one ------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "openai-community/gpt2",
                                  "openai-community/gpt2-xl"])
def test_published_gpt2_tokenizer_needs_no_hub(name, tmp_path, monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    tok = load_tokenizer(name)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.n_vocab == 50257


def test_a_local_directory_named_gpt2_keeps_its_own_tokenizer(tmp_path, monkeypatch):
    d = tmp_path / "gpt2"
    shutil.copytree(FIXTURE_TF, d)
    (d / "encoder.json").write_text("{broken", encoding="utf-8")
    pkg = Path(__file__).parents[1] / "src" / "gpt2kit" / "vocab"
    (d / "vocab.bpe").write_text((pkg / "vocab.bpe").read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="encoder.json"):  # its own (broken) files were read
        load_tokenizer("gpt2")
