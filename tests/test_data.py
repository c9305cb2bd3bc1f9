"""Token shards: llm.c's byte format, prepare() against tiktoken's GPT-2 encoding, the batch loader."""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2kit.data import (
    PrepareSummary,
    RandomWindowLoader,
    ShardError,
    ShardLoader,
    find_shards,
    prepare,
    read_shard,
    write_shard,
)

EOT = 50256


@pytest.fixture(scope="module")
def reference_gpt2():
    """tiktoken's own GPT-2 encoding, built from the packaged vocab files (no network)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    data = importlib.resources.files("gpt2kit") / "vocab"
    with (
        importlib.resources.as_file(data / "vocab.bpe") as merges,
        importlib.resources.as_file(data / "encoder.json") as vocab,
    ):
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(merges), encoder_json_file=str(vocab))
    return tiktoken.Encoding(
        "gpt2-reference",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=50257,
    )


# ---------------------------------------------------------------------------------------------
# the shard format


def test_header_and_tokens_are_llm_c_bytes(tmp_path):
    tokens = [0, 1, 50256, 65535, 300]
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 2 * len(tokens)
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, len(tokens))
    assert np.frombuffer(raw[12:1024], dtype="<i4").tolist() == [0] * 253
    assert np.frombuffer(raw[1024:], dtype="<u2").tolist() == tokens
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]  # no temp file left behind


def test_roundtrip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 2**16, size=10_001, dtype=np.int64)
    write_shard(tmp_path / "a.bin", tokens)
    back = read_shard(tmp_path / "a.bin")
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(back, tokens)
    write_shard(tmp_path / "empty.bin", [])
    assert read_shard(tmp_path / "empty.bin").size == 0


@pytest.mark.parametrize("bad", [65536, -1, 70000])
def test_write_rejects_tokens_outside_uint16(tmp_path, bad):
    with pytest.raises(ValueError, match=str(bad)):
        write_shard(tmp_path / "s.bin", [1, 2, bad])
    assert list(tmp_path.iterdir()) == []


def _raw_shard(magic=20240520, version=1, count=3, n_tokens=3):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes() + np.arange(n_tokens, dtype="<u2").tobytes()


@pytest.mark.parametrize(
    ("raw", "expected", "found"),
    [
        (_raw_shard(magic=12345), "20240520", "12345"),
        (_raw_shard(version=2), "1", "2"),
        (_raw_shard(count=3, n_tokens=2), "1030", "1028"),  # truncated: 1024 + 2*3 bytes expected
        (_raw_shard(count=3, n_tokens=4), "1030", "1032"),
        (b"\x00" * 100, "1024", "100"),
    ],
    ids=["magic", "version", "truncated", "too-long", "too-short"],
)
def test_bad_shards_raise_shard_error(tmp_path, raw, expected, found):
    path = tmp_path / "broken_shard.bin"
    path.write_bytes(raw)
    with pytest.raises(ShardError, match=rf"broken_shard\.bin.*expected[^,]*{expected}.*found {found}"):
        read_shard(path)
    assert issubclass(ShardError, ValueError)


def test_find_shards_sorted_and_llm_c_names(tmp_path):
    for name in ["train_000010.bin", "train_000002.bin", "val_000000.bin", "notes.bin", "train_x.bin"]:
        write_shard(tmp_path / name, [1])
    assert [p.name for p in find_shards(tmp_path, "train")] == ["train_000002.bin", "train_000010.bin"]
    assert [p.name for p in find_shards(tmp_path, "val")] == ["val_000000.bin"]
    other = tmp_path / "fineweb10B"
    other.mkdir()
    write_shard(other / "fineweb_train_000001.bin", [1])
    assert [p.name for p in find_shards(other, "train")] == ["fineweb_train_000001.bin"]
    with pytest.raises(ValueError, match=r"fineweb10B.*val_000000\.bin"):
        find_shards(other, "val")


# ---------------------------------------------------------------------------------------------
# prepare


def _make_corpus(root):
    """Files and, in documented order (absolute path string; .jsonl lines in order), their texts."""
    corpus = root / "corpus"
    (corpus / "sub" / "deeper").mkdir(parents=True)
    (corpus / "a.txt").write_text("Hello world.\nThis is a test of the shard writer.", encoding="utf-8")
    (corpus / "bad.txt").write_bytes(b"valid text \xff\xfe then more")
    (corpus / "sub" / "b.txt").write_text("naïve café — 日本語 <|endoftext|> stays plain text", encoding="utf-8")
    (corpus / "sub" / "deeper" / "c.txt").write_text("  indented\n\n\ttabs and   spaces  ", encoding="utf-8")
    (corpus / "skip.md").write_text("not matched by the glob", encoding="utf-8")
    lines = [{"text": "first json document"}, {"id": 7, "text": "second, with 123 numbers"}, {"text": ""}]
    jsonl = root / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(o) for o in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    texts = [
        (corpus / "a.txt").read_text(encoding="utf-8"),
        b"valid text \xff\xfe then more".decode("utf-8", errors="replace"),
        (corpus / "sub" / "b.txt").read_text(encoding="utf-8"),
        (corpus / "sub" / "deeper" / "c.txt").read_text(encoding="utf-8"),
        "first json document",
        "second, with 123 numbers",
        "",
    ]
    return [corpus, jsonl], texts


def _concat(paths):
    return np.concatenate([read_shard(p) for p in paths]).tolist()


def test_prepare_matches_tiktoken_and_is_worker_independent(tmp_path, reference_gpt2):
    inputs, texts = _make_corpus(tmp_path)
    docs = [[EOT] + reference_gpt2.encode_ordinary(t) for t in texts]
    n_val = 3  # ceil(0.3 * 7 documents)
    expected_val = [t for d in docs[:n_val] for t in d]
    expected_train = [t for d in docs[n_val:] for t in d]

    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        with pytest.warns(UnicodeWarning, match=r"bad\.txt") as record:
            s = prepare(inputs, out, val_fraction=0.3, workers=workers, shard_size=16, progress=False,
                        shuffle_seed=None)
        assert sum("bad.txt" in str(w.message) for w in record) == 1
        assert isinstance(s, PrepareSummary)
        assert (s.documents, s.val_documents) == (7, n_val)
        assert _concat(s.val_shards) == expected_val
        assert _concat(s.train_shards) == expected_train
        assert (s.val_tokens, s.train_tokens) == (len(expected_val), len(expected_train))
        assert s.train_shards == find_shards(out, "train") and s.val_shards == find_shards(out, "val")
        assert [read_shard(p).size for p in s.train_shards[:-1]] == [16] * (len(s.train_shards) - 1)
        meta = json.loads((out / "prepare.json").read_text())
        assert meta["train_tokens"] == len(expected_train) and meta["documents"] == 7
        assert meta["train_shards"] == [p.name for p in s.train_shards]
        runs[workers] = {p.name: p.read_bytes() for p in out.iterdir()}
    assert runs[1] == runs[2]


def test_prepare_default_val_split_keeps_one_document(tmp_path, reference_gpt2):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.txt").write_text("validation document", encoding="utf-8")
    (tmp_path / "in" / "y.txt").write_text("training document", encoding="utf-8")
    s = prepare([tmp_path / "in"], tmp_path / "out", workers=1, progress=False, shuffle_seed=None)
    assert (s.documents, s.val_documents) == (2, 1)
    assert _concat(s.val_shards) == [EOT] + reference_gpt2.encode_ordinary("validation document")
    assert [p.name for p in s.train_shards] == ["train_000000.bin"]


def test_prepare_shuffles_documents_by_the_recorded_seed(tmp_path, reference_gpt2):
    inputs, texts = _make_corpus(tmp_path)
    docs = [[EOT] + reference_gpt2.encode_ordinary(t) for t in texts]
    order = np.random.default_rng(5).permutation(len(docs))
    shuffled = [docs[i] for i in order]
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"shuffled{workers}"
        with pytest.warns(UnicodeWarning):
            s = prepare(inputs, out, val_fraction=0.3, workers=workers, shard_size=16, progress=False,
                        shuffle_seed=5)
        assert _concat(s.val_shards) == [t for d in shuffled[:3] for t in d]
        assert _concat(s.train_shards) == [t for d in shuffled[3:] for t in d]
        assert json.loads((out / "prepare.json").read_text())["shuffle_seed"] == 5
        runs[workers] = {p.name: p.read_bytes() for p in out.iterdir()}
    assert runs[1] == runs[2]
    assert list(order) != sorted(order)  # the seed does reorder this corpus


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True])
def test_prepare_rejects_a_seed_that_is_not_an_integer(tmp_path, seed):
    (tmp_path / "a.txt").write_text("one", encoding="utf-8")
    with pytest.raises(ValueError, match=r"shuffle_seed must be an integer"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", shuffle_seed=seed, workers=1, progress=False)


def test_prepare_refuses_token_shards_as_input(tmp_path):
    write_shard(tmp_path / "fineweb_train_000001.bin", np.arange(10))
    with pytest.raises(ValueError, match=r"fineweb_train_000001\.bin is already a token shard.*re-shuffled"):
        prepare([tmp_path / "fineweb_train_000001.bin"], tmp_path / "out", workers=1, progress=False)


def test_prepare_refuses_to_mix_with_old_shards(tmp_path):
    (tmp_path / "a.txt").write_text("one", encoding="utf-8")
    (tmp_path / "b.txt").write_text("two", encoding="utf-8")
    out = tmp_path / "out"
    kw = dict(workers=1, progress=False, shard_size=2)
    first = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], out, val_fraction=0, **kw)
    assert len(first.train_shards) == 2
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare([tmp_path / "a.txt"], out, **kw)
    second = prepare([tmp_path / "a.txt"], out, val_fraction=0, overwrite=True, **kw)
    assert find_shards(out, "train") == second.train_shards == [out / "train_000000.bin"]


def test_prepare_bad_jsonl_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n', encoding="utf-8")
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
            prepare([bad], out, workers=workers, progress=False)
        assert not list(out.glob("*.bin"))  # nothing half-written stays behind


def test_prepare_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("not a .txt", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty corpus.*empty"):
        prepare([empty], tmp_path / "out", workers=1, progress=False)
    blank = tmp_path / "blank.jsonl"
    blank.write_text('\n{"text": ""}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty corpus.*blank\.jsonl"):
        prepare([blank], tmp_path / "out", workers=1, progress=False)
    assert not list((tmp_path / "out").glob("*.bin"))


# ---------------------------------------------------------------------------------------------
# ShardLoader

# two shards whose tokens tell where they came from: shard 0 holds 0..99, shard 1 holds 1000..1088
SHARDS = [np.arange(100), np.arange(1000, 1089)]


@pytest.fixture
def shard_dir(tmp_path):
    for i, toks in enumerate(SHARDS):
        write_shard(tmp_path / f"train_{i:06d}.bin", toks)
    return tmp_path


def test_loader_batches_shift_and_cross_shards(shard_dir):
    loader = ShardLoader(shard_dir, batch_size=2, seq_len=4)
    x, y = loader.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 4)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    # each step reads 9 tokens at 0, 8, ..., 88 (88 + 9 <= 100 < 96 + 9): 12 steps in shard 0,
    # then 0, 8, ..., 80 in shard 1 (80 + 9 == 89, an exact fit): 11 steps, then back to shard 0.
    firsts = [x[0, 0].item()] + [loader.next_batch()[0][0, 0].item() for _ in range(24)]
    assert firsts[:12] == list(range(0, 96, 8))
    assert firsts[12:23] == list(range(1000, 1088, 8))
    assert firsts[23:] == [0, 8]
    assert loader.epoch == 1 and loader.shard == 0


def test_two_ranks_equal_one_process_with_double_batch(shard_dir):
    B, T = 2, 3
    ranks = [ShardLoader(shard_dir, batch_size=B, seq_len=T, rank=r, world_size=2) for r in (0, 1)]
    single = ShardLoader(shard_dir, batch_size=2 * B, seq_len=T)
    for _ in range(40):  # several epochs: 8 + 7 steps per epoch
        (x0, y0), (x1, y1) = ranks[0].next_batch(), ranks[1].next_batch()
        xs, ys = single.next_batch()
        assert torch.equal(torch.cat([x0, x1]), xs) and torch.equal(torch.cat([y0, y1]), ys)
        assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    assert single.epoch == 2


def test_state_dict_resumes_exactly(shard_dir):
    loader = ShardLoader(shard_dir, batch_size=3, seq_len=2, rank=1, world_size=2)
    first = [loader.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))  # survives a checkpoint file
    expected = [loader.next_batch() for _ in range(30)]  # crosses shards and wraps
    assert loader.epoch >= 1

    resumed = ShardLoader(shard_dir, batch_size=3, seq_len=2, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for (xe, ye), (xr, yr) in zip(expected, (resumed.next_batch() for _ in expected), strict=True):
        assert torch.equal(xe, xr) and torch.equal(ye, yr)
    resumed.reset()
    x, y = resumed.next_batch()
    assert torch.equal(x, first[0][0]) and torch.equal(y, first[0][1])


def test_loader_rejects_short_and_corrupt_shards(shard_dir, tmp_path_factory):
    with pytest.raises(ValueError, match=r"train_000001\.bin: shard has 89 tokens.*the 95 one step needs"):
        ShardLoader(shard_dir, batch_size=47, seq_len=1, world_size=2)  # 2 * 47 + 1 = 95 <= 100, > 89
    other = tmp_path_factory.mktemp("corrupt")
    (other / "train_000000.bin").write_bytes(_raw_shard(magic=1))
    with pytest.raises(ShardError, match=r"train_000000\.bin"):
        ShardLoader(other, batch_size=1, seq_len=1)
    with pytest.raises(ValueError, match="rank"):
        ShardLoader(shard_dir, batch_size=1, seq_len=1, rank=2, world_size=2)


# ---------------------------------------------------------------------------------------------
# prepare under faults: a dying worker, Ctrl-C, leftovers of a killed run, odd inputs

_KILL_A_WORKER = r"""
import os, signal, sys, threading, time
from pathlib import Path
import gpt2kit.data as data

