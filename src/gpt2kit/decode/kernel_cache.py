"""Where the C libraries gpt2kit builds (decode/native.py) are kept, and what a cached one must pass
before it is loaded. Loading a shared library runs its code, so a cached library is taken only when
nobody but this user could have written it and its bytes are the ones a build wrote:

- The directory is opened once and used through that descriptor from then on. It must be owned by
  this user and writable by nobody else; a new one is made 0700. Another user's directory, or a
  group- or world-writable one (a shared $GPT2KIT_CACHE, a directory under /tmp), is not used: the
  kernel is built for this process alone, with a RuntimeWarning that says why (`open_cache` None).
- A library must be a regular file (not a symlink) in that directory, owned by this user, writable
  by nobody else, and end in a trailer holding the SHA-256 of the bytes before it (written in the
  same atomic write as the library). Its bytes are read once through one descriptor and hashed, and
  the bytes hashed are the bytes loaded: copied into a memfd (a file only this process holds) and
  loaded from /proc/self/fd, so a file changed after the check is never what runs. A library that
  fails a check (another user's, one others can write, a truncated or corrupt one) is refused with a
  RuntimeWarning, and the caller builds it again in its place.

The ownership rules keep other users' code out; the trailer catches accidents (a truncated library
would crash the process with SIGBUS at load, a corrupt one would fail to load). Neither defends
against this user's own processes or root, who can write anything this user runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

from gpt2kit._io import atomic_write_at

MAGIC = b"\0gpt2kit-sha256\0"  # then the 32-byte SHA-256 of everything before MAGIC
_TRAILER = len(MAGIC) + 32
_MAX_BYTES = 64 << 20  # no library of ours comes near this; a bigger file is not read
_LOADED: list[int] = []  # memfds of loaded libraries, kept open: dlopen knows a library by its path,
# and a closed descriptor's /proc/self/fd/N would later name another library


def unsafe(st: os.stat_result) -> str | None:
    """Why a file or directory with this stat is not this user's alone to write, or None when it is."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        who = {0o020: "its group", 0o002: "all users", 0o022: "its group and all users"}[st.st_mode & 0o022]
        return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class CacheDir:
    """A cache directory checked once (`open_cache`) and read and written through its descriptor."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def read(self, name: str) -> bytes | None:
        """The library `name`'s bytes (without the trailer) if it passes every check; None if there is
        none, or if it is refused (with a RuntimeWarning naming the reason)."""
        blob = self.read_private(name)
        if blob is None:
            return None
        body, trailer = blob[:-_TRAILER], blob[-_TRAILER:]
        if len(blob) < _TRAILER or not trailer.startswith(MAGIC):
            return self._refuse(name, "it has no SHA-256 trailer (truncated, or not written by gpt2kit's build)")
        if hashlib.sha256(body).digest() != trailer[len(MAGIC):]:
            return self._refuse(name, "its bytes do not match the SHA-256 written with them (truncated or "
                                      "changed since it was built)")
        return body

    def read_private(self, name: str, max_bytes: int = _MAX_BYTES, what: str = "the cached kernel library",
                     then: str = "building it again") -> bytes | None:
        """The bytes of `name` if it is a regular file of this user's that nobody else can write, of at
        most `max_bytes`; None if there is none, or if it is refused (with a RuntimeWarning: "refused
        {what} PATH: why; {then}"). The file rules of every file kept here."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:  # a symlink (ELOOP), unreadable, ...
            return self._refuse(name, f"it cannot be opened as a file ({e.strerror})", what, then)
        try:
            st = os.fstat(fd)
            why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else unsafe(st)
            if why is None and st.st_size > max_bytes:
                why = f"it is larger than {max_bytes >> 10} KiB"
            if why:
                return self._refuse(name, why, what, then)
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(max_bytes + 1)
        finally:
            os.close(fd)

    def write(self, name: str, body: bytes) -> bool:
        """Store a library as `name` with its SHA-256 trailer, replacing any file of that name (mode 0644
        whatever the umask: a group-writable library would be refused). False where it cannot be written."""
        return self.write_private(name, body + MAGIC + hashlib.sha256(body).digest(), mode=0o644)

    def write_private(self, name: str, body: bytes, mode: int = 0o600) -> bool:
        """Write `name` atomically with `mode`, replacing any file of that name (another user's too: the
        directory is this user's). False where it cannot be written."""
        try:
            atomic_write_at(self.fd, name, body, mode=mode)
        except OSError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)

    def _refuse(self, name: str, why: str, what: str = "the cached kernel library",
                then: str = "building it again") -> None:
        warnings.warn(f"refused {what} {self.path / name}: {why}; {then}", RuntimeWarning, stacklevel=4)
        return None


def open_cache(path: Path) -> CacheDir | None:
    """`path` (made 0700 if missing, its parents as mkdir makes them) as a checked cache directory, or
    None where it cannot be made or opened (silently: the kernel is then built for this process alone)
    or is not this user's alone to write (with a RuntimeWarning)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    why = unsafe(os.fstat(fd))
    if why:
        os.close(fd)
        warnings.warn(f"the kernel cache {path} is not used: {why}; the kernel is built for this process "
                      "alone (use a directory only you can write: chmod 700 it, or set GPT2KIT_CACHE)",
                      RuntimeWarning, stacklevel=3)
        return None
    return CacheDir(path, fd)


def load(body: bytes, name: str) -> ctypes.CDLL:
    """Load the library whose bytes are `body` from a private copy: a memfd, else (no memfd here, or
    one that may not be mapped executable) a 0600 file in a new 0700 temporary directory, removed once
    loaded. OSError where neither loads."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return _load_from_file(body, name)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        return _load_from_file(body, name)
    _LOADED.append(fd)
    return lib


def _load_from_file(body: bytes, name: str) -> ctypes.CDLL:
    private = tempfile.mkdtemp(prefix="gpt2kit-kernel-")
    try:
        path = os.path.join(private, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        return ctypes.CDLL(path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
