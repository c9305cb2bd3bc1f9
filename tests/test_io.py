"""gpt2kit._io: the one atomic writer, and the one check of a path a user names as input."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest

from gpt2kit._io import atomic_write, atomic_write_at, atomic_write_text, check_input


def test_atomic_write_replaces_whole_with_the_umask_mode(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write_text(tmp_path / "a.json", "new\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").read_text() == "new\n"
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["a.json"]


def test_full_disk_is_named_as_such_and_the_old_file_survives(tmp_path, monkeypatch):
    f = tmp_path / "checkpoint.pt"
    f.write_bytes(b"old")

    def enospc(fh):
        fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    said = rf"no space left on {tmp_path} while writing checkpoint\.pt; the previous checkpoint\.pt"
    with pytest.raises(OSError, match=said):
        atomic_write(f, enospc)
    assert f.read_bytes() == b"old" and os.listdir(tmp_path) == ["checkpoint.pt"]

    def torch_like(fh):  # torch.save on a full disk raises RuntimeError with no errno
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 4096))
    with pytest.raises(OSError, match="no space left"):
        atomic_write(f, torch_like)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 1 << 30, 9 << 30))
    with pytest.raises(RuntimeError, match="enforce fail"):  # plenty of space: the real error, unchanged
        atomic_write(f, torch_like)
    assert f.read_bytes() == b"old"


def test_errors_name_the_users_path_never_the_temporary_file(tmp_path):
    missing = tmp_path / "nonexistent" / "x.html"
    with pytest.raises(FileNotFoundError) as e:
        atomic_write_text(missing, "x")
    assert str(e.value) == f"{missing}: cannot write it: the directory {missing.parent} does not exist"
    assert e.value.errno == errno.ENOENT

    with pytest.raises(IsADirectoryError) as e:
        atomic_write_text(tmp_path, "x")  # a directory where the file should go
    assert str(e.value) == f"{tmp_path}: is a directory; give a file name"

    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError) as e:
        atomic_write(tmp_path / "file" / "x.json", lambda f: f.write(b"x"))
    assert str(e.value).startswith(f"{tmp_path / 'file' / 'x.json'}: cannot write it: {tmp_path / 'file'} is not")
    assert not [p for p in tmp_path.rglob("*.tmp")]  # and nothing is left behind


def test_atomic_write_at_writes_in_the_directory_held_open_with_the_mode_given(tmp_path):
    # The kernel cache checks its directory once and writes through the descriptor: a rename of the
    # path afterwards does not move the write; the mode is the one given, whatever the umask.
    held = tmp_path / "held"
    held.mkdir()
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (held / "lib.so").write_bytes(b"old")
        held.rename(tmp_path / "moved")
        held.mkdir()  # what the old path names now
        old = os.umask(0o002)
        try:
            atomic_write_at(fd, "lib.so", b"new", mode=0o644)
        finally:
            os.umask(old)
    finally:
        os.close(fd)
    assert (tmp_path / "moved" / "lib.so").read_bytes() == b"new" and list(held.iterdir()) == []
    assert os.stat(tmp_path / "moved" / "lib.so").st_mode & 0o777 == 0o644
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == ["lib.so"]  # no temporary left


def test_a_kill_point_that_does_not_exist_is_named(tmp_path, monkeypatch):
    from gpt2kit._io import atomic_directory

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a").write_text("old")
    monkeypatch.setenv("GPT2KIT_KILL_AT", "directory_swap")
    with pytest.raises(ValueError, match=r"GPT2KIT_KILL_AT='directory_swap' is not a kill point; valid: "
                                         r"directory-swap, sharded-save"):
        with atomic_directory(tmp_path / "model") as stage:
            (stage / "a").write_text("new")
    assert (tmp_path / "model" / "a").read_text() == "old" and os.listdir(tmp_path) == ["model"]


def _checked(path, **kw):
    """check_input(path) in a thread that must end within 30 s: opening a FIFO without a writer would block."""
    import threading

    out = {}

    def run():
        try:
            out["ok"] = check_input(path, "--gate-data", **kw)
        except Exception as e:  # what the check raised, for the test to look at
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"check_input({path}) blocked"
    return out


def test_an_input_path_is_a_regular_file_or_says_what_it_is(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    cases = [
        (fifo, {}, ValueError, f"--gate-data {fifo}: is a FIFO (named pipe), not a regular file"),
        (fifo, {"directory": True}, ValueError,
         f"--gate-data {fifo}: is a FIFO (named pipe), not a regular file or a directory"),
        ("/dev/zero", {}, ValueError, "--gate-data /dev/zero: is a character device, not a regular file"),
        (tmp_path / "none", {}, FileNotFoundError, f"--gate-data {tmp_path / 'none'}: no such file"),
        (tmp_path / "none", {"directory": True}, FileNotFoundError,
         f"--gate-data {tmp_path / 'none'}: no such file or directory"),
        (tmp_path / "dangling", {}, FileNotFoundError,
         f"--gate-data {tmp_path / 'dangling'}: a symlink to {tmp_path / 'gone'}, which does not exist"),
        (tmp_path, {}, IsADirectoryError, f"--gate-data {tmp_path}: is a directory, expected a file"),
    ]
    for path, kw, kind, said in cases:
        out = _checked(path, **kw)
        assert type(out.get("error")) is kind and str(out["error"]) == said, (path, out)
    assert _checked(tmp_path / "f.txt")["ok"] == tmp_path / "f.txt"
    assert _checked(tmp_path, directory=True)["ok"] == tmp_path