out = Path(sys.argv[2])

def kill_a_busy_worker():
    while not list(out.glob("*.bin")):  # small shards: the first result is written as it arrives
        time.sleep(0.01)
    # the workers are now in the middle of their next documents
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if ppid == me and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            os.kill(int(pid), signal.SIGKILL)
            return

threading.Thread(target=kill_a_busy_worker, daemon=True).start()
try:
    data.prepare([sys.argv[1]], out, workers=2, progress=False, shard_size=10_000)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(3)
"""


def _big_corpus(root, n_docs=200, size=20_000):
    corpus = root / "corpus"
    corpus.mkdir()
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
    for i in range(n_docs):
        (corpus / f"doc{i:04d}.txt").write_text(f"{i} {text}", encoding="utf-8")
    return corpus


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker through /proc")
def test_prepare_fails_fast_when_a_worker_dies(tmp_path):
    """multiprocessing.Pool replaced a killed worker and waited forever for its lost task."""
    corpus = _big_corpus(tmp_path, n_docs=100, size=200_000)  # big documents: the killed worker is busy
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _KILL_A_WORKER, str(corpus), str(out)], capture_output=True,
                          text=True, timeout=120)  # the old pool hung here forever
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stdout.startswith("WorkerDied: a tokenizer process died"), proc.stdout
    assert not list(out.glob("*.bin"))


def test_ctrl_c_during_prepare_exits_at_once_without_worker_tracebacks(tmp_path):
    """Ctrl-C as a terminal sends it (to the whole process group), with the workers unable to finish.

    The workers are stopped (SIGSTOP) first: prepare cannot end before the Ctrl-C whatever the
    machine's speed, and must not wait for them. concurrent.futures' pool hung here now and then (a
    worker ended while writing its result held the result queue's lock for ever)."""
    corpus = _big_corpus(tmp_path, n_docs=400, size=50_000)
    out = tmp_path / "out"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2kit", "prepare", str(corpus), "--out", str(out),
                             "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_workers(proc.pid)) < 2 and proc.poll() is None:
            time.sleep(0.01)
        stopped = _workers(proc.pid)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)  # busy for ever, as far as prepare can tell
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert took < 30, f"took {took:.1f}s to stop"
    assert not list(out.glob("*.bin")) and not list(out.glob(".*.tmp"))
    assert not [pid for pid in stopped if os.path.exists(f"/proc/{pid}")], "workers left running"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_prepare_fails_fast_when_workers_die_while_sending_results(tmp_path):
    """Workers killed half-way through writing a result: concurrent.futures' pool read the half
    message for ever (its result queue's write end is also held by the parent, so no end of file)."""
    corpus = _big_corpus(tmp_path, n_docs=64, size=400_000)  # a chunk's result is far over a pipe's buffer
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "gpt2kit", "prepare", str(corpus), "--out", str(out),
                             "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_workers(proc.pid)) < 2 and proc.poll() is None:
            time.sleep(0.01)
        workers = _workers(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)  # nothing reads the results now: the workers block in their send
        _wait_until_idle(workers, deadline)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode not in (0, None), err
    assert "a tokenizer process died" in err, err
    assert not list(out.glob("*.bin"))


