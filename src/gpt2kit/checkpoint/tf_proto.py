"""The protobuf wire format (varints, fields) and the TensorFlow messages a bundle's index holds:
BundleHeaderProto, BundleEntryProto (with its TensorShapeProto), checked against the DataTypes read."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from gpt2kit.checkpoint.errors import CheckpointError

# TF DataType enum value -> (numpy storage dtype, name). bfloat16 is stored as uint16 bits.
DTYPES: dict[int, tuple[np.dtype, str]] = {
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


class ProtoError(Exception):
    """A message or varint that does not decode."""


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """Decode one message into (field_number, value): varints and fixed as int, the rest as bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        tag, pos = varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise ProtoError("truncated fixed64")
            (value,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
        elif wire == 2:
            n, pos = varint(buf, pos)
            if pos + n > len(buf):
                raise ProtoError("truncated length-delimited field")
            value = buf[pos : pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise ProtoError("truncated fixed32")
            (value,) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            raise ProtoError(f"unsupported wire type {wire} (field {field})")
        out.append((field, value))
    return out


def parse_header(buf: bytes) -> dict:
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
            raise ProtoError("shape has unknown rank")
    return tuple(dims)


def parse_entry(buf: bytes) -> dict:
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


def check_entry(index_path: Path, name: str, entry: dict, num_shards: int) -> None:
    where = f"{index_path}: tensor {name!r}"
    if entry["slices"]:
        raise CheckpointError(f"{where} is a partitioned (sliced) variable; not supported")
    if entry["dtype"] not in DTYPES:
        dt = _DTYPE_NAMES.get(entry["dtype"], f"DataType {entry['dtype']}")
        supported = ", ".join(n for _, n in DTYPES.values())
        raise CheckpointError(f"{where} has dtype {dt}; supported: {supported}")
    if any(d < 0 for d in entry["shape"]):
        raise CheckpointError(f"{where} has a negative dimension in shape {entry['shape']}")
    if not 0 <= entry["shard_id"] < num_shards:
        raise CheckpointError(f"{where} is in shard {entry['shard_id']} of {num_shards}")
    expected = int(np.prod(entry["shape"], dtype=np.int64)) * DTYPES[entry["dtype"]][0].itemsize
    if entry["size"] != expected:
        raise CheckpointError(
            f"{where}: stored size {entry['size']} bytes does not match shape {entry['shape']} x "
            f"{DTYPES[entry['dtype']][1]} = {expected} bytes"
        )
