"""The core CLI subcommands (tokenize, score, convert, info) and its error handling."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import error_lines, random_model

from gpt2kit.checkpoint import load_model, save_model
from gpt2kit.cli import main
from gpt2kit.config import GPT2Config
from gpt2kit.score import score_text
from gpt2kit.tokenizer import Tokenizer

FIXTURE_TF = Path(__file__).parent / "fixtures" / "openai_tf_tiny"
CFG = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=16, n_head=2, n_layer=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    save_model(random_model(CFG, seed=5), d)
    return d


def run(capsys, argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_tokenize_stdin_json_count(capsys, monkeypatch, tmp_path):
    assert run(capsys, ["tokenize"], "Hello world", monkeypatch)[1].strip() == "15496 995"
    assert json.loads(run(capsys, ["tokenize", "--json"], "Hello world", monkeypatch)[1]) == {"tokens": [15496, 995]}
    f = tmp_path / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog.", encoding="utf-8")
    assert run(capsys, ["tokenize", "--count", str(f)])[1].strip() == "10"
    special = run(capsys, ["tokenize", "--json", "--allow-special"], "a<|endoftext|>", monkeypatch)[1]
    assert json.loads(special)["tokens"][-1] == 50256


def test_score_json_matches_library(capsys, monkeypatch, model_dir):
    text = "The capital of France is Paris. " * 5
    code, out, err = run(capsys, ["score", "--model", str(model_dir), "--json"], text, monkeypatch)
    assert code == 0, err
    got = json.loads(out)
    ref = score_text(load_model(model_dir), Tokenizer.default(), text)
    assert got["tokens"] == ref.tokens
    assert max(abs(a - b) for a, b in zip(got["logprobs"], ref.logprobs, strict=True)) < 1e-6
    assert abs(got["nll"] - ref.nll) < 1e-6 and abs(got["ppl"] - ref.ppl) < 1e-4
    code, out, _ = run(capsys, ["score", "--model", str(model_dir), "--stride", "16"], text, monkeypatch)
    assert code == 0 and "perplexity" in out and "bits/byte" in out


def test_convert_and_info(capsys, tmp_path):
    code, out, err = run(capsys, ["convert", str(FIXTURE_TF), str(tmp_path / "hf")])
    assert code == 0, err
    a, b = load_model(FIXTURE_TF), load_model(tmp_path / "hf")
    x = torch.randint(0, 1000, (1, 10))
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)
    code, out, _ = run(capsys, ["info", str(tmp_path / "hf")])
    assert code == 0 and "parameters: 59,520" in out and "model.safetensors" in out
    info = json.loads(run(capsys, ["info", "--json", str(FIXTURE_TF)])[1])
    assert info["source"] == "openai-tf" and info["config"]["n_embd"] == 32


@pytest.mark.parametrize("argv,needle", [
    (["info", "/nonexistent/model"], "no such directory"),
    (["score", "--model", "openai-community/not-cached-anywhere", "/dev/null"], "not in the local Hugging Face cache"),
    (["tokenize", "/nonexistent.txt"], "no such file"),
    (["score", "--model", str(FIXTURE_TF), "--dtype", "int3", "/dev/null"], "unknown dtype"),
])
def test_errors_are_one_line_without_traceback(capsys, monkeypatch, argv, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run(capsys, argv)
    assert code == 1
    assert needle in err and len(error_lines(err)) == 1 and "Traceback" not in err


def test_corrupt_checkpoint_one_line(capsys, tmp_path, model_dir):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
    code, _, err = run(capsys, ["info", str(d)])
    assert code == 1 and "model.safetensors" in err and len(error_lines(err)) == 1


def test_bad_flag_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tokenize", "--frobnicate"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--frobnicate" in err and len(error_lines(err)) == 1


def test_debug_shows_traceback():
    proc = subprocess.run([sys.executable, "-m", "gpt2kit", "info", "/nonexistent/model", "--debug"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_convert_refuses_to_overwrite_a_model_unless_asked(capsys, tmp_path):
    dst = tmp_path / "hf"
    assert run(capsys, ["convert", str(FIXTURE_TF), str(dst)])[0] == 0
    mtime = (dst / "model.safetensors").stat().st_mtime_ns
    code, _, err = run(capsys, ["convert", str(FIXTURE_TF), str(dst)])
    assert code == 1 and "already holds a model" in err and "--overwrite" in err
    assert (dst / "model.safetensors").stat().st_mtime_ns == mtime
    code, _, err = run(capsys, ["convert", str(FIXTURE_TF), str(dst), "--overwrite", "--dtype", "bfloat16"])
    assert code == 0, err
    assert load_model(dst).config.n_layer == 2 and "bfloat16" in (dst / "config.json").read_text()


def test_convert_never_overwrites_its_own_source(capsys, tmp_path, model_dir):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (tmp_path / "alias").symlink_to(d)
    before = (d / "model.safetensors").read_bytes()
    for dst in (d, tmp_path / "alias", tmp_path / "m" / ".." / "m"):
        code, _, err = run(capsys, ["convert", str(d), str(dst), "--overwrite"])
        assert code == 1 and "is the source" in err, err
    assert (d / "model.safetensors").read_bytes() == before


def test_train_refuses_out_equal_to_the_model_it_fine_tunes(capsys, tmp_path, model_dir):
    code, _, err = run(capsys, ["train", "--data", str(tmp_path), "--model", str(model_dir), "--out", str(model_dir)])
    assert code == 1 and "model being fine-tuned" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys, tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    code, _, err = run(capsys, ["score", "--model", str(FIXTURE_TF), "--device", "cuda", str(tmp_path / "t.txt")])
    assert code == 1 and len(error_lines(err)) == 1
    assert "device 'cuda' asked for, but" in err and "--device cpu" in err


def test_output_to_a_closed_pipe_exits_nonzero_quietly(tmp_path):
    import os

    (tmp_path / "t.txt").write_text("hello world " * 20000)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write, as with `| head -c1` after its byte
    proc = subprocess.run([sys.executable, "-m", "gpt2kit", "tokenize", str(tmp_path / "t.txt")],
                          stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    assert proc.returncode == 141 and proc.stderr == ""


def test_non_utf8_input_warns_once_and_replaces(capsys, monkeypatch, tmp_path, model_dir):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café".encode("latin-1"))
    code, out, err = run(capsys, ["tokenize", str(f)])
    assert code == 0 and out.split() == [str(i) for i in Tokenizer.default().encode("caf\ufffd")]
    assert err.strip() == (f"gpt2kit tokenize: warning: {f} is not valid UTF-8 (byte 0xe9 at offset 3); "
                           "invalid bytes were replaced with U+FFFD")
    code, out, err = run(capsys, ["score", "--model", str(model_dir), str(f)])
    assert code == 0 and "not valid UTF-8" in err and "perplexity" in out


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"gpt2kit {version('gpt2kit')}"


def test_detokenize_from_args_file_and_stdin(capsys, monkeypatch, tmp_path):
    tok = Tokenizer.default()
    text = "Hello world, café ☕"
    ids = tok.encode(text)
    assert run(capsys, ["detokenize", *map(str, ids)])[1] == text
    assert run(capsys, ["detokenize"], json.dumps(ids), monkeypatch)[1] == text
    assert run(capsys, ["detokenize"], ", ".join(map(str, ids)) + "\n", monkeypatch)[1] == text
    f = tmp_path / "ids.json"
    f.write_text(json.dumps({"tokens": ids}))  # what tokenize --json prints
    assert run(capsys, ["detokenize", "--file", str(f)])[1] == text


def test_tokenize_then_detokenize_gives_the_bytes_back(tmp_path):
    src = tmp_path / "t.txt"
    src.write_bytes("line one\n\ttwo  ☕\r\n".encode() + b"\xff end")  # not even UTF-8: still exact
    ids = subprocess.run([sys.executable, "-m", "gpt2kit", "tokenize", str(src)], capture_output=True, check=True)
    back = subprocess.run([sys.executable, "-m", "gpt2kit", "detokenize"], input=ids.stdout, capture_output=True,
                          check=True)
    assert back.stdout == "line one\n\ttwo  ☕\r\n\ufffd end".encode()


@pytest.mark.parametrize("argv,stdin,needle", [
    (["detokenize", "1", "x"], None, "ids: item 2 ('x') is not an integer token id"),
    (["detokenize", "50257"], None, "token id 50257 is outside the vocabulary (n_vocab 50257: ids 0..50256)"),
    (["detokenize"], "[1, 2.5]", "stdin: item 2 (2.5) is not an integer token id"),
    (["detokenize"], "[1, 2", "stdin: not valid JSON"),
    (["detokenize"], '{"ids": [1]}', 'expected a JSON list of token ids or {"tokens": [...]}'),
])
def test_detokenize_bad_ids_are_one_line(capsys, monkeypatch, argv, stdin, needle):
    code, out, err = run(capsys, argv, stdin, monkeypatch)
    assert code == 1 and out == "" and needle in err and len(error_lines(err)) == 1


def test_detokenize_and_version_do_not_import_torch():
    code = ("import sys; from gpt2kit.cli import main; main(['detokenize', '15496']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "Hello", proc.stderr


# --- progress on a terminal, nothing extra in piped output ---------------------------------------

class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (what the progress line checks)."""

    def isatty(self) -> bool:
        return True


def _progress_argvs(model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The capital of France is Paris. " * 3, encoding="utf-8")
    return {
        "score": (["score", "--model", str(model_dir), str(text)], ["loading", "scoring"]),
        "convert": (["convert", str(model_dir), str(tmp_path / "converted")], ["loading", "writing"]),
        "quantize": (["quantize", str(model_dir), str(tmp_path / "int8"), "--int8"],
                     ["loading", "quantizing to int8", "writing"]),
        "trace": (["trace", "Hello world", "--model", str(model_dir), "--out", str(tmp_path / "r.html")],
                  ["loading", "tracing", "writing"]),
        "generate": (["generate", "Hi", "--model", str(model_dir), "-n", "3", "--seed", "0"],
                     ["loading", "generating"]),
    }


@pytest.mark.parametrize("command", ["score", "convert", "quantize", "trace", "generate"])
def test_long_commands_show_progress_on_a_terminal_only(command, capsys, monkeypatch, tmp_path, model_dir):
    for d in ("piped", "tty"):
        (tmp_path / d).mkdir()
    argv, stages = _progress_argvs(model_dir, tmp_path / "piped")[command]
    code, piped_out, err = run(capsys, argv)
    assert code == 0, err
    # piped or redirected: one plain line per stage as it begins (the bar is a terminal's only)
    lines = err.splitlines()
    assert err.endswith("\n") and "\r" not in err and "\x1b" not in err and len(set(lines)) == len(lines)
    assert all(line.startswith(f"gpt2kit {command}: ") for line in lines), err
    for stage in (s for s in stages if s != "generating"):
        assert len([line for line in lines if line.startswith(f"gpt2kit {command}: {stage}")]) == 1, (stage, err)
    assert lines[0].startswith(f"gpt2kit {command}: loading "), err

    argv, stages = _progress_argvs(model_dir, tmp_path / "tty")[command]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = main(argv)
    out = capsys.readouterr().out
    err = terminal.getvalue()
    assert code == 0, err
    assert err.startswith(f"\rgpt2kit {command}: loading "), err
    for stage in stages:
        assert stage in err, (stage, err)
    assert err.endswith(("\r\x1b[K", " \r"))  # the line (or tqdm's bar) is wiped when the command is done
    assert out.count("\n") == piped_out.count("\n") and "\r" not in out  # stdout carries no progress


def test_an_error_wipes_the_progress_line_before_its_one_line(capsys, monkeypatch, tmp_path, model_dir):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = main(["trace", "Hello", "--model", str(model_dir), "--out", str(tmp_path / "no" / "such" / "r.html")])
    err = terminal.getvalue()
    assert code == 1
    last = err.rsplit("\r\x1b[K", 1)[1]
    assert last == (f"gpt2kit trace: error: {tmp_path / 'no' / 'such' / 'r.html'}: cannot write it: the directory "
                    f"{tmp_path / 'no' / 'such'} does not exist\n")


def test_trace_out_in_a_missing_directory_names_the_users_path(capsys, tmp_path, model_dir):
    out = tmp_path / "nonexistent" / "x.html"
    code, _, err = run(capsys, ["trace", "Hello", "--model", str(model_dir), "--out", str(out)])
    assert code == 1 and str(out) in err and ".tmp" not in err and len(error_lines(err)) == 1


def test_bench_without_transformers_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an environment without it gives
    code, _, err = run(capsys, ["bench", "--size", "gpt2-tiny", "--quick", "--no-memory"])
    assert code == 1 and "pip install 'gpt2kit[bench]'" in err and len(error_lines(err)) == 1


# --- flags built from the dataclass that owns the setting --------------------------------------

def _subparser(name: str):
    from gpt2kit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse keeps subparsers here
    return sub.choices[name]


@pytest.mark.parametrize("command,cls_path", [("generate", "gpt2kit.sampling:SamplingSettings"),
                                              ("serve", "gpt2kit.serve.options:ServeOptions")])
def test_every_scalar_setting_is_a_flag_with_the_dataclass_default(command, cls_path):
    import dataclasses
    import importlib

    module, name = cls_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    by_dest = {a.dest: a for a in _subparser(command)._actions}
    by_hand = {"served_model_name"}  # its default is --model's value
    for f in dataclasses.fields(cls):
        if str(f.type).split(" | ")[0] not in ("bool", "int", "float", "str") or f.name in by_hand:
            continue
        assert f.name in by_dest, f"{command} has no flag for {name}.{f.name}"
        assert by_dest[f.name].default == f.default, f.name
        assert f.metadata["help"], f.name


def test_generate_takes_openais_penalties_checked_by_sampling_settings(capsys, model_dir):
    code, _, err = run(capsys, ["generate", "-m", str(model_dir), "-n", "2", "--presence-penalty", "2e9"])
    assert code == 1 and "presence_penalty must be a number in [-1e9, 1e9]" in err, err
    code, out, err = run(capsys, ["generate", "-m", str(model_dir), "-n", "2", "--greedy", "--json",
                                  "--presence-penalty", "0.5", "--frequency-penalty", "0.5"])
    assert code == 0 and len(json.loads(out)["tokens"]) == 2, err


def test_serve_values_are_checked_by_serve_options_before_loading(capsys):
    pytest.importorskip("fastapi")
    code, _, err = run(capsys, ["serve", "-m", "/no/such/model", "--max-batch", "0"])
    assert code == 1 and "max_batch must be an integer >= 1, got 0" in err and len(error_lines(err)) == 1


def test_score_prints_each_tokens_log_prob_then_the_totals(capsys, monkeypatch, model_dir):
    tok = Tokenizer.default()
    text = "Hello there,\n world \u2014 \u201c\u00e9\u201d"  # a newline, and characters split over tokens
    code, out, err = run(capsys, ["score", "--model", str(model_dir)], text, monkeypatch)
    assert code == 0, err
    ref = score_text(load_model(model_dir), tok, text)
    lines = out.splitlines()
    assert lines[0].split() == ["index", "log-prob", "token"] and len(lines) == len(ref.tokens) + 2
    shown = []
    for i, (row, t, lp) in enumerate(zip(lines[1:-1], ref.tokens, ref.logprobs, strict=True)):
        index, value, token = row.split(None, 2)
        assert int(index) == i and abs(float(value) - lp) <= 5e-5  # printed to 4 decimals
        data = tok.decode_bytes([t])
        try:
            assert token == json.dumps(data.decode("utf-8"), ensure_ascii=False)
        except UnicodeDecodeError:
            assert token == "bytes:" + "".join(f"\\x{c:02x}" for c in data)
        shown.append(token)
    assert '"\\n"' in shown and any(s.startswith("bytes:") for s in shown)
    assert lines[-1] == (f"tokens: {len(ref.tokens)}  nll: {ref.nll:.4f} nats/token  perplexity: {ref.ppl:.3f}  "
                         f"bits/byte: {ref.bits_per_byte:.4f}")


def test_info_on_an_int8_copy_says_its_weights_are_int8(capsys, tmp_path, model_dir):
    q = tmp_path / "q"
    assert run(capsys, ["quantize", str(model_dir), str(q), "--int8"])[0] == 0
    state = load_model(q).state_dict()
    n_int8 = sum(t.numel() for t in state.values() if t.dtype == torch.int8)
    code, out, err = run(capsys, ["info", str(q)])
    assert code == 0, err
    total = json.loads(run(capsys, ["info", "--json", str(q)])[1])["parameters"]
    dtype = [line for line in out.splitlines() if line.startswith("dtype:")]
    assert dtype == [f"dtype:      int8 ({n_int8:,} of the {total:,} parameters, with float32 scales); "
                     "other tensors float32"]
    info = json.loads(run(capsys, ["info", "--json", str(q)])[1])
    assert info["parameters_by_dtype"] == {"float32": total - n_int8, "int8": n_int8}
    assert run(capsys, ["info", str(model_dir)])[1].splitlines()[3] == "dtype:      float32"


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_gate_data_that_is_not_a_regular_file_is_named_so_before_loading(tmp_path, model_dir, kind):
    import os

    if kind == "fifo":
        path, what = tmp_path / "fifo", "a FIFO (named pipe)"
        os.mkfifo(path)  # no writer: opening it to read would block, so the command runs under a timeout
    else:
        path, what = kind, "a character device"
    proc = subprocess.run([sys.executable, "-m", "gpt2kit", "score", "/dev/null", "-m", str(model_dir), "--quantize",
                           "int8", "--int8-activations", "--gate-data", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"gpt2kit score: error: --gate-data {path}: is {what}, not a regular file or a directory\n"


def test_a_warning_is_one_line_after_the_streamed_sample_never_inside_it(monkeypatch, tmp_path, model_dir):
    """The kernel cache's RuntimeWarning raised while a sample streams: on a stream that carries stdout
    and stderr both (2>&1), the sample's text arrives whole and the warning follows it as one line."""
    import os

    import gpt2kit.generation as gen
    from gpt2kit.decode import kernel_cache

    argv = ["generate", "Hello", "-m", str(model_dir), "--max-new-tokens", "8", "--greedy", "--ignore-eot"]
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    real = gen.generate_stream

    def warning_mid_sample(*args, **kwargs):
        for k, step in enumerate(real(*args, **kwargs)):
            if k == 3:
                assert kernel_cache.open_cache(shared) is None  # warns: others can write the directory
            yield step

    def both(patched: bool) -> str:
        buf = io.StringIO()
        with monkeypatch.context() as m:
            m.setattr(sys, "stdout", buf)
            m.setattr(sys, "stderr", buf)
            if patched:
                m.setattr(gen, "generate_stream", warning_mid_sample)
            assert main(argv) == 0
        return buf.getvalue()

    plain = both(False)
    assert plain.startswith(f"gpt2kit generate: loading {model_dir}\n") and plain.count("\n") == 2
    warned = both(True)
    assert warned == plain + (f"gpt2kit generate: warning: the kernel cache {shared} is not used: it is writable by "
                              "its group and all users (mode 777); the kernel is built for this process alone (use a "
                              "directory only you can write: chmod 700 it, or set GPT2KIT_CACHE)\n")
