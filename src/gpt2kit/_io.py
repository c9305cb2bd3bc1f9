"""The one place that writes files: atomic single files and atomically swapped directories.

Every file gpt2kit writes goes through `atomic_write` (or `atomic_write_path` / `atomic_write_text`,
or `atomic_write_at` for a directory held open by its descriptor):
a temporary file in the same directory, the umask's mode (what open() would give), fsync, rename,
then fsync of the directory so the rename itself is durable. Directory-level saves (a model
directory) go through `atomic_directory`: the new directory is built beside the old one and
swapped in with one rename, so a reader or a crash sees the old directory or the new one, whole.

Crash tests need a kill that lands inside a save, not a race against it: with GPT2KIT_KILL_AT set to
one of KILL_POINTS, the process sends itself SIGKILL when it reaches that point (`kill_point`):
"directory-swap" (atomic_directory: the new version complete beside the old one, not yet swapped
in: a model or adapter save), "sharded-save" (gpt2kit.train.fsdp: the ranks' shards written, the
coordinator about to write the sharded checkpoint's metadata).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

KILL_ENV = "GPT2KIT_KILL_AT"
KILL_POINTS = ("directory-swap", "sharded-save")


def kill_point(name: str) -> None:
    """SIGKILL this process here if GPT2KIT_KILL_AT names this point (fault injection for crash tests)."""
    assert name in KILL_POINTS, name
    chosen = os.environ.get(KILL_ENV)
    if not chosen:
        return
    if chosen not in KILL_POINTS:
        raise ValueError(f"{KILL_ENV}={chosen!r} is not a kill point; valid: {', '.join(KILL_POINTS)}")
    if chosen == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _umask() -> int:
    umask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return umask


def file_mode() -> int:
    """The mode open() gives a new file under the current umask (mkstemp would give 0600)."""
    return 0o666 & ~_umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make renames and creations inside `path` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_path(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """`write(tmp_path)` fills a temporary file beside `path`, which then replaces `path` atomically.

    For writers that want a file name (safetensors' save_file, matplotlib); see `atomic_write`.
    A crash (or a second Ctrl-C) at any point leaves the previous file whole; readers never see
    half a file.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _naming(path, e) from None
    try:
        os.close(fd)
        write(tmp)
        os.chmod(tmp, file_mode())  # mkstemp makes 0600 (and some writers recreate the file): the mode open() gives
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        full = out_of_space(e, path.parent)  # asked before the partial file is removed and frees space
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if full:
            raise no_space_error(path.parent, f"writing {path.name}",
                                 f"the previous {path.name}, if any, is untouched", path) from None
        if isinstance(e, OSError) and tmp in (e.filename, e.filename2):
            raise _naming(path, e) from None  # the user named `path`, never our temporary file
        raise
    fsync_dir(path.parent)


def _naming(path: Path, e: OSError) -> OSError:
    """`e` (about the temporary file beside `path`) said about `path`, in one line, same type and errno."""
    where = path.parent
    reasons = {
        errno.ENOENT: f"cannot write it: the directory {where} does not exist",
        errno.ENOTDIR: f"cannot write it: {where} is not a directory (or a directory above it is a file)",
        errno.EISDIR: "is a directory; give a file name",
        errno.EACCES: f"cannot write it: permission denied in {where}",
        errno.EPERM: f"cannot write it: permission denied in {where}",
        errno.EROFS: f"cannot write it: {where} is on a read-only file system",
    }
    err = type(e)(f"{path}: {reasons.get(e.errno, f'cannot write it: {e.strerror}')}")
    err.errno = e.errno  # no filename or strerror set: str(err) stays the one line above
    return err


def out_of_space(e: BaseException, directory: str | os.PathLike[str]) -> bool:
    """Whether a failed write into `directory` failed for want of space: ENOSPC/EDQUOT, a Rust I/O
    error saying so (safetensors' SafetensorError: "... (os error 28)"), or an error without that
    errno (torch.save says "[enforce fail at inline_container...]") on a full file system."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(e, Exception) and any(f"(os error {n})" in str(e) for n in (errno.ENOSPC, errno.EDQUOT)):
        return True
    return isinstance(e, (OSError, RuntimeError)) and no_space(directory)


def no_space(directory: str | os.PathLike[str]) -> bool:
    """Whether the file system holding `directory` has under 1 MiB left (False where it cannot be asked)."""
    try:
        return shutil.disk_usage(directory).free < (1 << 20)
    except OSError:
        return False


def no_space_error(directory: str | os.PathLike[str], doing: str, note: str,
                   path: str | os.PathLike[str] | None = None) -> OSError:
    """The one wording of a full disk: "no space left on DIRECTORY while DOING; NOTE" (errno ENOSPC)."""
    message = f"no space left on {directory} while {doing}; {note}"
    return OSError(errno.ENOSPC, message) if path is None else OSError(errno.ENOSPC, message, str(path))


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """`write(f)` fills an open binary file that then replaces `path` atomically (see atomic_write_path)."""

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)

    atomic_write_path(path, fill)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """`text` as UTF-8 with '\\n' line ends, replacing `path` atomically."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def atomic_write_at(dir_fd: int, name: str, data: bytes, mode: int | None = None) -> None:
    """`data` replacing the file `name` in the directory open as `dir_fd`, atomically (a temporary file,
    `mode` or the umask's, fsync, rename, directory fsync), every step relative to the descriptor: a
    directory checked once (say, for its owner) is the one written, whatever its path names by then."""
    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, file_mode() if mode is None else mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """A file's bytes; what went wrong, if anything, said with the path: FileNotFoundError "no such
    file", IsADirectoryError, PermissionError "exists but cannot be read" (the one reader of the
    files users name, so every command words these the same)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{path}: is a directory, expected a file") from None
    except PermissionError:
        raise PermissionError(f"{path}: exists but cannot be read (permission denied)") from None


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_input(path: str | os.PathLike[str], label: str = "", *, directory: bool = False) -> Path:
    """`path` as a Path when it names a regular file (or, with `directory`, a directory), else one
    line saying what it is: FileNotFoundError "no such file" (a broken symlink named as one),
    IsADirectoryError, or ValueError "is a FIFO (named pipe), not a regular file" for a FIFO, a device
    or a socket. `label` (a flag such as "--gate-data") starts the message. Decided by stat alone, so
    nothing is opened: a FIFO without a writer cannot block the check, /dev/zero is never read."""
    where = f"{label} {path}" if label else str(path)
    wanted = "a regular file or a directory" if directory else "a regular file"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileNotFoundError(f"{where}: a symlink to {os.readlink(path)}, which does not exist") from None
        raise FileNotFoundError(f"{where}: no such file{' or directory' if directory else ''}") from None
    except PermissionError:
        raise PermissionError(f"{where}: exists but cannot be read (permission denied)") from None
    if stat.S_ISREG(mode) or (directory and stat.S_ISDIR(mode)):
        return Path(path)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{where}: is a directory, expected a file")
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise ValueError(f"{where}: is {kind}, not {wanted}")


def same_path(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name the same file or directory (through symlinks, .., case-folding filesystems)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


# --- directories ------------------------------------------------------------------------------

_STAGING = ".saving-"
_OLD = ".replaced-"


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str], *, keep: Callable[[str], bool] = lambda name: True
                     ) -> Iterator[Path]:
    """Build a new version of directory `path` in a sibling directory, then swap it in whole.

    Yields the staging directory to write into. Entries of an existing `path` for which
    `keep(name)` is true, and that the caller did not write, are carried into the new version
    (hard links where the filesystem allows, else copies), so files that belong to someone
    else (a training run's checkpoint.pt beside its model) survive. On success the staging
    directory replaces `path` with one atomic exchange (Linux renameat2; elsewhere two renames);
    on any error it is removed and `path` is left exactly as it was. Staging directories left by
    a killed process are removed by the next save to the same path.
    """
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()  # replace what the link points to, not the link
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path}: exists and is not a directory")
    if os.path.ismount(path):
        raise OSError(errno.EBUSY, f"{path} is a mount point and cannot be swapped for a new version; "
                      "save into a directory inside it", str(path))
    _remove_stale(parent, path.name)
    try:
        stage = Path(tempfile.mkdtemp(dir=parent, prefix=f".{path.name}{_STAGING}{os.getpid()}-"))
    except PermissionError:
        raise PermissionError(f"{path}: cannot write beside it in {parent} (permission denied); a save builds "
                              "the new directory next to the old one and swaps it in, so it needs write "
                              "access to the parent directory") from None
    try:
        # mkdtemp makes 0700; keep the old directory's mode, or give what mkdir() would
        os.chmod(stage, path.stat().st_mode & 0o7777 if path.is_dir() else 0o777 & ~_umask())
        yield stage
        if path.is_dir():
            written = set(os.listdir(stage))
            _carry(path, stage, (n for n in os.listdir(path) if n not in written and keep(n)))
        for entry in stage.iterdir():
            if entry.is_file():
                _fsync_file(entry)
        fsync_dir(stage)
        kill_point("directory-swap")
        _swap_in(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    fsync_dir(parent)


def _carry(src: Path, dst: Path, names: Iterable[str]) -> None:
    for name in names:
        s, d = src / name, dst / name
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        elif s.is_dir():
            shutil.copytree(s, d, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(s, d)


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    try:
        os.link(src, dst)  # same inode: cheap, and a lock held on the file stays held
    except OSError:
        shutil.copy2(src, dst)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(stage: Path, path: Path) -> None:
    if not path.exists():
        os.rename(stage, path)
        return
    if _exchange(stage, path):  # path is now the new version, stage holds the old one
        shutil.rmtree(stage, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}{_OLD}{os.getpid()}-"))
    os.rmdir(old)
    os.rename(path, old)
    try:
        os.rename(stage, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the filesystem cannot exchange
        return False
    raise OSError(err, f"cannot swap {a} into place: {os.strerror(err)}", str(b))


_RENAMEAT2: list = []


def _renameat2():
    if not _RENAMEAT2:
        fn = None
        with contextlib.suppress(OSError, AttributeError, TypeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _RENAMEAT2.append(fn)
    return _RENAMEAT2[0]


def _remove_stale(parent: Path, name: str) -> None:
    """Remove staging/old directories of `name` whose writing process no longer runs."""
    for prefix in (f".{name}{_STAGING}", f".{name}{_OLD}"):
        for entry in parent.glob(f"{_glob_escape(prefix)}*"):
            pid = entry.name[len(prefix):].partition("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)


def _glob_escape(s: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