def _wait_until_idle(pids: list[int], deadline: float) -> None:
    """Until the processes' CPU time stops growing (blocked: here, in a send nobody reads)."""
    def cpu() -> list[int]:
        return [sum(map(int, Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[11:13])) for p in pids]

    last, same = cpu(), 0
    while same < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu()
        same, last = (same + 1 if now == last else 0), now


def _workers(pid: int) -> list[int]:
    """prepare's tokenizer processes: its spawned children other than multiprocessing's resource tracker."""
    found = []
    for child in _children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            found.append(child)
    return found


def _children(pid: int) -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(p))
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_prepare_removes_temporaries_a_killed_run_left(tmp_path):
    (tmp_path / "a.txt").write_text("some text", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    leftovers = [out / ".train_000003.bin.k2j4x_8q.tmp", out / ".prepare.json.abc123.tmp"]
    for p in leftovers:
        p.write_bytes(b"half a shard")
    keep = out / ".notes.tmp"  # not ours: left alone
    keep.write_text("mine", encoding="utf-8")
    prepare([tmp_path / "a.txt"], out, workers=1, progress=False, val_fraction=0)
    assert not any(p.exists() for p in leftovers) and keep.exists()


def test_prepare_reads_dev_null_and_pipes_as_inputs(tmp_path, reference_gpt2):
    (tmp_path / "a.txt").write_text("from a file", encoding="utf-8")
    s = prepare([tmp_path / "a.txt", "/dev/null"], tmp_path / "out", workers=1, progress=False, val_fraction=0)
    assert s.documents == 2  # /dev/null is an empty document, not a missing file
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("from a pipe", encoding="utf-8"))
    writer.start()
    s = prepare([fifo], tmp_path / "out2", workers=1, progress=False, val_fraction=0)
    writer.join()
    assert _concat(s.train_shards) == [EOT] + reference_gpt2.encode_ordinary("from a pipe")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare([tmp_path / "missing.txt"], tmp_path / "out3", workers=1, progress=False)


