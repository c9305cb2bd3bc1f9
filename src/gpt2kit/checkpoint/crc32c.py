"""crc32c (Castagnoli) as LevelDB and TensorFlow store it: google-crc32c's C code when present.

The masked form (`mask`) is what TF's index blocks and tensor entries hold. A pure-Python crc32c runs
at a few MB/s: fine for index blocks, far too slow for a checkpoint's tensors, so HAVE_FAST_CRC32C
tells the bundle reader whether checking the data crc is affordable.
"""

from __future__ import annotations

import numpy as np

try:  # optional C-accelerated crc32c; see the module docstring
    import google_crc32c as _google_crc32c

    HAVE_FAST_CRC32C = _google_crc32c.implementation == "c"
except ImportError:  # pragma: no cover - depends on the environment
    _google_crc32c = None
    HAVE_FAST_CRC32C = False

__all__ = ["HAVE_FAST_CRC32C", "crc32c", "crc32c_of_buffer", "crc32c_python", "mask"]

_CRC_MASK_DELTA = 0xA282EAD8
_CRC_CHUNK = 1 << 22  # google-crc32c only takes bytes, so the data crc copies 4 MiB at a time


def _make_crc32c_table() -> list[int]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C_TABLE = _make_crc32c_table()


def crc32c_python(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Pure-Python crc32c (Castagnoli); ``crc`` continues a previous value. Slow: index blocks only."""
    table = _CRC32C_TABLE
    c = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """crc32c of ``data`` continuing ``crc``: google-crc32c's C code when present, else pure Python."""
    if HAVE_FAST_CRC32C:
        return _google_crc32c.extend(crc, bytes(data))
    return crc32c_python(data, crc)


def mask(crc: int) -> int:
    # TF/LevelDB store crcs masked, because a crc of data that embeds crcs is weak.
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def crc32c_of_buffer(buf: np.ndarray, chunk: int = _CRC_CHUNK) -> int:
    """crc32c of a uint8 array; google-crc32c rejects numpy buffers, so feed it bytes `chunk` at a time."""
    crc = 0
    view = memoryview(buf)
    for start in range(0, len(view), chunk):
        crc = _google_crc32c.extend(crc, view[start : start + chunk].tobytes())
    return crc
