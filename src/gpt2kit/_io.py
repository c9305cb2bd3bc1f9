"""Small file helpers shared by the modules that write atomically."""

from __future__ import annotations

import os


def file_mode() -> int:
    """The mode open() gives a new file under the current umask (mkstemp would give 0600)."""
    umask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask
