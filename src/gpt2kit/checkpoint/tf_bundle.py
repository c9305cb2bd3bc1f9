"""Read a TensorFlow v2 tensor-bundle checkpoint without TensorFlow (numpy only).

This is the format of OpenAI's GPT-2 release (``model.ckpt.index`` plus
``model.ckpt.data-00000-of-00001``, as fetched by openai/gpt-2's ``download_model.py``).

Layout, as written by TensorFlow's ``BundleWriter``:

* ``{prefix}.index`` is a LevelDB-format SSTable: data blocks of prefix-compressed
  ``key -> value`` entries with restart points, each block followed by a 5-byte trailer
  (compression type, masked crc32c), an index block mapping separator keys to data-block
  handles, and a 48-byte footer ending in the magic ``0xdb4775248b80fb57``.
* The entry with the empty key is a ``BundleHeaderProto`` (num_shards, endianness, version);
  every other key is a tensor name whose value is a ``BundleEntryProto``
  (dtype, shape, shard_id, offset, size, masked crc32c of the tensor's bytes).
* ``{prefix}.data-{shard:05d}-of-{num_shards:05d}`` holds the raw tensor bytes.

Integrity checking (``verify=True``): the index blocks' crc32c is always checked, and every
tensor's size is checked against its shape and dtype and against the data file's length.
The per-tensor data crc32c is checked only when the C-accelerated ``google-crc32c`` package
is importable: a pure-Python crc32c runs at a few MB/s, far too slow for a 500 MB-6 GB
checkpoint, so without that package the data crc is skipped silently.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import numpy as np

from gpt2kit.checkpoint.errors import CheckpointError

try:  # optional C-accelerated crc32c; see the module docstring
    import google_crc32c as _google_crc32c

    HAVE_FAST_CRC32C = _google_crc32c.implementation == "c"
except ImportError:  # pragma: no cover - depends on the environment
    _google_crc32c = None
    HAVE_FAST_CRC32C = False

__all__ = ["HAVE_FAST_CRC32C", "crc32c", "crc32c_python", "list_tf_checkpoint", "read_tf_checkpoint"]

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_LEN = 48  # two BlockHandles padded to 40 bytes, then the 8-byte magic
_BLOCK_TRAILER_LEN = 5  # 1 byte compression type + 4 bytes masked crc32c
_COMPRESSION_NAMES = {0: "none", 1: "snappy", 2: "zlib"}
_CRC_MASK_DELTA = 0xA282EAD8
_CRC_CHUNK = 1 << 22  # google-crc32c only takes bytes, so the data crc copies 4 MiB at a time

# TF DataType enum value -> (numpy storage dtype, name). bfloat16 is stored as uint16 bits.
_DTYPES: dict[int, tuple[np.dtype, str]] = {
    1: (np.dtype("<f4"), "float32"),
    2: (np.dtype("<f8"), "float64"),
    3: (np.dtype("<i4"), "int32"),
    4: (np.dtype("u1"), "uint8"),
    5: (np.dtype("<i2"), "int16"),
    6: (np.dtype("i1"), "int8"),
    9: (np.dtype("<i8"), "int64"),
    10: (np.dtype("?"), "bool"),
    14: (np.dtype("<u2"), "bfloat16"),
    17: (np.dtype("<u2"), "uint16"),
    19: (np.dtype("<f2"), "float16"),
    22: (np.dtype("<u4"), "uint32"),
    23: (np.dtype("<u8"), "uint64"),
}
_DTYPE_NAMES = {1: "DT_FLOAT", 2: "DT_DOUBLE", 7: "DT_STRING", 8: "DT_COMPLEX64", 18: "DT_COMPLEX128"}


# ---------------------------------------------------------------------------- crc32c


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


def _mask(crc: int) -> int:
    # TF/LevelDB store crcs masked, because a crc of data that embeds crcs is weak.
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def _crc32c_of_buffer(buf: np.ndarray) -> int:
    """crc32c of a uint8 array; google-crc32c rejects numpy buffers, so feed it bytes chunks."""
    crc = 0
    view = memoryview(buf)
    for start in range(0, len(view), _CRC_CHUNK):
        crc = _google_crc32c.extend(crc, view[start : start + _CRC_CHUNK].tobytes())
    return crc


# ------------------------------------------------------------------ protobuf wire format


class _ProtoError(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise _ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _ProtoError("varint longer than 10 bytes")


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """Decode one message into (field_number, value): varints and fixed as int, the rest as bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise _ProtoError("truncated fixed64")
            (value,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise _ProtoError("truncated length-delimited field")
            value = buf[pos : pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise _ProtoError("truncated fixed32")
            (value,) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            raise _ProtoError(f"unsupported wire type {wire} (field {field})")
        out.append((field, value))
    return out


def _parse_header(buf: bytes) -> dict:
    # BundleHeaderProto: 1 num_shards, 2 endianness (0 little, 1 big), 3 version (VersionDef)
    header = {"num_shards": 0, "endianness": 0, "min_consumer": 0}
    for field, value in _fields(buf):
        if field == 1:
            header["num_shards"] = _signed64(value)
        elif field == 2:
            header["endianness"] = value
        elif field == 3:
            for vfield, vvalue in _fields(value):
                if vfield == 2:  # VersionDef.min_consumer
                    header["min_consumer"] = _signed64(vvalue)
    return header


def _parse_shape(buf: bytes) -> tuple[int, ...]:
    # TensorShapeProto: 2 dim (repeated Dim: 1 size, 2 name), 3 unknown_rank
    dims = []
    for field, value in _fields(buf):
        if field == 2:
            size = 0
            for dfield, dvalue in _fields(value):
                if dfield == 1:
                    size = _signed64(dvalue)
            dims.append(size)
        elif field == 3 and value:
            raise _ProtoError("shape has unknown rank")
    return tuple(dims)


def _parse_entry(buf: bytes) -> dict:
    # BundleEntryProto: 1 dtype, 2 shape, 3 shard_id, 4 offset, 5 size, 6 crc32c (fixed32), 7 slices
    entry = {"dtype": 0, "shape": (), "shard_id": 0, "offset": 0, "size": 0, "crc32c": None, "slices": 0}
    for field, value in _fields(buf):
        if field == 1:
            entry["dtype"] = value
        elif field == 2:
            entry["shape"] = _parse_shape(value)
        elif field in (3, 4, 5):
            entry[{3: "shard_id", 4: "offset", 5: "size"}[field]] = _signed64(value)
        elif field == 6:
            entry["crc32c"] = value
        elif field == 7:
            entry["slices"] += 1
    return entry


# ----------------------------------------------------------------------- SSTable (.index)


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
        actual = _mask(crc32c(data[offset : offset + size + 1]))  # crc covers contents + type byte
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
            shared, pos = _varint(block, pos)
            non_shared, pos = _varint(block, pos)
            value_len, pos = _varint(block, pos)
            if shared > len(key) or pos + non_shared + value_len > limit:
                raise _ProtoError("entry runs past the end of its block")
            key = key[:shared] + block[pos : pos + non_shared]
            pos += non_shared
            entries.append((key, block[pos : pos + value_len]))
            pos += value_len
    except _ProtoError as e:
        raise CheckpointError(f"{path}: corrupt index block: {e}") from None
    return entries


def _read_table(path: Path, verify: bool) -> list[tuple[bytes, bytes]]:
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
        _meta_offset, pos = _varint(footer, 0)
        _meta_size, pos = _varint(footer, pos)
        index_offset, pos = _varint(footer, pos)
        index_size, pos = _varint(footer, pos)
    except _ProtoError as e:
        raise CheckpointError(f"{path}: corrupt footer: {e}") from None
    entries = []
    for _sep, handle in _block_entries(_block(data, index_offset, index_size, path, verify), path):
        try:
            offset, p = _varint(handle, 0)
            size, _ = _varint(handle, p)
        except _ProtoError as e:
            raise CheckpointError(f"{path}: corrupt block handle in index block: {e}") from None
        entries.extend(_block_entries(_block(data, offset, size, path, verify), path))
    return entries


# ------------------------------------------------------------------------- the bundle


def _resolve_prefix(prefix: str | os.PathLike) -> Path:
    """``dir/model.ckpt`` as given; a directory via its ``checkpoint`` file, else ``dir/model.ckpt``."""
    p = Path(prefix)
    if p.name.endswith(".index") and p.is_file():
        return p.with_name(p.name[: -len(".index")])
    if not p.is_dir():
        return p
    return checkpoint_prefix(p)


def checkpoint_prefix(directory: Path) -> Path:
    """The prefix the directory's ``checkpoint`` file names, taken inside the directory; else model.ckpt.

    TensorFlow writes the path the checkpoint was saved under, often absolute and from another
    machine; the files are read from beside the ``checkpoint`` file, never from elsewhere.
    """
    state = directory / "checkpoint"
    if not state.is_file():
        return directory / "model.ckpt"
    text = state.read_bytes().decode("utf-8", errors="replace")
    m = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', text, re.MULTILINE)
    if not m:
        return directory / "model.ckpt"
    named = Path(m.group(1))
    if named.is_absolute() or ".." in named.parts:
        candidate = directory / named.name  # written elsewhere; the copy beside the checkpoint file
    else:
        candidate = directory / named
    if not Path(f"{candidate}.index").is_file():
        raise CheckpointError(f"{state} names {m.group(1)!r}, but there is no {candidate.name}.index "
                              f"in {directory}")
    return candidate


def _read_index(prefix: Path, verify: bool) -> tuple[dict, dict[str, dict]]:
    index_path = Path(f"{prefix}.index")
    header = None
    entries: dict[str, dict] = {}
    for key, value in _read_table(index_path, verify):
        what = "the bundle header" if key == b"" else f"tensor {key.decode('utf-8', 'replace')!r}"
        try:
            if key == b"":
                header = _parse_header(value)
            else:
                entries[key.decode("utf-8")] = _parse_entry(value)
        except (_ProtoError, UnicodeDecodeError, TypeError) as e:  # TypeError: wrong wire type
            raise CheckpointError(f"{index_path}: cannot decode {what}: {e}") from None
    if header is None:
        raise CheckpointError(f"{index_path}: no bundle header (empty key); not a TF v2 checkpoint index")
    if header["num_shards"] < 1:
        raise CheckpointError(f"{index_path}: bundle header says num_shards={header['num_shards']}")
    if header["endianness"] != 0:
        raise CheckpointError(f"{index_path}: big-endian checkpoints are not supported")
    if header["min_consumer"] > 1:
        raise CheckpointError(
            f"{index_path}: bundle needs a reader of version >= {header['min_consumer']}; this one reads 1"
        )
    for name, entry in entries.items():
        _check_entry(index_path, name, entry, header["num_shards"])
    return header, entries


def _check_entry(index_path: Path, name: str, entry: dict, num_shards: int) -> None:
    where = f"{index_path}: tensor {name!r}"
    if entry["slices"]:
        raise CheckpointError(f"{where} is a partitioned (sliced) variable; not supported")
    if entry["dtype"] not in _DTYPES:
        dt = _DTYPE_NAMES.get(entry["dtype"], f"DataType {entry['dtype']}")
        supported = ", ".join(n for _, n in _DTYPES.values())
        raise CheckpointError(f"{where} has dtype {dt}; supported: {supported}")
    if any(d < 0 for d in entry["shape"]):
        raise CheckpointError(f"{where} has a negative dimension in shape {entry['shape']}")
    if not 0 <= entry["shard_id"] < num_shards:
        raise CheckpointError(f"{where} is in shard {entry['shard_id']} of {num_shards}")
    expected = int(np.prod(entry["shape"], dtype=np.int64)) * _DTYPES[entry["dtype"]][0].itemsize
    if entry["size"] != expected:
        raise CheckpointError(
            f"{where}: stored size {entry['size']} bytes does not match shape {entry['shape']} x "
            f"{_DTYPES[entry['dtype']][1]} = {expected} bytes"
        )


def list_tf_checkpoint(prefix: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, stored dtype name, e.g. ``"float32"``, ``"bfloat16"``), from the index only.

    ``prefix`` is ``dir/model.ckpt`` (the files are ``prefix + ".index"`` and ``prefix + ".data-*"``)
    or the checkpoint directory. Raises CheckpointError if the index is missing or corrupt.
    """
    _, entries = _read_index(_resolve_prefix(prefix), verify=True)
    return {name: (e["shape"], _DTYPES[e["dtype"]][1]) for name, e in entries.items()}


def read_tf_checkpoint(prefix: str | os.PathLike, *, verify: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a TF v2 checkpoint as a writable numpy array, keyed by TF variable name.

    ``prefix`` is ``dir/model.ckpt`` or the checkpoint directory (resolved through its
    ``checkpoint`` file, else ``model.ckpt``). bfloat16 tensors come back as float32; every
    other dtype as stored. ``verify`` checks crc32c (see the module docstring for when the
    per-tensor data crc is skipped); size and truncation checks always run.
    Raises CheckpointError naming the file and tensor on any missing, truncated or corrupt data.
    """
    prefix = _resolve_prefix(prefix)
    header, entries = _read_index(prefix, verify)
    num_shards = header["num_shards"]
    check_data_crc = verify and HAVE_FAST_CRC32C
    out: dict[str, np.ndarray] = {}
    by_shard: dict[int, list[str]] = {}
    for name, entry in entries.items():
        by_shard.setdefault(entry["shard_id"], []).append(name)
    for shard, names in sorted(by_shard.items()):
        data_path = Path(f"{prefix}.data-{shard:05d}-of-{num_shards:05d}")
        if not data_path.is_file():
            raise CheckpointError(
                f"{data_path}: checkpoint data file not found (needed for tensor {names[0]!r})"
            )
        with open(data_path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            for name in sorted(names, key=lambda n: entries[n]["offset"]):  # read sequentially
                out[name] = _read_tensor(f, data_path, file_size, name, entries[name], check_data_crc)
    return {name: out[name] for name in entries}  # index (sorted-key) order


def _read_tensor(f, data_path: Path, file_size: int, name: str, entry: dict, check_crc: bool) -> np.ndarray:
    offset, size = entry["offset"], entry["size"]
    if offset < 0 or offset + size > file_size:
        raise CheckpointError(
            f"{data_path}: tensor {name!r} spans bytes {offset}..{offset + size} but the file has only "
            f"{file_size} bytes; the data file is truncated"
        )
    buf = np.empty(size, dtype=np.uint8)
    f.seek(offset)
    if f.readinto(memoryview(buf)) != size:
        raise CheckpointError(f"{data_path}: short read of tensor {name!r}; the data file is truncated")
    if check_crc and entry["crc32c"] is not None:
        actual = _mask(_crc32c_of_buffer(buf))
        if actual != entry["crc32c"]:
            raise CheckpointError(
                f"{data_path}: crc32c mismatch for tensor {name!r} (stored {entry['crc32c']:#010x}, "
                f"computed {actual:#010x}); the data file is corrupt"
            )
    storage, dtype_name = _DTYPES[entry["dtype"]]
    arr = buf.view(storage).reshape(entry["shape"])
    if dtype_name == "bfloat16":  # bfloat16 is the top half of a float32
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr
