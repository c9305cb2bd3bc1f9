"""lm-evaluation-harness' `local-completions` model against the server, on a 30-item multiple-choice
task shipped in tests/fixtures (no download): its per-item log-likelihoods equal direct scoring with
gpt2kit.score within 1e-4 (sums over the continuation's tokens, float32)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from helpers import SMALL, live_server, random_model  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.score import score_tokens  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402

DATA = Path(__file__).parent / "fixtures" / "lm_eval_mc.jsonl"
TASK = """task: gpt2kit_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
"""


def _direct(model, tok, context: str, continuation: str) -> float:
    """ln p(continuation | context), tokenised as lm-eval does for causal models (trailing spaces of
    the context move to the continuation; the whole text is encoded, then split)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation)
    ctx = len(tok.encode(context))
    lps = score_tokens(model, whole[1:], eot_token=whole[0])  # lps[i] scores whole[i + 1]
    return math.fsum(lps[ctx - 1:])


def test_lm_eval_local_completions_loglikelihoods_equal_direct_scoring(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    d = tmp_path / "model"
    save_model(random_model(SMALL, seed=2), d)  # GPT-2's init: log-probs of order 1-10
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "gpt2kit_mc.yaml").write_text(TASK.format(data=DATA))
    model, tok = load_model(d), load_tokenizer(d)
    with live_server(lambda: (load_model(d), load_tokenizer(d)), ServeOptions(served_model_name="tiny")) as (url, _):
        from lm_eval.tasks import TaskManager

        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=tiny,base_url={url}/v1/completions,tokenizer={d},tokenizer_backend=huggingface,"
                       "tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=63",
            tasks=["gpt2kit_mc"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
            log_samples=True, cache_requests=False)
    samples = out["samples"]["gpt2kit_mc"]
    assert len(samples) == 30
    worst = 0.0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
            got = resp[0][0]
            worst = max(worst, abs(got - _direct(model, tok, context, continuation)))
    assert worst < 1e-4, worst
    assert 0 <= out["results"]["gpt2kit_mc"]["acc,none"] <= 1
