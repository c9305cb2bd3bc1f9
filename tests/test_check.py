"""gpt2kit check: learner-style GPT-2s (tests/fixtures/check: nanoGPT's way, a book chapter's way with a
KV cache, the block-by-block chapter's names) pass against gpt2kit's reference; each common mistake,
planted in a copy of one of them, is found at its stage with its diagnosis; unmapped names are listed;
bad input is one line and exit code 2; docs/check.md runs as written."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import error_lines

import gpt2kit
from gpt2kit.checker import CheckReport, LearnerError, check
from gpt2kit.checker import variants as var
from gpt2kit.checkpoint import save_model
from gpt2kit.cli import main
from gpt2kit.config import GPT2Config
from gpt2kit.model import CAUSAL, GPT2

ROOT = Path(__file__).resolve().parents[1]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
FIX = ROOT / "tests" / "fixtures" / "check"
NANO = (FIX / "nanogpt_style.py", "GPT", "GPTConfig")
CHAPTER = (FIX / "chapter_style.py", "GPTModel", "GPT_CONFIG_124M")
BLOCKS = (FIX / "blocks_style.py", "GPT", "GPTConfig")
SPEC = (ROOT / "src" / "gpt2kit" / "model.py", "GPT2", None)  # gpt2kit's own model, as a learner
TINY = GPT2Config(n_vocab=96, n_ctx=32, n_embd=32, n_head=4, n_layer=2)


def lively(cfg: GPT2Config, seed: int = 0, embed_std: float | None = None) -> GPT2:
    """Random weights large enough that each planted mistake moves its stage well past the tolerance
    (GPT-2's own init, N(0, 0.02), would hide some): matrices N(0, 2/sqrt(in)), biases N(0, 0.1), gains
    N(1, 0.1); embed_std: the embeddings' own scale (large: LayerNorm inputs of large variance)."""
    torch.manual_seed(seed)
    m = GPT2(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                std = embed_std if embed_std is not None and name in ("wte.weight", "wpe.weight") else None
                p.normal_(0, std or 2 / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(1, 0.1)
    return m


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: threads only contend (measured several times slower on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    save_model(lively(TINY), d)
    return d


def spec_of(learner) -> str:
    return f"{learner[0]}:{learner[1]}"


def plant(tmp_path: Path, learner, *subs: tuple[str, str]) -> tuple[str, str | None]:
    """A copy of a learner file with each (old, new) replaced (old must occur); (PATH:NAME, config class)."""
    path, name, config = learner
    src = path.read_text(encoding="utf-8")
    for old, new in subs:
        assert old in src, old
        src = src.replace(old, new)
    out = tmp_path / path.name
    out.write_text(src, encoding="utf-8")
    return f"{out}:{name}", config


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- clean models pass ----------------------------------------------------------------------------

def _random_config(seed: int) -> GPT2Config:
    r = random.Random(seed)
    n_head = r.choice([1, 2, 4])
    return GPT2Config(n_vocab=r.randint(60, 200), n_ctx=r.randint(20, 48), n_embd=n_head * r.choice([4, 8, 16]),
                      n_head=n_head, n_layer=r.randint(1, 3))


_REFS: dict[int, Path] = {}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("learner", [NANO, CHAPTER, BLOCKS, SPEC], ids=["nanogpt", "chapter", "blocks", "spec"])
def test_clean_learner_models_pass_with_random_tiny_configs(tmp_path_factory, learner, seed):
    cfg = _random_config(seed)
    if seed not in _REFS:
        _REFS[seed] = tmp_path_factory.mktemp(f"ref{seed}")
        save_model(lively(cfg, seed), _REFS[seed])
    report = check(spec_of(learner), _REFS[seed], config_class=learner[2])
    assert report.ok and report.exit_code == 0, report.format()
    forward = report.stages[: 3 + 6 * cfg.n_layer]
    assert all(s.ok for s in forward), report.format()  # every stage observed and within 1e-4
    assert len(forward) == 3 + 6 * cfg.n_layer and forward[-1].label == "logits"
    assert not report.weights.unset and not report.weights.unused
    has_cache = learner in (CHAPTER, SPEC)
    assert any(s.label.startswith("cache") and s.ok for s in report.stages) == has_cache


def test_the_cli_passes_a_clean_model_and_names_the_stage_of_a_planted_mistake(capsys, ref_dir, tmp_path):
    code, out, err = run(capsys, ["check", spec_of(NANO), "--model", str(ref_dir), "--config-class", "GPTConfig"])
    assert code == 0, err
    rows = [line for line in out.splitlines() if re.search(r"\s(ok|DIFFERS)$", line)]
    assert len(rows) == 3 + 6 * TINY.n_layer + 1 and all(r.endswith(" ok") for r in rows)  # + the eps probe
    assert rows[0].startswith("embeddings + positions") and "every stage matches GPT-2 within 0.0001" in out
    erf, config = plant(tmp_path, NANO, ("nn.GELU(approximate='tanh')", "nn.GELU()"))
    proc = subprocess.run([sys.executable, "-m", "gpt2kit", "check", erf, "--model", str(ref_dir), "--config-class",
                           config], capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"block 0 ln_2\s+\S+\s+ok", next(x for x in lines if x.startswith("block 0 ln_2")))
    assert re.fullmatch(r"block 0 mlp\s+\S+\s+DIFFERS", next(x for x in lines if x.startswith("block 0 mlp")))
    assert "first difference: block 0 mlp" in proc.stdout
    assert "diagnosis: the MLP's GELU is the exact, erf form" in proc.stdout


# --- each mistake, planted ------------------------------------------------------------------------

_MASK = "torch.tril(torch.ones(config.block_size, config.block_size))"
PLANTED = {
    "erf GELU": (NANO, [("nn.GELU(approximate='tanh')", "nn.GELU()")], "block 0 mlp", "GELU is the exact, erf form"),
    "erf GELU (chapter)": (BLOCKS, [('F.gelu(self.w1(x), approximate="tanh")', "F.gelu(self.w1(x))")],
                           "block 0 mlp", "GELU is the exact, erf form"),
    "ReLU": (NANO, [("nn.GELU(approximate='tanh')", "nn.ReLU()")], "block 0 mlp", "the MLP uses ReLU"),
    "scaled by 1/sqrt(n_embd)": (NANO, [("math.sqrt(self.head_dim)", "math.sqrt(self.n_embd)")], "block 0 attention",
                                 "divided by sqrt(n_embd) = sqrt(32)"),
    "no 1/sqrt(d_head)": (NANO, [(" * (1.0 / math.sqrt(self.head_dim))", "")], "block 0 attention",
                          "scores are not scaled"),
    "mask after softmax": (NANO, [("""        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)""", """        att = F.softmax(att, dim=-1)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, 0.0)""")], "block 0 attention",
                           "mask is applied after the softmax"),
    "mask sees the next token": (NANO, [(_MASK, _MASK[:-1] + ", diagonal=1)")], "block 0 attention",
                                 "each position also sees the next token"),
    "mask hides the token itself": (NANO, [(_MASK, _MASK[:-1] + ", diagonal=-1)")], "block 0 attention",
                                    "no position sees itself"),
    "no causal mask": (NANO, [("        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n", "")],
                       "block 0 attention", "there is no causal mask"),
    "softmax over the queries": (NANO, [("F.softmax(att, dim=-1)", "F.softmax(att, dim=-2)")], "block 0 attention",
                                 "softmax runs over the wrong axis"),
    "heads split by a plain view": (NANO, [(".view(B, T, self.n_head, self.head_dim).transpose(1, 2)",
                                            ".reshape(B, self.n_head, T, self.head_dim)")], "block 0 attention",
                                    "heads are split with a plain view"),
    "heads merged without the transpose": (NANO, [("y.transpose(1, 2).contiguous().view(B, T, C)",
                                                   "y.contiguous().view(B, T, C)")], "block 0 attention",
                                           "heads are merged without transposing back"),
    "k, q, v order": (NANO, [("q, k, v = qkv.split", "k, q, v = qkv.split")], "block 0 attention",
                      "in the order k, q, v"),
    "dropout active in eval": (NANO, [("att = self.attn_dropout(att)", "att = F.dropout(att, p=0.1)")],
                               "block 0 attention", "dropout is active in eval mode"),
    "post-norm": (NANO, [("""        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))""", """        x = self.ln_1(x + self.attn(x))
        x = self.ln_2(x + self.mlp(x))""")], "block 0 ln_1", "post-norm"),
    "LayerNorm eps 1e-6": (NANO, [("self.ln_1 = nn.LayerNorm(config.n_embd)",
                                   "self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-6)")],
                           "block 0 attention", "block 0's ln_1: its LayerNorm eps is 1e-06; GPT-2's is 1e-5"),
    "LayerNorm over C - 1": (CHAPTER, [("unbiased=False", "unbiased=True")], "block 0 ln_1",
                             "divides by the unbiased standard deviation"),
    "no residual around the attention": (NANO, [("x = x + self.attn(self.ln_1(x))", "x = self.attn(self.ln_1(x))")],
                                         "block 0 residual 1", "the attention's residual connection is missing"),
    "RMSNorm": (CHAPTER, [("norm_x = (x - mean) / torch.sqrt(var + self.eps)",
                           "norm_x = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.eps)")],
                "block 0 ln_1", "it is an RMSNorm"),
    "positions not added": (NANO, [("self.transformer.drop(tok_emb + pos_emb)", "self.transformer.drop(tok_emb)")],
                            "embeddings + positions", "the position embeddings are not added"),
    "residual onto ln_1's output": (BLOCKS, [("x = x + self.attn(self.norm_1(x), mask)",
                                              "x = self.norm_1(x)\n        x = x + self.attn(x, mask)")],
                                    "block 0 residual 1", "added to ln_1(x), not to the block's input"),
    "embeddings scaled by sqrt(d)": (BLOCKS, [("self.drop(self.wte(x) + self.wpe(pos))",
                                               "self.drop(self.wte(x) * math.sqrt(self.wte.embedding_dim) + "
                                               "self.wpe(pos))")], "embeddings + positions",
                                     "multiplied by sqrt(n_embd)"),
    "head not tied": (NANO, [("        self.transformer.wte.weight = self.lm_head.weight\n", ""),
                             ("self.lm_head", "self.vocab_proj")], "logits",
                      "vocab_proj.weight (96, 32) is not tied to the token embedding"),
    "head reshaped, not transposed": (NANO, [("self.lm_head(x)", "x @ self.lm_head.weight.view(x.size(-1), -1)"),
                                             ("self.lm_head(x[:, [-1], :])",
                                              "x[:, [-1], :] @ self.lm_head.weight.view(x.size(-1), -1)")],
                                      "logits", "a reshape is not a transpose"),
    "head with a bias": (BLOCKS, [("nn.Linear(config.dmodel, config.vocabsize, bias=False)",
                                   "nn.Linear(config.dmodel, config.vocabsize)")], "logits",
                         "your head has a bias (lm_head.bias)"),
    "no final norm": (BLOCKS, [("x = self.norm(x)", "pass")], "logits", "final LayerNorm is not applied"),
    "positions not offset by the cache": (CHAPTER, [(
        "torch.arange(self.current_pos, self.current_pos + seq_len, device=in_idx.device)",
        "torch.arange(0, seq_len, device=in_idx.device)")], "cache: 2 pieces = whole",
        "positions are not offset by the cache length"),
    "cache not used": (CHAPTER, [("x = blk(x, use_cache=use_cache)", "x = blk(x)")], "cache: 2 pieces = whole",
                       "the cache is not used: the second piece attends to its own tokens only"),
}


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_each_planted_mistake_is_found_at_its_stage_with_its_diagnosis(ref_dir, tmp_path, mistake):
    learner, subs, stage, says = PLANTED[mistake]
    spec, config = plant(tmp_path, learner, *subs)
    report = check(spec, ref_dir, config_class=config)
    assert report.exit_code == 1
    assert report.first.label == stage and not report.first.ok, report.format()
    assert says in report.diagnosis, report.format()
    before = report.stages[: report.stages.index(report.first)]
    assert all(s.ok is not False for s in before)
    assert f"first difference: {stage}" in report.format() and f"diagnosis: {report.diagnosis}" in report.format()


def test_a_layernorm_eps_the_forward_pass_cannot_see_is_found_by_the_low_variance_probe(tmp_path):
    """Embeddings of std 3: LayerNorm inputs of variance ~9, where eps 1e-6 against 1e-5 moves no stage past
    1e-4; the probe feeds each LayerNorm an input of variance 1e-6, where it does."""
    d = tmp_path / "ref"
    save_model(lively(TINY, embed_std=3.0), d)
    spec, config = plant(tmp_path, NANO, ("self.ln_2 = nn.LayerNorm(config.n_embd)",
                                          "self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-6)"))
    report = check(spec, d, config_class=config)
    assert all(s.ok for s in report.stages[:-1]), report.format()
    assert report.first.label == "layernorm eps (low-variance input)" and report.exit_code == 1
    assert report.diagnosis.startswith("transformer.h.0.ln_2: its LayerNorm eps is 1e-06"), report.diagnosis
    assert "(1 more of your LayerNorms differ here too)" in report.diagnosis


# --- names -----------------------------------------------------------------------------------------

def test_unmapped_names_are_listed_on_both_sides(ref_dir, tmp_path):
    spec, config = plant(tmp_path, NANO,
                         ("self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)",
                          "self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)\n"
                          "        self.temperature = nn.Parameter(torch.ones(1))"))
    report = check(spec, ref_dir, config_class=config)
    wm = report.weights
    assert {n for n, _ in wm.unset} == {"transformer.h.0.attn.temperature", "transformer.h.1.attn.temperature"}
    assert wm.unused == ["h.0.attn.c_attn.bias", "h.1.attn.c_attn.bias"]
    text = report.format()
    assert "left unset: transformer.h.1.attn.temperature (no GPT-2 tensor has this name or shape)" in text
    assert "  unused: h.0.attn.c_attn.bias" in text and "2 of yours left unset, 2 of GPT-2's unused" in text
    assert report.first.label == "block 0 attention"
    assert report.diagnosis.startswith("GPT-2's h.0.attn.c_attn.bias went into no parameter of yours")


_RAW_PROJ = [("self.c_proj = nn.Linear(config.n_embd, config.n_embd)\n        self.attn_dropout",
              "self.o_mix = nn.Parameter(torch.zeros(config.n_embd, config.n_embd))\n"
              "        self.o_bias = nn.Parameter(torch.zeros(config.n_embd))\n        self.attn_dropout"),
             ("y = self.resid_dropout(self.c_proj(y))", "y = self.resid_dropout(y @ self.o_mix + self.o_bias)")]


def test_a_mapping_file_maps_what_names_cannot_with_its_transpose_flag(ref_dir, tmp_path, capsys):
    """The attention's output projection as a raw (in, out) parameter with a name of its own: square, so
    neither its name nor its shape says where it goes or which way round."""
    spec, config = plant(tmp_path, NANO, *_RAW_PROJ)
    code, out, _ = run(capsys, ["check", spec, "--model", str(ref_dir), "--config-class", config])
    assert code == 1 and "left unset: transformer.h.0.attn.o_mix" in out and "  unused: h.1.attn.c_proj.weight" in out
    names = tmp_path / "names.json"
    names.write_text('{"transformer.h.0.attn.o_mix": {"name": "h.0.attn.c_proj.weight", "transpose": true}, '
                     '"transformer.h.1.attn.o_mix": {"name": "transformer.h.1.attn.c_proj.weight", '
                     '"transpose": true}}')  # HF's name (transformer.) is taken too
    code, out, err = run(capsys, ["check", spec, "--model", str(ref_dir), "--config-class", config,
                                  "--map", str(names)])
    assert code == 0, out + err
    assert "0 of yours left unset, 0 of GPT-2's unused" in out and "(2 transposed)" in out
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"transformer.h.0.attn.o_mix": "h.0.attn.c_proj.weight", '
                     '"transformer.h.1.attn.o_mix": "h.1.attn.c_proj.weight"}')
    code, out, _ = run(capsys, ["check", spec, "--model", str(ref_dir), "--config-class", config, "--map", str(wrong)])
    assert code == 1 and "diagnosis: c_proj's matrix is used transposed" in out  # loaded the wrong way round


def test_hf_conv1d_layout_is_transposed_by_shape_and_its_cache_is_checked(ref_dir, tmp_path):
    pytest.importorskip("transformers")
    f = tmp_path / "hf_gpt2.py"
    f.write_text("from transformers import GPT2Config, GPT2LMHeadModel\n\n\n"
                 "def build(cfg):\n"
                 "    return GPT2LMHeadModel(GPT2Config(vocab_size=cfg.n_vocab, n_positions=cfg.n_ctx, "
                 "n_embd=cfg.n_embd, n_head=cfg.n_head, n_layer=cfg.n_layer, bos_token_id=0, eos_token_id=0))\n")
    report = check(f"{f}:build", ref_dir)
    assert report.ok, report.format()
    wm = report.weights
    transposed = {a.target for a in wm.assigned if a.transpose}
    assert transposed == {f"h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                          "mlp.c_proj")}  # (C, C) c_proj too
    assert report.stage("cache: 2 pieces = whole").ok


INLINE = """\
import torch
from helpers import error_lines
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        C = c.n_embd
        self.n_head = c.n_head
        self.ln_1_weight = nn.Parameter(torch.ones(C))
        self.ln_1_bias = nn.Parameter(torch.zeros(C))
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        h = F.layer_norm(x, (C,), self.ln_1_weight, self.ln_1_bias)
        q, k, v = self.c_attn(h).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Parameter(torch.zeros(c.n_vocab, c.n_embd))
        self.wpe = nn.Parameter(torch.zeros(c.n_ctx, c.n_embd))
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)

    def forward(self, idx):
        x = self.wte[idx] + self.wpe[: idx.shape[1]]
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.T
"""


def test_an_inline_model_with_bare_parameters_is_mapped_and_its_hidden_stages_skipped(ref_dir, tmp_path):
    """GPT2Config's names, bare nn.Parameters (wte, wpe, ln_1_weight), attention written inline in the block:
    the LayerNorm no module computes is not observed (and not failed); the attention is read at c_proj."""
    f = tmp_path / "inline_gpt.py"
    f.write_text(INLINE, encoding="utf-8")
    report = check(f"{f}:GPT", ref_dir)
    assert report.ok and not report.weights.unset and not report.weights.unused, report.format()
    assert report.stage("block 0 ln_1").ok is None and "not observed" in report.format()
    assert report.stage("block 1 attention").ok and report.stage("block 1 mlp").ok
    bad = tmp_path / "bad" / "inline_gpt.py"
    bad.parent.mkdir()
    bad.write_text(INLINE.replace("is_causal=True", "is_causal=False"), encoding="utf-8")
    report = check(f"{bad}:GPT", ref_dir)
    assert report.first.label == "block 0 attention" and "there is no causal mask" in report.diagnosis


def test_a_forward_that_gives_the_last_position_only_is_compared_there(ref_dir, tmp_path):
    spec, config = plant(tmp_path, NANO, ("def forward(self, idx, targets=None):", "def forward(self, idx):"),
                         ("if targets is not None:", "if False:"))
    report = check(spec, ref_dir, config_class=config)
    assert report.ok, report.format()
    assert "returns the last position's logits only" in report.format()


# --- the Python API, configs and bad input --------------------------------------------------------

def test_the_python_api_takes_objects_and_is_exported_lazily(ref_dir):
    from gpt2kit.checker.learner import import_file

    module = import_file(FIX / "blocks_style.py")
    assert gpt2kit.check is check
    report = check(module.GPT, _loaded(ref_dir), config_class=module.GPTConfig(N=7))  # N filled: 2
    assert isinstance(report, CheckReport) and report.ok, report.format()
    assert "every stage matches GPT-2 within 0.0001" in str(report)
    cfg = {"vocab_size": 1, "context_length": 1, "emb_dim": 1, "n_heads": 1, "n_layers": 1, "drop_rate": 0.0,
           "qkv_bias": False, "unrelated": "kept"}
    from gpt2kit.checker.learner import learner_config

    filled = learner_config(cfg, None, TINY)
    assert filled == {"vocab_size": 96, "context_length": 32, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
                      "drop_rate": 0.1, "qkv_bias": True, "unrelated": "kept"}


def _loaded(d: Path) -> GPT2:
    from gpt2kit.checkpoint import load_model

    return load_model(d)


def test_bad_input_is_one_line_and_exit_code_2(capsys, ref_dir, tmp_path):
    raising, config = plant(tmp_path, NANO, ("        B, T = idx.size()\n", "        B, T = idx.size()\n"
                                                                          "        raise RuntimeError('not yet')\n"))
    (tmp_path / "cfg.py").write_text("from dataclasses import dataclass\nfrom torch import nn\n\n\n@dataclass\n"
                                     "class C:\n    colour: str\n\n\nclass M(nn.Module):\n    pass\n")
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "broken.py").write_text("import nothing_here_at_all\n")
    cases = [
        ([str(tmp_path / "missing.py") + ":GPT"], "missing.py: no such file"),
        ([spec_of(NANO).replace(":GPT", ":GTP")], "has no GTP; it defines Block, CausalSelfAttention, GPT, GPTConfig"),
        ([spec_of(NANO).replace(":GPT", ":math")], "is a module; give an nn.Module class or a function"),
        ([spec_of(NANO).replace(":GPT", ":GPTConfig")], "is a class that is not an nn.Module"),
        ([str(NANO[0])], "give the learner as PATH.py:NAME"),
        ([spec_of(NANO)], "pass --config-class with your own config class or dict"),
        ([raising, "--config-class", config], "forward(ids (2, 16)) raised RuntimeError: not yet"),
        ([spec_of(NANO), "--config-class", "Nope"], "--config-class Nope:"),
        ([str(tmp_path / "cfg.py") + ":M", "--config-class", "C"], "field(s) colour have no default"),
        ([spec_of(NANO), "--config-class", "GPTConfig", "--map", str(tmp_path / "bad.json")], "expected a JSON object"),
        ([str(tmp_path / "broken.py") + ":X"], "importing it raised ModuleNotFoundError"),
        ([spec_of(NANO), "--config-class", "GPTConfig", "--model", str(tmp_path / "nowhere")], "no such directory"),
    ]
    for argv, needle in cases:
        model = [] if "--model" in argv else ["--model", str(ref_dir)]
        code, out, err = run(capsys, ["check", *argv, *model])
        assert code == 2 and out == "", (argv, out, err)
        lines = error_lines(err)
        assert needle in err and len(lines) == 1 and lines[0].startswith("gpt2kit check: error: "), err
    with pytest.raises(LearnerError, match="mapping names transformer.h.9.nope"):
        check(spec_of(NANO), ref_dir, config_class="GPTConfig", mapping={"transformer.h.9.nope": "wte.weight"})


# --- the probes' reference pieces are the spec ----------------------------------------------------

def test_the_variants_at_their_defaults_compute_what_the_model_computes():
    model = lively(TINY, seed=3)
    x = torch.randn(2, 9, TINY.n_embd)
    blk, s = model.h[1], {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        attn = var.attention(x, s["h.1.attn.c_attn.weight"], s["h.1.attn.c_attn.bias"], s["h.1.attn.c_proj.weight"],
                             s["h.1.attn.c_proj.bias"], TINY.n_head)
        assert torch.allclose(attn, blk.attn(x, CAUSAL), atol=1e-5)
        mlp = var.mlp(x, s["h.1.mlp.c_fc.weight"], s["h.1.mlp.c_fc.bias"], s["h.1.mlp.c_proj.weight"],
                      s["h.1.mlp.c_proj.bias"])
        assert torch.allclose(mlp, blk.mlp(x), atol=1e-5)
        assert torch.allclose(var.layer_norm(x, s["h.1.ln_2.weight"], s["h.1.ln_2.bias"]), blk.ln_2(x), atol=1e-5)
        assert not torch.allclose(var.attention(x, *(s[f"h.1.attn.{n}"] for n in (
            "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")), TINY.n_head, scale="none"), attn)


# --- docs/check.md runs as written ----------------------------------------------------------------

_NUMBER = re.compile(r"-?\d\.\d\de[+-]\d\d|nan")


def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


def test_docs_check_md_runs_as_written(tmp_path):
    """Every block of docs/check.md in order: python files (first line `# NAME.py`) are written, other
    python blocks run, bash blocks run as scripts (gpt2kit as `python -m gpt2kit`), and each text block
    after one is its output, numbers aside; a command exits 1 exactly when its output shows a difference."""
    blocks = _blocks((ROOT / "docs" / "check.md").read_text(encoding="utf-8"))
    last_out, ran, compared = None, 0, 0
    for lang, body in blocks:
        if lang == "python" and (m := re.match(r"# (\S+\.py)\n", body)):
            (tmp_path / m.group(1)).write_text(body, encoding="utf-8")
            continue
        if lang in ("python", "bash"):
            script = re.sub(r"(?m)^gpt2kit ", f"{sys.executable} -m gpt2kit ", body)
            argv = [sys.executable, "-c", body] if lang == "python" else ["bash", "-c", script]
            proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=ONE_THREAD, timeout=300)
            assert proc.returncode in (0, 1), (body, proc.stderr)
            assert (proc.returncode == 1) == ("DIFFERS" in proc.stdout), (body, proc.stdout, proc.stderr)
            last_out, ran = proc.stdout, ran + 1
        elif lang == "text" and last_out is not None:
            assert _NUMBER.sub("N", body.strip()) == _NUMBER.sub("N", last_out.strip()), last_out
            last_out, compared = None, compared + 1
    assert ran >= 5 and compared >= 4
