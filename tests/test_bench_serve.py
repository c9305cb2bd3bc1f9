"""benchmarks/bench_serve.py's --url path on a tiny model: a second `gpt2kit serve` stands in for an
external OpenAI-compatible server (vLLM's) and gets its own row beside gpt2kit's continuous batching;
the token count reads gpt2kit's and vLLM's chunk shapes alike. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_chunk_tokens_counts_gpt2kits_and_vllms_chunk_shapes(bench):
    ours = {"choices": [{"index": 0, "text": " the", "logprobs": {"tokens": [" the"], "token_logprobs": [-1.0],
                                                                   "top_logprobs": None, "text_offset": [0]}}]}
    # vLLM holds back the text of a token whose bytes are not yet whole; logprobs still lists it
    partial = {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["bytes:\\xe2\\x80"],
                                                                  "token_logprobs": [-2.0]}}]}
    two = {"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [0, 0]}}]}
    text_only = {"choices": [{"index": 0, "text": "x", "logprobs": None}]}
    finish = {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]}
    finish_empty_lp = {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": []}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 4}}
    assert [bench.chunk_tokens(c) for c in (ours, partial, two, text_only, finish, finish_empty_lp, usage)] == \
        [1, 1, 2, 1, 0, 0, 0]


def test_only_url_without_url_is_refused(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--only-url"])
    assert e.value.code == 2
    assert "--only-url needs --url" in capsys.readouterr().err


def test_url_runs_the_same_load_against_an_external_server(bench, tmp_path, capsys):
    from gpt2kit.checkpoint import save_model
    from gpt2kit.model import GPT2

    model = tmp_path / "tiny"
    save_model(GPT2.from_name("gpt2-tiny"), model)
    # served under another name: a request sent as "bench" would be a 404 and count as failed
    proc, url = bench.start_server(str(model), ["--served-model-name", "ext", "--max-batch", "2"])
    try:
        out = tmp_path / "r.json"
        assert bench.main(["--model", str(model), "--url", url + "/", "--url-name", "peer", "--url-model", "ext",
                           "--only-url", "--clients", "2", "--requests", "3", "--max-tokens", "4", "--rate", "100",
                           "--rounds", "1", "--ignore-eos", "--json", str(out)]) == 0
    finally:
        proc.terminate()
        proc.wait(30)
    table = capsys.readouterr().out
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines() if line.startswith("| ")][1:]
    assert rows == ["continuous batching", "peer"]  # no one-at-a-time row with --only-url
    assert "continuous batching / peer, token throughput:" in table
    assert "to the end by ignore_eos" in table  # every request still ran to --max-tokens (none failed, below)
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"continuous batching", "peer"} and r["ratio"] is None
    for name, (run,) in r["runs"].items():
        assert run["failed"] == 0, name
        assert run["tok_per_s"] > 0, name
