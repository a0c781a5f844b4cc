"""MMIDIDX indexed dataset: byte layout, round trip, merge, refusal of bad files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexFormatError,
    merge_datasets,
    optimal_dtype,
)


def _build(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix, dtype)
    for d in docs:
        b.add_item(np.array(d))
        b.end_document()
    b.finalize()
    return str(prefix)


def test_idx_header_fields_byte_by_byte(tmp_path):
    docs = [[1, 2, 3], [4], [5, 6]]
    prefix = _build(tmp_path / "d", docs)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17])[0] == 1
    assert raw[17] == 8  # uint16
    assert struct.unpack("<Q", raw[18:26])[0] == 3  # sequences
    assert struct.unpack("<Q", raw[26:34])[0] == 4  # documents + 1
    off = 34
    assert np.frombuffer(raw, np.int32, 3, off).tolist() == [3, 1, 2]
    off += 12
    assert np.frombuffer(raw, np.int64, 3, off).tolist() == [0, 6, 8]  # byte pointers
    off += 24
    assert np.frombuffer(raw, np.int64, 4, off).tolist() == [0, 1, 2, 3]
    assert len(raw) == off + 32
    assert open(prefix + ".bin", "rb").read() == np.array([1, 2, 3, 4, 5, 6], np.uint16).tobytes()


@pytest.mark.parametrize(
    "dtype, code",
    [
        (np.uint8, 1),
        (np.int8, 2),
        (np.int16, 3),
        (np.int32, 4),
        (np.int64, 5),
        (np.float64, 6),
        (np.float32, 7),
        (np.uint16, 8),
    ],
)
def test_dtype_codes_round_trip(tmp_path, dtype, code):
    prefix = _build(tmp_path / "d", [[1, 2], [3]], dtype)
    assert open(prefix + ".idx", "rb").read()[17] == code
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype) and ds[0].tolist() == [1, 2]


def test_optimal_dtype_threshold():
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32


def test_random_round_trip_and_slices(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, rng.integers(0, 40)) for _ in range(300)]
    ds = IndexedDataset(_build(tmp_path / "d", docs))
    assert len(ds) == 300 and ds.num_documents == 300
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d.tolist()
        if len(d) > 3:
            assert ds.get(i, 1, 2).tolist() == d[1:3].tolist()
    with pytest.raises(IndexError):
        ds.get(0, 0, len(docs[0]) + 1)


def test_multi_sequence_documents_and_merge(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "a", np.int32)
    b.add_document(np.arange(5), [2, 3])
    b.add_item([7, 8])
    b.end_document()
    b.finalize()
    _build(tmp_path / "b", [[9], [10, 11]], np.int32)
    n = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    m = IndexedDataset(tmp_path / "m")
    assert n == 5
    assert [m[i].tolist() for i in range(5)] == [[0, 1], [2, 3, 4], [7, 8], [9], [10, 11]]
    assert m.document_indices.tolist() == [0, 2, 3, 4, 5]
    _build(tmp_path / "c", [[1]], np.uint16)
    with pytest.raises(ValueError, match="dtype"):
        merge_datasets([tmp_path / "a", tmp_path / "c"], tmp_path / "bad")
    assert not os.path.exists(tmp_path / "bad.idx")


def test_unfinalized_builder_leaves_no_dataset(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    b.add_item([1, 2, 3])
    assert not os.path.exists(tmp_path / "d.idx") and not os.path.exists(tmp_path / "d.bin")
    b.abort()
    assert os.listdir(tmp_path) == []


def _corrupt(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: _corrupt(p + ".idx", 0, b"NOTMEGA"), "magic"),
        (lambda p: _corrupt(p + ".idx", 9, struct.pack("<Q", 2)), "version"),
        (lambda p: _corrupt(p + ".idx", 17, b"\x09"), "dtype code"),
        (lambda p: open(p + ".idx", "r+b").truncate(50), "does not match header"),
        (lambda p: open(p + ".idx", "r+b").truncate(10), "truncated"),
        (lambda p: open(p + ".bin", "r+b").truncate(7), "truncated .bin"),
        (lambda p: open(p + ".bin", "ab").write(b"xx"), "describes"),
        (
            lambda p: os.remove(p + ".bin"),
            r"file not found: .*d\.bin \(a dataset is the "
            r"\{prefix\}\.bin/\.idx pair written by tools/preprocess",
        ),
    ],
)
def test_bad_files_are_refused(tmp_path, damage, message):
    prefix = _build(tmp_path / "d", [[1, 2, 3], [4, 5]])
    damage(prefix)
    with pytest.raises((IndexFormatError, FileNotFoundError), match=message):
        IndexedDataset(prefix)


# Byte offsets in the .idx of _build(..., [[1, 2, 3], [4, 5]]): S = 2 sequences, D = 3.
_S = 2
_LEN, _PTR, _DOC = 34, 34 + 4 * _S, 34 + 12 * _S


def _put(path, offset, fmt, value):
    _corrupt(path, offset, struct.pack(fmt, value))


# (damage, file it must name, words of the problem), each on the 2-sequence uint16 pair.
_INDEX_CASES = {
    "magic": (lambda p: _corrupt(p + ".idx", 0, b"NOTMEGA"), ".idx", "magic"),
    "version": (lambda p: _put(p + ".idx", 9, "<Q", 2), ".idx", "unsupported index version 2"),
    "dtype code": (lambda p: _corrupt(p + ".idx", 17, b"\x00"), ".idx", "unknown dtype code 0"),
    "idx truncated in header": (lambda p: open(p + ".idx", "r+b").truncate(20), ".idx", "truncated index (20 bytes"),
    "idx truncated in arrays": (lambda p: open(p + ".idx", "r+b").truncate(60), ".idx", "truncated index"),
    "idx trailing bytes": (lambda p: open(p + ".idx", "ab").write(b"\0" * 8), ".idx", "trailing bytes"),
    "sequence count": (lambda p: _put(p + ".idx", 18, "<Q", 3), ".idx", "does not match header"),
    "negative length": (lambda p: _put(p + ".idx", _LEN + 4, "<i", -5), ".idx", "sequence 1 has negative length -5"),
    "first pointer": (lambda p: _put(p + ".idx", _PTR, "<q", 2), ".idx", "sequence pointer 0 is 2, expected 0"),
    "pointer past bin": (
        lambda p: _put(p + ".idx", _PTR + 8, "<q", 1 << 40),
        ".idx",
        "sequence pointer 1 is 1099511627776, past the end of the .bin (10 bytes)",
    ),
    "pointer overlaps": (
        lambda p: _put(p + ".idx", _PTR + 8, "<q", 2),
        ".idx",
        "sequence pointer 1 is 2, expected 6 (pointer 0 + length 3 x 2 bytes)",
    ),
    "docs start": (
        lambda p: _put(p + ".idx", _DOC, "<q", 1),
        ".idx",
        "document indices must start with 0 (first is 1)",
    ),
    "docs decrease": (
        lambda p: _put(p + ".idx", _DOC + 8, "<q", 3),
        ".idx",
        "document index 2 (2) is below document index 1 (3): document indices must be non-decreasing",
    ),
    "docs end short": (
        lambda p: _put(p + ".idx", _DOC + 16, "<q", 1),
        ".idx",
        "last document index 1 != sequence count 2",
    ),
    "docs end past count": (
        lambda p: _put(p + ".idx", _DOC + 16, "<q", 5),
        ".idx",
        "last document index 5 != sequence count 2",
    ),
    "bin odd size": (
        lambda p: open(p + ".bin", "r+b").truncate(7),
        ".bin",
        "not a multiple of the uint16 item size (2 bytes): truncated .bin",
    ),
    "bin truncated": (
        lambda p: open(p + ".bin", "r+b").truncate(8),
        ".bin",
        "size 8 bytes, but the index describes 10 bytes",
    ),
    "bin extra": (
        lambda p: open(p + ".bin", "ab").write(b"xx"),
        ".bin",
        "size 12 bytes, but the index describes 10 bytes",
    ),
    "wrong dtype code, size not a multiple": (
        lambda p: _corrupt(p + ".idx", 17, b"\x04"),
        ".bin",
        "not a multiple of the int32 item size",
    ),
}


@pytest.mark.parametrize("case", list(_INDEX_CASES))
def test_whole_index_is_checked_at_open(tmp_path, case):
    damage, suffix, problem = _INDEX_CASES[case]
    prefix = _build(tmp_path / "d", [[1, 2, 3], [4, 5]])
    damage(prefix)
    with pytest.raises(IndexFormatError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(prefix + suffix + ": "), msg  # names the file at fault
    assert problem in msg, msg
    assert msg.endswith("rebuild the dataset with tools/preprocess_data.py"), msg  # what to do


def test_wrong_dtype_code_with_plausible_size_is_caught_by_pointers(tmp_path):
    prefix = _build(tmp_path / "d", [[1, 2, 3], [4, 5, 6]])  # 12 bytes: a multiple of 4 too
    _corrupt(prefix + ".idx", 17, b"\x04")  # says int32, data is uint16
    with pytest.raises(IndexFormatError, match=r"d\.idx: sequence pointer 1 is 6, expected 12"):
        IndexedDataset(prefix)


def test_empty_sequences_documents_and_datasets_are_valid(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "e", np.uint16)
    b.add_item([])  # a zero-length sequence
    b.end_document()
    b.end_document()  # an empty document: a repeated document index
    b.add_item([7])
    b.finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert ds.document_indices.tolist() == [0, 1, 1, 2] and ds[1].tolist() == [7]
    IndexedDatasetBuilder(tmp_path / "z", np.uint16).finalize()
    assert len(IndexedDataset(tmp_path / "z")) == 0


def test_checks_find_faults_in_later_chunks(tmp_path, monkeypatch):
    import megalite.data.indexed_dataset as idx_mod

    monkeypatch.setattr(idx_mod, "_CHECK_CHUNK", 7)  # many chunks over 50 sequences
    prefix = _build(tmp_path / "d", [[i] * (i % 4) for i in range(50)])
    IndexedDataset(prefix)  # valid across chunk boundaries
    ptr = 34 + 4 * 50
    raw = open(prefix + ".idx", "rb").read()
    p = np.frombuffer(raw, np.int64, 50, ptr)
    _put(prefix + ".idx", ptr + 8 * 29, "<q", int(p[29]) + 2)
    with pytest.raises(IndexFormatError, match="sequence pointer 29 is"):
        IndexedDataset(prefix)
    _put(prefix + ".idx", ptr + 8 * 29, "<q", int(p[29]))
    doc = 34 + 12 * 50
    _put(prefix + ".idx", doc + 8 * 36, "<q", 0)
    with pytest.raises(IndexFormatError, match=r"document index 36 \(0\) is below"):
        IndexedDataset(prefix)


def test_open_is_lazy_memory_map(tmp_path):
    prefix = _build(tmp_path / "d", [np.arange(1000)] * 100)
    ds = IndexedDataset(prefix)
    assert isinstance(ds._bin, np.memmap)
    assert not ds[3].flags.writeable


def test_merge_tool_on_a_directory(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    shards = tmp_path / "shards"
    shards.mkdir()
    _build(shards / "b", [[3], [4, 5]])
    _build(shards / "a", [[1, 2]])
    out = subprocess.run(
        [sys.executable, "tools/merge_datasets.py", "--input", str(shards), "--output-prefix", str(tmp_path / "all")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    m = IndexedDataset(tmp_path / "all")
    assert [m[i].tolist() for i in range(len(m))] == [[1, 2], [3], [4, 5]]


def test_opening_a_100gb_dataset_reads_nothing(tmp_path):
    from megalite.data.indexed_dataset import write_index

    lengths = np.full(1000, 50_000_000, dtype=np.int32)  # 1000 x 100 MB of uint16
    write_index(str(tmp_path / "big.idx"), np.uint16, lengths, np.arange(1001))
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)  # sparse: no disk, no reads
    if os.stat(tmp_path / "big.bin").st_blocks > 1024:
        pytest.skip("filesystem without sparse files")
    ds = IndexedDataset(tmp_path / "big")
    assert ds.num_tokens == 50_000_000_000 and isinstance(ds._bin, np.memmap)
    assert ds.get(999, 49_999_990).tolist() == [0] * 10
