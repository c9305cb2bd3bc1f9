"""The TensorFlow tensor-bundle reader, against a checkpoint written by real TensorFlow.

tests/fixtures/openai_tf_tiny/ comes from scripts/make_tf_fixture.py (tf.compat.v1 Saver, the
OpenAI GPT-2 variable layout); reference.npz holds the values TensorFlow reported. Comparisons
are bit-exact: the reader copies bytes, so any tolerance would hide a bug.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import gpt2kit.checkpoint.crc32c as crcmod
from gpt2kit.checkpoint.crc32c import crc32c, crc32c_python, mask
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.checkpoint.sstable import read_table
from gpt2kit.checkpoint.tf_bundle import list_tf_checkpoint, read_tf_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "openai_tf_tiny"
DATA_NAME = "model.ckpt.data-00000-of-00001"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "reference.npz") as npz:
        return {name: npz[name] for name in npz.files}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A private copy of the fixture that a test may damage."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "ckpt"))


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _footer_handles(index: bytes) -> list[int]:
    """(metaindex offset, size, index offset, size) from the SSTable footer, decoded independently."""
    footer, values, pos = index[-48:], [], 0
    for _ in range(4):
        value = shift = 0
        while True:
            b = footer[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        values.append(value)
    return values


def _assert_bit_exact(got: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(reference)
    for name, ref in reference.items():
        arr = got[name]
        assert arr.dtype == ref.dtype == np.float32, name
        assert arr.shape == ref.shape, name
        assert arr.tobytes() == ref.tobytes(), name


def test_reads_exactly_what_tensorflow_wrote(reference):
    got = read_tf_checkpoint(FIXTURE / "model.ckpt")
    _assert_bit_exact(got, reference)
    hp = {"n_vocab": 1000, "n_ctx": 64, "n_embd": 32, "n_layer": 2}
    assert got["model/wte"].shape == (hp["n_vocab"], hp["n_embd"])
    assert got["model/h1/mlp/c_fc/w"].shape == (1, hp["n_embd"], 4 * hp["n_embd"])
    assert all(arr.flags.writeable for arr in got.values())  # torch.from_numpy warns otherwise


@pytest.mark.parametrize("form", ["dir", "dir_str", "index_file"])
def test_prefix_forms(reference, form):
    prefix = {"dir": FIXTURE, "dir_str": str(FIXTURE), "index_file": FIXTURE / "model.ckpt.index"}[form]
    _assert_bit_exact(read_tf_checkpoint(prefix), reference)


def test_directory_with_absolute_checkpoint_path_prefers_local_copy(ckpt, reference):
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "/nonexistent/elsewhere/model.ckpt"\n')
    _assert_bit_exact(read_tf_checkpoint(ckpt), reference)


def test_list_matches_reference(reference):
    listed = list_tf_checkpoint(FIXTURE / "model.ckpt")
    assert listed == {name: (ref.shape, "float32") for name, ref in reference.items()}
    assert listed == list_tf_checkpoint(FIXTURE)


def test_list_does_not_need_the_data_file(ckpt, reference):
    (ckpt / DATA_NAME).unlink()
    assert set(list_tf_checkpoint(ckpt)) == set(reference)


def test_truncated_data_file(ckpt):
    data = ckpt / DATA_NAME
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated") as info:
        read_tf_checkpoint(ckpt / "model.ckpt")
    assert str(data) in str(info.value)
    assert "tensor 'model/" in str(info.value)


def test_missing_data_file_is_named(ckpt):
    (ckpt / DATA_NAME).unlink()
    with pytest.raises(CheckpointError, match="not found") as info:
        read_tf_checkpoint(ckpt / "model.ckpt")
    assert str(ckpt / DATA_NAME) in str(info.value)


def test_missing_index_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="not found") as info:
        read_tf_checkpoint(tmp_path / "model.ckpt")
    assert str(tmp_path / "model.ckpt.index") in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_index_magic(ckpt):
    index = ckpt / "model.ckpt.index"
    _flip_byte(index, index.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="magic") as info:
        read_tf_checkpoint(ckpt / "model.ckpt")
    assert str(index) in str(info.value)


@pytest.mark.parametrize("fast", [True, False], ids=["google_crc32c", "pure_python"])
def test_index_block_crc_mismatch(ckpt, monkeypatch, fast):
    if fast and not crcmod.HAVE_FAST_CRC32C:
        pytest.skip("google-crc32c (C implementation) is not installed")
    monkeypatch.setattr(crcmod, "HAVE_FAST_CRC32C", fast)
    index = ckpt / "model.ckpt.index"
    _flip_byte(index, 10)  # inside the first data block (the bundle header entry)
    with pytest.raises(CheckpointError, match="crc32c mismatch in index block") as info:
        list_tf_checkpoint(ckpt)
    assert str(index) in str(info.value)


def test_compressed_index_block_is_refused(ckpt):
    index = ckpt / "model.ckpt.index"
    data = bytearray(index.read_bytes())
    _, _, index_offset, index_size = _footer_handles(bytes(data))
    assert data[index_offset + index_size] == 0  # TF writes blocks uncompressed
    data[index_offset + index_size] = 1  # snappy
    index.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="snappy-compressed"):
        read_tf_checkpoint(ckpt, verify=False)  # past the crc, which would catch this first


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _sstable_block(entries: list[tuple[bytes, bytes]], restart_interval: int) -> bytes:
    """A LevelDB block: prefix-compressed entries, full keys at restart points, restart array."""
    body, restarts, prev = bytearray(), [], b""
    for i, (key, value) in enumerate(entries):
        shared = 0
        if i % restart_interval == 0:
            restarts.append(len(body))
        else:
            while shared < min(len(key), len(prev)) and key[shared] == prev[shared]:
                shared += 1
        body += _varint_bytes(shared) + _varint_bytes(len(key) - shared) + _varint_bytes(len(value))
        body += key[shared:] + value
        prev = key
    return (
        bytes(body)
        + b"".join(r.to_bytes(4, "little") for r in restarts)
        + len(restarts).to_bytes(4, "little")
    )


def _write_sstable(entries: list[tuple[bytes, bytes]], per_block: int) -> bytes:
    """An uncompressed SSTable with many small data blocks, as a big checkpoint's index has."""
    out, index_entries = bytearray(), []

    def emit(block: bytes) -> bytes:
        handle = _varint_bytes(len(out)) + _varint_bytes(len(block))
        crc = mask(crc32c_python(block + b"\x00"))
        out.extend(block + b"\x00" + crc.to_bytes(4, "little"))
        return handle

    for start in range(0, len(entries), per_block):
        chunk = entries[start : start + per_block]
        index_entries.append((chunk[-1][0], emit(_sstable_block(chunk, restart_interval=3))))
    meta_handle = emit(_sstable_block([], restart_interval=1))
    index_handle = emit(_sstable_block(index_entries, restart_interval=1))
    footer = (meta_handle + index_handle).ljust(40, b"\x00") + (0xDB4775248B80FB57).to_bytes(8, "little")
    return bytes(out) + footer


def test_index_with_many_blocks_and_restarts(ckpt, reference):
    entries = read_table(ckpt / "model.ckpt.index", verify=True)
    assert len(entries) == len(reference) + 1  # + the bundle header under the empty key
    (ckpt / "model.ckpt.index").write_bytes(_write_sstable(entries, per_block=5))
    _assert_bit_exact(read_tf_checkpoint(ckpt), reference)


def _flip_inside_tensor(ckpt: Path, reference: dict[str, np.ndarray], name: str) -> None:
    data = ckpt / DATA_NAME
    offset = data.read_bytes().find(reference[name].tobytes())
    assert offset >= 0
    _flip_byte(data, offset + reference[name].nbytes // 2)


def test_flipped_data_byte_fails_crc(ckpt, reference):
    if not crcmod.HAVE_FAST_CRC32C:
        pytest.skip("per-tensor data crc is checked only with google-crc32c (C implementation)")
    _flip_inside_tensor(ckpt, reference, "model/h0/attn/c_attn/w")
    with pytest.raises(CheckpointError, match="crc32c mismatch") as info:
        read_tf_checkpoint(ckpt)
    assert "model/h0/attn/c_attn/w" in str(info.value)
    assert str(ckpt / DATA_NAME) in str(info.value)


def test_verify_false_and_slow_crc_skip_the_data_crc(ckpt, reference, monkeypatch):
    name = "model/h0/attn/c_attn/w"
    _flip_inside_tensor(ckpt, reference, name)
    got = read_tf_checkpoint(ckpt, verify=False)
    assert got[name].tobytes() != reference[name].tobytes()  # the damage is read, not hidden
    monkeypatch.setattr(crcmod, "HAVE_FAST_CRC32C", False)  # documented: no C crc32c, no data crc
    got = read_tf_checkpoint(ckpt)
    assert got[name].tobytes() != reference[name].tobytes()
    assert got["model/wte"].tobytes() == reference["model/wte"].tobytes()


# RFC 3720 (iSCSI) B.4 test vectors plus the classic check value
CRC32C_VECTORS = [
    (b"123456789", 0xE3069283),
    (b"", 0x00000000),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
]


@pytest.mark.parametrize("impl", ["python", "default"])
@pytest.mark.parametrize(("data", "expected"), CRC32C_VECTORS)
def test_crc32c_known_vectors(impl, data, expected):
    fn = crc32c_python if impl == "python" else crc32c
    assert fn(data) == expected
    assert fn(data[4:], fn(data[:4])) == expected  # continuing a crc


def test_crc32c_chunked_buffer_matches_python():
    if not crcmod.HAVE_FAST_CRC32C:
        pytest.skip("google-crc32c (C implementation) is not installed")
    buf = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    assert crcmod.crc32c_of_buffer(buf, chunk=7) == crc32c_python(buf.tobytes())  # many chunks, one partial
    assert crcmod.crc32c_of_buffer(buf) == crc32c_python(buf.tobytes())
