"""A LevelDB-format SSTable read whole, as TensorFlow writes a bundle's ``.index``.

Data blocks of prefix-compressed ``key -> value`` entries with restart points, each block followed
by a 5-byte trailer (compression type, masked crc32c), an index block mapping separator keys to
data-block handles, and a 48-byte footer ending in the magic ``0xdb4775248b80fb57``.
"""

from __future__ import annotations

import struct
from pathlib import Path

from gpt2kit.checkpoint.crc32c import crc32c, mask
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.tf_proto import ProtoError, varint

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_LEN = 48  # two BlockHandles padded to 40 bytes, then the 8-byte magic
_BLOCK_TRAILER_LEN = 5  # 1 byte compression type + 4 bytes masked crc32c
_COMPRESSION_NAMES = {0: "none", 1: "snappy", 2: "zlib"}


def _block(data: bytes, offset: int, size: int, path: Path, verify: bool) -> bytes:
    """The contents of the block at BlockHandle (offset, size), its trailer checked."""
    end = offset + size + _BLOCK_TRAILER_LEN
    if offset < 0 or size < 0 or end > len(data) - _FOOTER_LEN:
        raise CheckpointError(
            f"{path}: block handle (offset {offset}, size {size}) points past the end of the "
            f"{len(data)}-byte index file; the file is truncated or corrupt"
        )
    contents = data[offset : offset + size]
    ctype = data[offset + size]
    if ctype != 0:
        name = _COMPRESSION_NAMES.get(ctype, f"unknown ({ctype})")
        raise CheckpointError(
            f"{path}: index block at offset {offset} is {name}-compressed; only uncompressed "
            "index files are supported (TensorFlow writes them uncompressed)"
        )
    if verify:
        (stored,) = struct.unpack_from("<I", data, offset + size + 1)
        actual = mask(crc32c(data[offset : offset + size + 1]))  # crc covers contents + type byte
        if actual != stored:
            raise CheckpointError(
                f"{path}: crc32c mismatch in index block at offset {offset} "
                f"(stored {stored:#010x}, computed {actual:#010x}); the index file is corrupt"
            )
    return contents


def _block_entries(block: bytes, path: Path) -> list[tuple[bytes, bytes]]:
    """Decode a block's prefix-compressed entries; the restart array is only for seeking."""
    if len(block) < 4:
        raise CheckpointError(f"{path}: index block of {len(block)} bytes is too short")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 - 4 * num_restarts
    if limit < 0:
        raise CheckpointError(f"{path}: index block claims {num_restarts} restart points; corrupt")
    entries = []
    key = b""
    pos = 0
    try:
        while pos < limit:
            shared, pos = varint(block, pos)
            non_shared, pos = varint(block, pos)
            value_len, pos = varint(block, pos)
            if shared > len(key) or pos + non_shared + value_len > limit:
                raise ProtoError("entry runs past the end of its block")
            key = key[:shared] + block[pos : pos + non_shared]
            pos += non_shared
            entries.append((key, block[pos : pos + value_len]))
            pos += value_len
    except ProtoError as e:
        raise CheckpointError(f"{path}: corrupt index block: {e}") from None
    return entries


def read_table(path: Path, verify: bool) -> list[tuple[bytes, bytes]]:
    """All (key, value) pairs of an SSTable file, in key order."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint index file not found") from None
    if len(data) < _FOOTER_LEN:
        raise CheckpointError(f"{path}: {len(data)} bytes is too short to be a TensorFlow index file")
    footer = data[-_FOOTER_LEN:]
    (magic,) = struct.unpack_from("<Q", footer, _FOOTER_LEN - 8)
    if magic != _TABLE_MAGIC:
        raise CheckpointError(
            f"{path}: bad SSTable magic {magic:#018x} (expected {_TABLE_MAGIC:#018x}); "
            "not a TensorFlow checkpoint index, or it is corrupt"
        )
    try:
        _meta_offset, pos = varint(footer, 0)
        _meta_size, pos = varint(footer, pos)
        index_offset, pos = varint(footer, pos)
        index_size, pos = varint(footer, pos)
    except ProtoError as e:
        raise CheckpointError(f"{path}: corrupt footer: {e}") from None
    entries = []
    for _sep, handle in _block_entries(_block(data, index_offset, index_size, path, verify), path):
        try:
            offset, p = varint(handle, 0)
            size, _ = varint(handle, p)
        except ProtoError as e:
            raise CheckpointError(f"{path}: corrupt block handle in index block: {e}") from None
        entries.extend(_block_entries(_block(data, offset, size, path, verify), path))
    return entries
