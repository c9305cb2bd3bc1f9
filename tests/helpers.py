"""What the tests share: small random GPT-2 models in our layout and in transformers', models whose
greedy output varies, the real-weights skip marker, a live server, and a command's stderr without
its stage lines.

Tests import these by name (`from helpers import random_model`); conftest.py holds only pytest's
set-up and fixtures.
"""

from __future__ import annotations

import contextlib
import math
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gpt2kit.checkpoint.keymap import is_transposed
from gpt2kit.config import GPT2Config
from gpt2kit.model import GPT2

TINY = GPT2Config(n_vocab=1000, n_ctx=64, n_embd=32, n_head=4, n_layer=2)

_STAGE = re.compile(r"gpt2kit [a-z-]+: (?!error: |warning: )")


def error_lines(err: str) -> list[str]:
    """A command's stderr without the lines naming its stages (`gpt2kit score: loading M`, one per
    stage off a terminal: gpt2kit.progress): its errors and warnings."""
    return [line for line in err.strip().splitlines() if not _STAGE.match(line)]


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


def saved_hf_base(tmp_path, cfg: GPT2Config = TINY, seed: int = 2):
    """random_hf_model saved as an HF directory, tmp_path / "base" (the base the adapter tests adapt)."""
    path = tmp_path / "base"
    random_hf_model(cfg, seed=seed).save_pretrained(path)
    return path


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


def cached_real_gpt2() -> str | None:
    """The hub name under which the real gpt2 weights sit in the local HF cache, or None."""
    from gpt2kit.checkpoint.hub import hub_cache_dir

    hub = Path(hub_cache_dir())
    for name in ("openai-community/gpt2", "gpt2"):
        if (hub / ("models--" + name.replace("/", "--")) / "snapshots").is_dir():
            return name
    return None


needs_real_gpt2 = pytest.mark.skipif(cached_real_gpt2() is None,
                                     reason="the real gpt2 weights are not in the local HF cache")


# Models for the generation tests whose greedy output is not one token repeated. GPT-2's own init
# (N(0, 0.02), tied embeddings) makes a random model echo its last token forever, which would let a
# broken sampler pass; larger weights give varied, input-dependent sequences.
# GPT-2's vocabulary (so the tokenizer can decode), tiny everything else.
SMALL = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2)


def varied_model(cfg: GPT2Config = SMALL, seed: int = 0, scale: float = 2.0) -> GPT2:
    torch.manual_seed(seed)
    m = GPT2(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("wte.weight", "wpe.weight"):
                p.normal_(0, scale)
            elif p.dim() == 2:
                p.normal_(0, scale / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return m



def greedy_with_logits(model, prompt: list[int], interventions, n: int) -> tuple[list[int], torch.Tensor]:
    """gpt2kit's greedy generate of n tokens after prompt under interventions: the tokens and each step's
    last-position logits (n, V), read off the model's forward as the engine runs it (cache and all)."""
    from gpt2kit import SamplingSettings, generate

    seen = []
    h = model.register_forward_hook(lambda mod, args, out: seen.append(out.logits[0, -1].detach().clone()))
    try:
        toks = generate(model, [prompt], SamplingSettings(temperature=0.0, max_new_tokens=n, stop_token_ids=()),
                        interventions=interventions)[0].tokens
    finally:
        h.remove()
    return toks, torch.stack(seen[:n])

# A live gpt2kit server: uvicorn in a thread on a free 127.0.0.1 port.
@contextlib.contextmanager
def live_server(loader, opts=None, *, wait_ready: bool = True):
    import httpx

    from gpt2kit.serve import create_app, make_server

    app = create_app(loader, opts)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, log_level="warning")  # the CLI's server: its timeouts, drain and Host check
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    if wait_ready:
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts and opts.api_key else {}
        while time.monotonic() < deadline:
            if httpx.get(url + "/health", headers=headers).status_code == 200:
                break
            time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def train_one_and_two_ranks(common: list[str], batch_size: int, one_out, two_out) -> None:
    """`gpt2kit train *common` once in one process at batch_size and once under torchrun on 2 gloo ranks
    at batch_size // 2 (the same global batch), one thread each; skips where gloo is missing, fails
    with the failing run's stderr."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = {"PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    one = subprocess.run([sys.executable, "-m", "gpt2kit", "train", *common, "--batch-size", str(batch_size),
                          "--out", str(one_out)], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "gpt2kit", "train", *common, "--batch-size", str(batch_size // 2), "--out",
                          str(two_out)], capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr
