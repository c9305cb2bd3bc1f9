"""gpt2kit explore's JSON routes and command: the stage values are the trace's tensors (and what the
network's own modules compute from them), generation on the KV cache gives the full forward's
logits, bad values are 400s naming them, and the command serves on loopback and stops."""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL, error_lines, varied_model

from gpt2kit import save_model
from gpt2kit.tokenizer import Tokenizer
from gpt2kit.trace import ablate, trace

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from gpt2kit.serve.explore_app import create_app
from gpt2kit.trace.explore import Explorer
from gpt2kit.trace.report import token_text

ROOT = Path(__file__).resolve().parents[1]
TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def model():
    return varied_model(SMALL)


@pytest.fixture(scope="module")
def client(model):
    return TestClient(create_app(Explorer(model, Tokenizer.default(), name="small")))


def _f32(b64: str) -> torch.Tensor:
    import base64

    return torch.from_numpy(np.frombuffer(base64.b64decode(b64), dtype="<f4").copy())


def _stages(client, **kw) -> dict:
    r = client.post("/api/stages", json={"text": TEXT, **kw})
    assert r.status_code == 200, r.text
    return {s["key"]: s for s in r.json()["stages"]}


def _block(s: dict) -> torch.Tensor:
    return torch.tensor([[float(x) for x in row] for row in s["values"]], dtype=torch.float64)


