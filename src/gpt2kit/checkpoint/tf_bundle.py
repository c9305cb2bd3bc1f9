"""Read a TensorFlow v2 tensor-bundle checkpoint without TensorFlow (numpy only).

This is the format of OpenAI's GPT-2 release (``model.ckpt.index`` plus
``model.ckpt.data-00000-of-00001``, as fetched by openai/gpt-2's ``download_model.py``).

Layout, as written by TensorFlow's ``BundleWriter``:

* ``{prefix}.index`` is a LevelDB-format SSTable (read by sstable.py).
* The entry with the empty key is a ``BundleHeaderProto`` (num_shards, endianness, version);
  every other key is a tensor name whose value is a ``BundleEntryProto``
  (dtype, shape, shard_id, offset, size, masked crc32c of the tensor's bytes), decoded by tf_proto.py.
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
from pathlib import Path

import numpy as np

import gpt2kit.checkpoint.crc32c as crc
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.sstable import read_table
from gpt2kit.checkpoint.tf_proto import DTYPES, ProtoError, check_entry, parse_entry, parse_header

__all__ = ["checkpoint_prefix", "list_tf_checkpoint", "read_tf_checkpoint"]


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
    for key, value in read_table(index_path, verify):
        what = "the bundle header" if key == b"" else f"tensor {key.decode('utf-8', 'replace')!r}"
        try:
            if key == b"":
                header = parse_header(value)
            else:
                entries[key.decode("utf-8")] = parse_entry(value)
        except (ProtoError, UnicodeDecodeError, TypeError) as e:  # TypeError: wrong wire type
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
        check_entry(index_path, name, entry, header["num_shards"])
    return header, entries


def list_tf_checkpoint(prefix: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, stored dtype name, e.g. ``"float32"``, ``"bfloat16"``), from the index only.

    ``prefix`` is ``dir/model.ckpt`` (the files are ``prefix + ".index"`` and ``prefix + ".data-*"``)
    or the checkpoint directory. Raises CheckpointError if the index is missing or corrupt.
    """
    _, entries = _read_index(_resolve_prefix(prefix), verify=True)
    return {name: (e["shape"], DTYPES[e["dtype"]][1]) for name, e in entries.items()}


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
    check_data_crc = verify and crc.HAVE_FAST_CRC32C
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
        actual = crc.mask(crc.crc32c_of_buffer(buf))
        if actual != entry["crc32c"]:
            raise CheckpointError(
                f"{data_path}: crc32c mismatch for tensor {name!r} (stored {entry['crc32c']:#010x}, "
                f"computed {actual:#010x}); the data file is corrupt"
            )
    storage, dtype_name = DTYPES[entry["dtype"]]
    arr = buf.view(storage).reshape(entry["shape"])
    if dtype_name == "bfloat16":  # bfloat16 is the top half of a float32
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr
