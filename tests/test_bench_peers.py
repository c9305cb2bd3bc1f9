"""benchmarks/bench_peers.py on a tiny model: each installed peer converts gpt2kit's checkpoint with its
own tools, runs the smallest workload in its own process, and decodes the same greedy tokens as gpt2kit
(the conversions run the same network). Skips a peer that is not installed; no timing assertions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def work(tmp_path_factory, peers):
    work = tmp_path_factory.mktemp("peers")
    peers.save_checkpoint(work / "checkpoint", "gpt2-tiny")
    return work


@pytest.mark.parametrize("peer", ["ctranslate2", "onnxruntime", "llama.cpp"])
def test_each_installed_peer_runs_the_smallest_workload(peers, work, peer):
    if peers.missing(peer):
        pytest.skip(f"{peer}: {peers.missing(peer)}")
    r = peers.run(threads=1, trials=1, new_tokens=2, prefill=16, size="gpt2-tiny", engines=("gpt2kit", peer),
                  workloads=("decode_b1",), dtypes=("float32", "int8"), work=work, bandwidth=False, log=lambda s: None)
    assert r["skipped"] == {}
    got = r["tok_s"]["decode_b1"]
    assert set(got) == {f"{e}/{d}" for e in ("gpt2kit", peer) for d in ("float32", "int8")}
    assert all(v > 0 for v in got.values())
    table = peers.format_table(r)
    assert "| decode batch 1 (2 new), float32 |" in table and "x (" in table and r["machine"]["describe"] in table


@pytest.mark.parametrize("peer", ["ctranslate2", "onnxruntime"])
def test_a_peers_conversion_decodes_gpt2kits_greedy_tokens(peers, work, peer):
    if peers.missing(peer):
        pytest.skip(f"{peer}: {peers.missing(peer)}")
    prompts = [[(97 * b + 13 * i) % 50000 for i in range(peers.PROMPT)] for b in range(3)]
    ours = peers.Gpt2kit(work / "checkpoint", "float32", 1).decode(prompts, 6)
    engine = peers.CLASSES[peer](peers.convert(peer, "float32", work / "checkpoint", work), "float32", 1)
    assert engine.decode(prompts, 6) == ours
    engine.prefill(list(range(64)))  # runs (no output to compare: its logits stay inside the engine)


def test_bad_settings_are_one_line(peers, capsys):
    assert peers.main(["--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "bench_peers: error: --threads must be an integer >= 1, got 0"
    assert peers.main(["--trials", "0"]) == 2
    assert "--trials must be an integer >= 1, got 0" in capsys.readouterr().err


def test_gpt2kits_int8_activation_mode_is_a_contender_for_int8_only(peers, work):
    r = peers.run(threads=1, trials=1, new_tokens=2, prefill=16, size="gpt2-tiny", engines=("gpt2kit", "gpt2kit-a8"),
                  workloads=("decode_b1",), dtypes=("float32", "int8"), work=work, bandwidth=False, log=lambda s: None)
    assert r["skipped"] == {}
    assert set(r["tok_s"]["decode_b1"]) == {"gpt2kit/float32", "gpt2kit/int8", "gpt2kit-a8/int8"}
    table = peers.format_table(r)
    assert "| gpt2kit | gpt2kit int8-act. | ctranslate2 |" in table and "gpt2kit int8-act. / best peer |" in table
    prompts = [[(97 * b + 13 * i) % 50000 for i in range(peers.PROMPT)] for b in range(2)]
    a8 = peers.Gpt2kitA8(work / "checkpoint", "int8", 1)
    assert len(a8.decode(prompts, 3)[1]) == 3 and "int8 activations" in repr(a8.model.h[0].mlp.c_fc)