def test_stage_values_are_the_trace_tensors(client, model):
    """Every stage of block 1, head 2, position 9 (all rows up to it, every column) against trace()'s
    tensors within 1e-5, and the stages the network never materialises against its own modules."""
    tr = trace(model, Tokenizer.default(), TEXT)
    T, C, nh = len(tr.ids), SMALL.n_embd, SMALL.n_head
    layer, head, pos = 1, 2, 9
    st = _stages(client, layer=layer, head=head, position=pos, rows=T, cols=4 * C)
    assert [k for k in st][:6] == ["input", "ln_1.mean", "ln_1.var", "ln_1.norm", "ln_1", "qkv"]
    assert st["masked"]["fn"] == "mask_attn_weights" and st["merged"]["fn"] == "merge_heads"
    assert st["q"]["shape"] == "(nh, T, d_h)" and st["q"]["dims"] == [nh, T, C // nh]
    assert st["mlp.pre"]["dims"] == [T, 4 * C] and st["qkv"]["shape"] == "(T, 3C)"
    assert st["input"]["rows"] == list(range(pos + 1))

    def close(key, want):
        got, want = _block(st[key]), want.double()[: pos + 1]
        want = want[:, : got.shape[1]] if key not in ("qk", "scaled", "masked", "probs") else want[:, : pos + 1]
        assert got.shape == want.shape, key
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), key
        assert torch.allclose(got[finite], want[finite], atol=1e-5, rtol=0), key

    p = f"h.{layer}."
    blk = model.h[layer]
    with torch.no_grad():
        close("input", tr[f"resid.{layer}"])
        x = tr[f"resid.{layer}"]
        close("ln_1.mean", x.mean(-1, keepdim=True))
        close("ln_1.var", x.var(-1, unbiased=False, keepdim=True))
        close("ln_1.norm", torch.nn.functional.layer_norm(x, (C,), eps=blk.ln_1.eps))
        close("ln_1", tr[p + "ln_1"])
        close("qkv", blk.attn.c_attn(tr[p + "ln_1"]))  # the module itself, not the trace's split
        for n in "qkv":
            close(n, tr[p + f"attn.{n}"][head])
        q, k = tr[p + "attn.q"][head], tr[p + "attn.k"][head]
        close("qk", q @ k.T)
        close("scaled", (q @ k.T) / math.sqrt(C // nh))
        close("masked", tr[p + "attn.scores"][head])
        close("probs", tr[p + "attn.probs"][head])
        close("z", tr[p + "attn.z"][head])
        merged = tr[p + "attn.z"].transpose(0, 1).reshape(T, C)
        close("merged", merged)
        close("attn.out", blk.attn.c_proj(merged))
        for key in ("attn.out", "resid_mid", "ln_2", "mlp.pre", "mlp.post", "mlp.out"):
            close(key, tr[p + key])
        close("output", tr[f"resid.{layer + 1}"])
        close("ln_f", tr["ln_f"])
        close("logits", tr.logits)
    assert st["masked"]["values"][0][1] == "-inf"  # position 0 may not read position 1
    want = torch.softmax(tr.logits[pos].double(), -1).topk(10)
    assert [i for i, _ in st["next"]["top"]] == want.indices.tolist()
    assert [q for _, q in st["next"]["top"]] == pytest.approx(want.values.tolist(), abs=1e-6)


def _close(got, want, key: str, rel: float = 1e-4) -> None:
    """Numbers rounded to 5 significant digits against the trace's: within half a unit of the fifth digit."""
    got, want = torch.tensor(got, dtype=torch.float64), torch.as_tensor(want).double()
    assert got.shape == want.shape, key
    assert torch.allclose(got, want, rtol=rel, atol=1e-7), key


def test_the_views_are_the_trace_views(client, model):
    """/api/trace and /api/lens, what the page draws, against trace()'s views and tensors."""
    import base64

    tr = trace(model, Tokenizer.default(), TEXT)
    T, nh, L = len(tr.ids), SMALL.n_head, SMALL.n_layer
    r = client.post("/api/trace", json={"text": TEXT}).json()
    v = r["views"]
    assert r["ids"] == tr.ids and v["tokens"] == tr.tokens and v["lens"] is None  # the lens comes second
    stats = tr.next_token_stats()
    assert v["stats"]["top_ids"] == stats["top_ids"] and v["stats"]["next_rank"] == stats["next_rank"]
    for key in ("top_probs", "surprisal_bits", "next_logprob"):
        _close(v["stats"][key], stats[key], key)
    dla = tr.direct_logit_attribution()
    assert v["dla"]["labels"] == dla["labels"] and v["dla"]["tokens"] == dla["tokens"]
    _close(v["dla"]["values"], dla["values"], "dla")
    _close(v["dla"]["logit"], tr.logits.gather(-1, torch.tensor(dla["tokens"])[:, None])[:, 0], "logit")
    _close(v["norms"]["values"], torch.stack([tr[f"resid.{i}"].norm(dim=-1) for i in range(L + 1)]), "norms")
    A = v["attention"]
    assert A["shape"] == [L, nh, T, T] and A["omitted"] == []
    u8 = torch.frombuffer(bytearray(base64.b64decode(A["u8"])), dtype=torch.uint8).view(L, nh, T, T)
    probs = torch.stack([tr[f"h.{i}.attn.probs"] for i in range(L)])
    assert (u8.double() / 255 - probs.double()).abs().max() <= 0.5 / 255 + 1e-6  # the nearest of 256 levels
    assert torch.allclose(_f32(v["sampling"]["logits"]), tr.logits[-1])
    assert all(v["vocab"][str(i)] == token_text(tr.tokenizer, i) for i in stats["top_ids"][-1])
    lens = client.post("/api/lens", json={"text": TEXT}).json()
    want = tr.logit_lens(k=5)
    assert lens["lens"]["top_ids"] == want["top_ids"] and lens["lens"]["next_rank"] == want["next_rank"]
    _close(lens["lens"]["top_probs"], want["top_probs"], "lens")
    _close(lens["lens"]["next_prob"], want["next_prob"], "lens next")
    assert set(lens["vocab"]) == {str(i) for layer in want["top_ids"] for row in layer for i in row}


def test_stage_windows_end_at_the_position(client):
    st = _stages(client, layer=0, head=0, position=12, rows=3, cols=5)
    assert st["input"]["rows"] == [10, 11, 12] and st["input"]["cols"] == [0, 1, 2, 3, 4]
    assert st["probs"]["cols"] == [8, 9, 10, 11, 12]  # the keys up to the query
    assert st["ln_1.mean"]["cols"] == [0]


def test_generation_reuses_the_cache_and_equals_the_full_forward(client, model):
    """A text the page has traced starts from the trace's keys and values (no forward pass of its own), one
    it has not from a forward pass: both give the full forward's logits, and so does the step after."""
    tok = Tokenizer.default()
    ids = tok.encode(TEXT)
    client.post("/api/trace", json={"text": TEXT})
    r = client.post("/api/gen/start", json={"text": TEXT}).json()
    assert r["cache_length"] == len(ids) and r["prompt_length"] == len(ids)
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(_f32(r["logits"]), full, atol=1e-4)
    assert r["greedy"] == int(full.argmax())
    g = client.post("/api/gen/append", json={"session": r["session"], "mode": "greedy"}).json()
    assert g["appended"] == int(full.argmax()) and g["cache_length"] == len(ids) + 1
    assert g["ids"] == [*ids, g["appended"]]
    with torch.no_grad():
        full2 = model(torch.tensor([g["ids"]])).logits[0, -1]
    assert torch.allclose(_f32(g["logits"]), full2, atol=1e-4)
    # sampled: the same seed and context draw the same token, from the kept tokens only
    settings = {"mode": "sample", "temperature": 1.5, "top_k": 3, "seed": 7}
    a = client.post("/api/gen/append", json={"session": g["session"], **settings}).json()
    b_start = client.post("/api/gen/start", json={"text": tok.decode(g["ids"])}).json()  # not traced
    assert b_start["ids"] == g["ids"]
    assert torch.allclose(_f32(b_start["logits"]), full2, atol=1e-4)
    b = client.post("/api/gen/append", json={"session": b_start["session"], **settings}).json()
    assert a["appended"] == b["appended"] and a["appended"] in full2.topk(3).indices.tolist()
    assert a["cache_length"] == len(ids) + 2


def test_bad_values_are_400s_naming_them(client):
    def err(path, body, status=400):
        r = client.post(path, json=body)
        assert r.status_code == status, r.text
        return r.json()["error"]["message"]

    assert "empty" in err("/api/trace", {"text": ""})
    long = " a" * (SMALL.n_ctx + 1)
    assert f"n_ctx={SMALL.n_ctx}" in err("/api/trace", {"text": long})
    assert "layer 2 is outside [0, 2)" in err("/api/stages", {"text": TEXT, "layer": 2})
    assert "head 4 is outside [0, 4)" in err("/api/stages", {"text": TEXT, "head": 4})
    assert "position 99" in err("/api/stages", {"text": TEXT, "position": 99})
    assert "no generation session" in err("/api/gen/append", {"session": "nope"}, 404)
    s = client.post("/api/gen/start", json={"text": TEXT}).json()["session"]
    assert "temperature" in err("/api/gen/append", {"session": s, "mode": "sample", "temperature": -1})
    assert "mode must be greedy or sample" in err("/api/gen/append", {"session": s, "mode": "beam"})
    assert "unknown name" in err("/api/intervene", {"text": TEXT, "ablate": ["h.0.nothing"]})
    assert err("/api/stages", {"text": TEXT, "layer": "one"}).startswith("layer: ")  # the field, named
    assert err("/api/gen/start", {}).startswith("text: ")
    r = client.get("/", headers={"Host": "attacker.example"})
    assert r.status_code == 200  # TestClient's server is not loopback: the Host check is for loopback servers


def test_a_text_too_big_to_record_says_to_shorten_it(model, monkeypatch):
    import gpt2kit.trace.record as record

    monkeypatch.setattr(record, "DEFAULT_MAX_BYTES", 2**20)
    ex = Explorer(model, Tokenizer.default())
    with pytest.raises(ValueError, match=r"for 14 tokens needs ~\d+ MiB, over the limit of 1 MiB: use a shorter text"):
        ex.views(TEXT)


def test_a_full_context_says_so(model):
    ex = Explorer(model, Tokenizer.default())
    text = " the" * SMALL.n_ctx
    assert len(Tokenizer.default().encode(text)) == SMALL.n_ctx
    s = ex.gen_start(text)
    assert s["cache_length"] == SMALL.n_ctx
    with pytest.raises(ValueError, match="the context is full"):
        ex.gen_append(s["session"], "greedy")


def test_an_int8_model_explores_with_its_own_numbers(model, monkeypatch):
    """--quantize int8: the stages are the int8 model's trace, the cached decode its full forward (on
    float32 products: a kernel this machine might choose, i8pack-bf16, rounds activations to bfloat16,
    which would differ by more than the comparison's tolerance between a one-row step and a prompt)."""
    from gpt2kit.quant.modules import quantize_model

    monkeypatch.setenv("GPT2KIT_INT8_KERNEL", "dequant")

    q = quantize_model(varied_model(SMALL), "int8")
    c = TestClient(create_app(Explorer(q, Tokenizer.default(), name="int8")))
    tr = trace(q, Tokenizer.default(), TEXT)
    st = {s["key"]: s for s in c.post("/api/stages", json={"text": TEXT, "layer": 1, "position": 4, "rows": 5,
                                                            "cols": 4 * SMALL.n_embd}).json()["stages"]}
    assert torch.allclose(_block(st["mlp.out"]), tr["h.1.mlp.out"][:5].double(), atol=1e-5, rtol=0)
    assert not torch.allclose(tr.logits, trace(model, Tokenizer.default(), TEXT).logits, atol=1e-3)  # int8 differs
    g = c.post("/api/gen/start", json={"text": TEXT}).json()
    g = c.post("/api/gen/append", json={"session": g["session"]}).json()
    with torch.no_grad():
        full = q(torch.tensor([g["ids"]])).logits[0, -1]
    assert torch.allclose(_f32(g["logits"]), full, atol=1e-3)


def test_interventions_compare_with_the_trace(client, model):
    r = client.post("/api/intervene", json={"text": TEXT, "ablate": ["h.1.attn.head.0"]}).json()
    tr = trace(model, Tokenizer.default(), TEXT, interventions=[ablate("h.1.attn.head.0")])
    clean = torch.softmax(tr.clean.logits[-1].double(), -1)
    changed = torch.softmax(tr.logits[-1].double(), -1)
    for i, pc, pi in r["rows"]:
        assert pc == pytest.approx(float(clean[i]), abs=1e-6) and pi == pytest.approx(float(changed[i]), abs=1e-6)
    s = client.post("/api/intervene", json={"text": TEXT, "steer": {"name": "h.1.resid", "text": " love",
                                                                     "scale": 30}}).json()
    assert s["kl_last"] > 0 and "h.1.resid" in s["interventions"][0]


def test_the_page_is_one_self_contained_file(client):
    from test_trace_report import FETCH

    r = client.get("/")
    assert r.status_code == 200 and "<script" in r.text
    assert not FETCH.search(r.text) and "http:" not in r.text and "https:" not in r.text
    assert '"n_layer":2' in r.text


# --- the command ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("explore_model")
    save_model(model, d)
    return d


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def test_cli_explore_bad_port_and_port_in_use(model_dir):
    p = subprocess.run([sys.executable, "-m", "gpt2kit", "explore", "--model", str(model_dir), "--port", "70000"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode != 0 and error_lines(p.stderr) == ["gpt2kit explore: error: --port must be in [0, 65535], "
                                                           "got 70000"]
    from gpt2kit.serve.explore_app import bind

    sock = bind(0)
    try:
        port = sock.getsockname()[1]
        sock.listen()
        p = subprocess.run([sys.executable, "-m", "gpt2kit", "explore", "--model", "/nonexistent", "--port",
                            str(port)], capture_output=True, text=True, timeout=120, env=ENV)
    finally:
        sock.close()
    lines = error_lines(p.stderr)
    assert p.returncode == 1 and len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0]


def served(argv: list[str], cwd=None, timeout: float = 120.0, env=None):
    """Start `gpt2kit explore` (argv after `explore`), return (process, URL, the line) once it prints its URL."""
    import selectors

    proc = subprocess.Popen([sys.executable, "-m", "gpt2kit", "explore", *argv], cwd=cwd, env=env or ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if "http://127.0.0.1:" in line:
                return proc, line.split()[2], line
            if not line:
                break
        if proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"explore did not print its URL: {proc.stderr.read()}")


def stop(proc) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_cli_explore_serves_on_loopback_and_stops(model_dir, tmp_path):
    import httpx

    opened = tmp_path / "opened"
    opener = tmp_path / "browser.py"  # what webbrowser runs for --open: it writes down the URL it was given
    opener.write_text(f"import sys\nopen({str(opened)!r}, 'w').write(sys.argv[1])\n")
    proc, url, _ = served(["--model", str(model_dir), "--port", "0", "--open"],
                          env={**ENV, "BROWSER": f"{sys.executable} {opener} %s"})
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        info = httpx.get(url + "api/info", timeout=30).json()
        assert info["config"]["n_layer"] == SMALL.n_layer and info["model"] == str(model_dir)
        assert httpx.get(url, timeout=30).status_code == 200
        bad = httpx.get(url, headers={"Host": "attacker.example"}, timeout=30)
        assert bad.status_code == 400 and "not allowed" in bad.json()["error"]["message"]
        for _ in range(200):
            if opened.exists() and opened.read_text():
                break
            time.sleep(0.05)
        assert opened.read_text() == url
    finally:
        code = stop(proc)
    assert code in (0, 130)  # Ctrl-C: the server shuts down, the command says "interrupted"


# --- docs/explore.md runs as written ----------------------------------------------------------------------


def test_docs_explore_md_runs_as_written(tmp_path):
    """Every block of docs/explore.md in order: python files (first line `# NAME.py`) are written, other
    python blocks and bash blocks run (gpt2kit as `python -m gpt2kit`) and each text block after one is its
    output; the block marked `<!-- server ... -->` is started on a free port, its page fetched, then stopped;
    one marked `<!-- skip: REASON -->` is not run here (the benchmark: its own test runs it small)."""
    import httpx

    doc = (ROOT / "docs" / "explore.md").read_text(encoding="utf-8")
    blocks = re.findall(r"(<!-- (?:server|skip:)[^>]*-->\n)?```(\w+)\n(.*?)```", doc, flags=re.S)
    last_out, ran, compared, server, skipped = None, 0, 0, 0, 0
    for marker, lang, body in blocks:
        if marker.startswith("<!-- skip:"):
            last_out, skipped = None, skipped + 1
            continue
        if lang == "python" and (m := re.match(r"# (\S+\.py)\n", body)):
            (tmp_path / m.group(1)).write_text(body, encoding="utf-8")
            continue
        if marker:
            argv = shlex.split(body)
            assert argv[:2] == ["gpt2kit", "explore"] and "--port" not in argv
            proc, url, line = served([*argv[2:], "--port", "0"], cwd=tmp_path)
            try:
                assert httpx.get(url, timeout=30).status_code == 200
                last_out = line.replace(url, "http://127.0.0.1:8001/")  # the default port, as the doc shows
            finally:
                assert stop(proc) in (0, 130)
            ran, server = ran + 1, server + 1
        elif lang in ("python", "bash"):
            script = re.sub(r"(?m)^gpt2kit ", f"{sys.executable} -m gpt2kit ", body)
            argv = [sys.executable, "-c", body] if lang == "python" else ["bash", "-c", script]
            proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
            assert proc.returncode == 0, (body, proc.stderr)
            last_out, ran = proc.stdout, ran + 1
        elif lang == "text" and last_out is not None:
            assert body.strip() == last_out.strip()
            last_out, compared = None, compared + 1
    assert ran == 4 and compared == 2 and server == 1 and skipped == 1
    assert (tmp_path / "report.html").stat().st_size > 0