def test_prepare_says_which_files_the_glob_skipped(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.txt").write_text("text", encoding="utf-8")
    (d / "b.py").write_text("x = 1", encoding="utf-8")
    (d / "c.py").write_text("y = 2", encoding="utf-8")
    (d / "d.md").write_text("# doc", encoding="utf-8")
    skipped = r"skipped 3 files that do not match --glob '\*\.txt' \(2 \.py, 1 \.md\); pass e\.g\. --glob '\*\.py'"
    with pytest.warns(UserWarning, match=skipped):
        s = prepare([d], tmp_path / "out", workers=1, progress=False, val_fraction=0)
    assert s.documents == 1
    s = prepare([d], tmp_path / "out", workers=1, progress=False, val_fraction=0, glob="*.py", overwrite=True)
    assert s.documents == 2


def test_prepare_names_the_overwrite_flag(tmp_path):
    (tmp_path / "a.txt").write_text("one", encoding="utf-8")
    prepare([tmp_path / "a.txt"], tmp_path / "out", workers=1, progress=False, val_fraction=0)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", workers=1, progress=False, val_fraction=0)


def test_first_token_at_least_scans_in_blocks(tmp_path):
    from gpt2kit.data import first_token_at_least

    tokens = np.zeros(1000, dtype=np.int64)
    tokens[[5, 700, 701]] = [10, 300, 999]
    write_shard(tmp_path / "s.bin", tokens)
    assert first_token_at_least(tmp_path / "s.bin", 300, block=64) == (700, 300)
    assert first_token_at_least(tmp_path / "s.bin", 11, block=7) == (700, 300)
    assert first_token_at_least(tmp_path / "s.bin", 10) == (5, 10)
    assert first_token_at_least(tmp_path / "s.bin", 1000) is None


def test_a_full_disk_names_the_directory(tmp_path, monkeypatch):
    import errno

    def full(fd):  # the file system finds it has no room for the shard's blocks
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=rf"no space left on {tmp_path} while writing train_000000\.bin"):
        write_shard(tmp_path / "train_000000.bin", [1, 2, 3])


