"""Shared test fixtures: small random GPT-2 models in our layout and in transformers'."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from gpt2kit.checkpoint.keymap import is_transposed
from gpt2kit.config import GPT2Config
from gpt2kit.model import GPT2

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
warnings.filterwarnings("ignore", message=".*bos_token_id.*")

TINY = GPT2Config(n_vocab=1000, n_ctx=64, n_embd=32, n_head=4, n_layer=2)


def hf_config(cfg: GPT2Config):
    from transformers import GPT2Config as HFConfig

    eot = cfg.eot_id
    return HFConfig(vocab_size=cfg.n_vocab, n_positions=cfg.n_ctx, n_embd=cfg.n_embd, n_head=cfg.n_head,
                    n_layer=cfg.n_layer, layer_norm_epsilon=cfg.layer_norm_eps, bos_token_id=eot,
                    eos_token_id=eot, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def random_hf_model(cfg: GPT2Config = TINY, seed: int = 0):
    """A transformers GPT2LMHeadModel with random weights (biases and LayerNorms randomised too)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(hf_config(cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)  # GPT-2's init leaves these constant; test them anyway
    return hf


def hf_from_ours(model: GPT2):
    """A transformers GPT2LMHeadModel holding our model's weights (copied independently of our loaders)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_config(model.config)).eval()
    sd = {}
    for name, t in model.state_dict().items():
        if name == "wte.weight":
            t = t[: model.config.n_vocab]
        sd["transformer." + name] = t.t() if is_transposed(name) else t
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "attn.masked_bias", "lm_head.weight")) for k in missing)
    hf.tie_weights()
    return hf.to(next(model.parameters()).dtype)


def random_model(cfg: GPT2Config = TINY, seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    m = GPT2(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


@pytest.fixture
def tiny_model() -> GPT2:
    return random_model()


def cached_real_gpt2() -> str | None:
    """The hub name under which the real gpt2 weights sit in the local HF cache, or None."""
    from pathlib import Path

    from gpt2kit.checkpoint.hub import hub_cache_dir

    hub = Path(hub_cache_dir())
    for name in ("openai-community/gpt2", "gpt2"):
        if (hub / ("models--" + name.replace("/", "--")) / "snapshots").is_dir():
            return name
    return None


needs_real_gpt2 = pytest.mark.skipif(cached_real_gpt2() is None,
                                     reason="the real gpt2 weights are not in the local HF cache")
