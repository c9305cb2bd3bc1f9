"""gpt2kit serve with LoRA adapters beside the base (--lora NAME=DIR): each adapter a model name in
/v1/models with the base as parent; rows of different adapters and of the base decode in one batch,
each one's greedy tokens equal to its adapter merged into the base and decoded alone, its log-probs
within 1e-4; an unknown name is a 404 naming `model`; bad adapters stop the server at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from helpers import TINY, error_lines, live_server, varied_model  # noqa: E402
from test_multi_lora import make_adapter  # noqa: E402

from gpt2kit.checkpoint import load_model, load_tokenizer, save_model  # noqa: E402
from gpt2kit.engine import Engine  # noqa: E402
from gpt2kit.sampling import SamplingSettings  # noqa: E402
from gpt2kit.serve import ServeOptions  # noqa: E402
from gpt2kit.serve.runner import add_loras  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = save_model(varied_model(TINY, seed=3), d / "base")
    return base, make_adapter(d / "a", 2, "c_attn", 1), make_adapter(d / "b", 4, "c_attn,c_fc,mlp.c_proj", 2, alpha=3)


@pytest.fixture(scope="module")
def server(dirs):
    base, a, b = dirs
    opts = ServeOptions(served_model_name="base", max_batch=8, loras=(("sql", str(a)), ("poet", str(b))))

    def loader():
        model = load_model(base)
        add_loras(model, opts.loras)
        return model, load_tokenizer(base)

    with live_server(loader, opts) as (url, _):
        yield url


def alone(model, prompt):
    """The prompt decoded greedily alone on a (merged) model: tokens and their log-probs."""
    engine = Engine(model)
    row = engine.new_row(prompt, SamplingSettings(max_new_tokens=8, temperature=0, stop_token_ids=()),
                         logprobs=0)
    engine.submit([row])
    events = []
    while engine.has_work:
        events += engine.step()
    return [e.token for e in events], [e.logprob for e in events]


def test_models_lists_each_adapter_with_the_base_as_parent(server, dirs):
    cards = httpx.get(server + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("sql", "base"), ("poet", "base")]
    assert cards[1]["root"] == str(dirs[1])
    assert httpx.get(server + "/v1/models/poet").json()["parent"] == "base"


def test_rows_of_adapters_and_base_in_one_batch_equal_each_served_alone_merged(server, dirs):
    base, a, b = dirs
    names = ["base", "sql", "poet", "sql", "base", "poet", "sql", "poet"]
    prompts = [[5 + i, 9, 2 * i + 1, 40, 7][: 3 + i % 3] for i in range(len(names))]
    results: dict[int, dict] = {}

    def ask(i):
        body = {"model": names[i], "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "logprobs": 0}
        results[i] = httpx.post(server + "/v1/completions", json=body, timeout=120).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = {"base": load_model(base), "sql": load_model(base, adapter=a), "poet": load_model(base, adapter=b)}
    tok = load_tokenizer(base)
    outputs = set()
    for i, name in enumerate(names):
        choice = results[i]["choices"][0]
        assert results[i]["model"] == name
        tokens, logprobs = alone(merged[name], prompts[i])
        assert choice["text"] == tok.decode(tokens)
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(logprobs),
                                   atol=1e-4, rtol=0)
        outputs.add((name, choice["text"]))
    assert len({text for _, text in outputs}) > 1  # the adapters change what is decoded


def test_an_unknown_model_is_a_404_naming_model_and_contrastive_on_an_adapter_a_400(server):
    r = httpx.post(server + "/v1/completions", json={"model": "nope", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "`nope` does not exist" in err["message"] and "`sql`" in err["message"]
    r = httpx.post(server + "/v1/completions", json={"model": "sql", "prompt": [1, 2], "max_tokens": 2,
                                                      "penalty_alpha": 0.6, "top_k": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "penalty_alpha"


@pytest.mark.parametrize("lora, words", [("sql", "--lora takes NAME=DIR"), ("x={missing}", "no adapter_config.json")])
def test_a_bad_lora_stops_the_cli_before_the_server_starts(dirs, tmp_path, lora, words):
    lora = lora.format(missing=tmp_path / "missing")
    p = subprocess.run([sys.executable, "-m", "gpt2kit", "serve", "--model", str(dirs[0]), "--lora", lora],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    [line] = error_lines(p.stderr)
    assert words in line


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match="more than max_loras=1"):
        ServeOptions(loras=(("a", "x"), ("b", "y")), max_loras=1)
    with pytest.raises(ValueError, match="name 'gpt2' must be non-empty, unique and not the base's"):
        ServeOptions(loras=(("gpt2", "x"),))
    with pytest.raises(ValueError, match="not served with speculative decoding"):
        ServeOptions(loras=(("a", "x"),), prompt_lookup=2)


def test_an_adapter_for_another_base_stops_the_server_at_load_naming_the_tensor(dirs, tmp_path):
    from gpt2kit.config import GPT2Config

    other = save_model(varied_model(GPT2Config(n_vocab=1000, n_ctx=64, n_embd=48, n_head=4, n_layer=2)), tmp_path / "o")
    p = subprocess.run([sys.executable, "-m", "gpt2kit", "serve", "--model", str(other), "--port", "0",
                        "--lora", f"sql={dirs[1]}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    [line] = [x for x in p.stderr.splitlines() if x.startswith("gpt2kit serve: error:")]  # beside uvicorn's log
    assert "lora_A.weight has shape" in line and "made for another base" in line


# --- adapters loaded and unloaded while the server runs (--allow-runtime-lora; vLLM's routes) ---

KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def runtime(dirs):
    base, a, _ = dirs
    opts = ServeOptions(served_model_name="base", max_batch=8, loras=(("sql", str(a)),), max_loras=2,
                        allow_runtime_lora=True, api_key="k")

    def loader():
        model = load_model(base)
        add_loras(model, opts.loras)
        return model, load_tokenizer(base)

    with live_server(loader, opts) as (url, _):
        yield url


def _load(url, name, path, headers=KEY):
    return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=60)


def _unload(url, name):
    return httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=KEY, timeout=120)


def _greedy(url, model, prompt, n=8):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0}
    return httpx.post(url + "/v1/completions", json=body, headers=KEY, timeout=120)


def _ids(url):
    return [c["id"] for c in httpx.get(url + "/v1/models", headers=KEY).json()["data"]]


def test_an_adapter_loaded_at_runtime_serves_as_one_given_at_start_up_then_unloaded_is_a_404(runtime, dirs):
    base, a, b = dirs
    r = _load(runtime, "sql2", a)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'sql2' added successfully."
    assert _ids(runtime) == ["base", "sql", "sql2"]
    assert httpx.get(runtime + "/v1/models/sql2", headers=KEY).json()["root"] == str(a)
    prompt = [5, 9, 2, 40, 7]
    at_start, loaded = _greedy(runtime, "sql", prompt).json(), _greedy(runtime, "sql2", prompt).json()
    assert loaded["choices"][0]["text"] == at_start["choices"][0]["text"]
    assert loaded["choices"][0]["logprobs"]["token_logprobs"] == at_start["choices"][0]["logprobs"]["token_logprobs"]
    r = _unload(runtime, "sql2")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql2' removed successfully."
    assert _ids(runtime) == ["base", "sql"]
    r = _greedy(runtime, "sql2", prompt)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _unload(runtime, "sql2").status_code == 404
    r = _load(runtime, "poet", b)  # the freed slot takes another adapter, which runs as itself
    assert r.status_code == 200
    tokens, logprobs = alone(load_model(base, adapter=b), prompt)
    choice = _greedy(runtime, "poet", prompt).json()["choices"][0]
    assert choice["text"] == load_tokenizer(base).decode(tokens)
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(logprobs),
                               atol=1e-4, rtol=0)
    assert _unload(runtime, "poet").status_code == 200


def test_unloading_an_adapter_lets_its_running_rows_finish_on_it(runtime, dirs):
    base, a, _ = dirs
    assert _load(runtime, "tmp", a).status_code == 200
    prompt, n = [1, 2, 3], 48
    want = _greedy(runtime, "tmp", prompt, n).json()["choices"][0]["text"]
    got, unloaded = [], {}
    body = {"model": "tmp", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    with httpx.stream("POST", runtime + "/v1/completions", json=body, headers=KEY, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got.append(json.loads(line[6:])["choices"][0]["text"])
                if len(got) == 1:  # mid-generation: the unload waits for this row
                    t = threading.Thread(target=lambda: unloaded.update(r=_unload(runtime, "tmp")))
                    t.start()
    t.join()
    assert "".join(got) == want
    assert unloaded["r"].status_code == 200 and "tmp" not in _ids(runtime)


def test_a_bad_adapter_is_a_400_naming_it_and_nothing_changes(runtime, dirs, tmp_path):
    from gpt2kit.config import GPT2Config

    before = _ids(runtime)
    other = make_adapter(tmp_path / "other", 2, "c_attn", 1, bias="all")
    cases = [(tmp_path / "missing", "no adapter_config.json"), (other, "trains biases"),
             (dirs[1], "already been loaded", "sql")]
    wide = GPT2Config(n_vocab=1000, n_ctx=64, n_embd=48, n_head=4, n_layer=2)
    from gpt2kit.checkpoint import save_adapter
    from gpt2kit.lora import apply_lora
    cases.append((save_adapter(apply_lora(varied_model(wide), 2, targets="c_attn"), tmp_path / "w"),
                  "made for another base"))
    for path, words, *name in cases:
        r = _load(runtime, name[0] if name else "x", path)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert _ids(runtime) == before
    assert _greedy(runtime, "sql", [1, 2]).status_code == 200  # still serving


def test_loading_beyond_max_loras_is_a_400_naming_the_limit(runtime, dirs):
    assert _load(runtime, "one", dirs[2]).status_code == 200
    r = _load(runtime, "two", dirs[2])
    assert r.status_code == 400 and "--max-loras 2" in r.json()["error"]["message"]
    assert "two" not in _ids(runtime)
    assert _unload(runtime, "one").status_code == 200


def test_runtime_loading_needs_the_key_and_the_flag(runtime, server, dirs):
    assert _load(runtime, "x", dirs[1], headers={}).status_code == 401
    assert httpx.post(runtime + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 401
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # without --allow-runtime-lora: not served
        assert httpx.post(server + path, json={"lora_name": "x", "lora_path": str(dirs[1])}).status_code == 404
    assert _ids(runtime)[:2] == ["base", "sql"]