# RandomWindowLoader


def test_random_windows_are_stream_slices_within_one_shard(shard_dir):
    loader = RandomWindowLoader(shard_dir, batch_size=4, seq_len=5, seed=0)
    seen_shards = set()
    for _ in range(50):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (4, 5) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], dim=1).tolist():  # 6 consecutive tokens of one shard
            assert row == list(range(row[0], row[0] + 6)) and (row[-1] < 100 or row[0] >= 1000)
            seen_shards.add(row[0] >= 1000)
    assert seen_shards == {False, True}


def test_random_windows_two_ranks_equal_one_process_and_resume_exactly(shard_dir):
    B, T = 3, 4
    ranks = [RandomWindowLoader(shard_dir, batch_size=B, seq_len=T, seed=7, rank=r, world_size=2) for r in (0, 1)]
    single = RandomWindowLoader(shard_dir, batch_size=2 * B, seq_len=T, seed=7)
    for _ in range(10):
        (x0, y0), (x1, y1) = ranks[0].next_batch(), ranks[1].next_batch()
        xs, ys = single.next_batch()
        assert torch.equal(torch.cat([x0, x1]), xs) and torch.equal(torch.cat([y0, y1]), ys)
    state = json.loads(json.dumps(ranks[1].state_dict()))
    expected = [ranks[1].next_batch() for _ in range(5)]
    resumed = RandomWindowLoader(shard_dir, batch_size=B, seq_len=T, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for (xe, ye), (xr, yr) in zip(expected, (resumed.next_batch() for _ in expected), strict=True):
        assert torch.equal(xe, xr) and torch.equal(ye, yr)
    other = RandomWindowLoader(shard_dir, batch_size=2 * B, seq_len=T, seed=8)
    assert not torch.equal(other.next_batch()[0], RandomWindowLoader(shard_dir, batch_size=2 * B, seq_len=T,
                                                                     seed=7).next_batch()[0])


def test_random_windows_reject_bad_input(shard_dir):
    with pytest.raises(ValueError, match="seed must be an integer"):
        RandomWindowLoader(shard_dir, batch_size=1, seq_len=2, seed=1.5)
    with pytest.raises(ValueError, match=r"holds the 101 tokens"):
        RandomWindowLoader(shard_dir, batch_size=1, seq_len=100, seed=0)
    loader = RandomWindowLoader(shard_dir, batch_size=1, seq_len=2, seed=0)
    with pytest.raises(ValueError, match="sequential"):
        loader.load_state_dict(ShardLoader(shard_dir, batch_size=1, seq_len=2).state_dict())


def test_cli_prepare_shuffle_flags(tmp_path, capsys):
    from gpt2kit.cli import main

    for i in range(4):
        (tmp_path / f"d{i}.txt").write_text(f"document {i}", encoding="utf-8")
    files = [str(tmp_path / f"d{i}.txt") for i in range(4)]
    assert main(["prepare", *files, "--out", str(tmp_path / "a"), "--workers", "1", "--no-shuffle"]) == 0
    assert json.loads((tmp_path / "a" / "prepare.json").read_text())["shuffle_seed"] is None
    assert main(["prepare", *files, "--out", str(tmp_path / "b"), "--workers", "1", "--shuffle-seed", "9"]) == 0
    assert json.loads((tmp_path / "b" / "prepare.json").read_text())["shuffle_seed"] == 9
    with pytest.raises(SystemExit) as e:
        main(["prepare", *files, "--out", str(tmp_path / "c"), "--shuffle-seed", "x"])
    assert e.value.code == 2 and "argument --shuffle-seed: invalid int value: 'x'" in capsys.readouterr().err
    write_shard(tmp_path / "train_000000.bin", np.arange(5))
    assert main(["prepare", str(tmp_path / "train_000000.bin"), "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "is already a token shard" in err and err.count("\n") == 1
