"""Megatron-compatible memory-mapped indexed dataset (the ``MMIDIDX`` format).

A dataset is a pair of files sharing a path prefix::

    {prefix}.bin   raw token ids, all sequences back to back (no header)
    {prefix}.idx   header + three arrays describing where each sequence lives

    .idx layout (little endian)
    +--------------------+---------------------------------------------+
    | 9 bytes            | magic b"MMIDIDX\\x00\\x00"                     |
    | u64                | version = 1                                 |
    | u8                 | dtype code (see DTYPE_CODES)                |
    | u64                | sequence count S                            |
    | u64                | document count D (= documents + 1)          |
    | int32[S]           | sequence lengths (tokens)                   |
    | int64[S]           | sequence pointers (byte offsets in .bin)    |
    | int64[D]           | document indices: [0, end_of_doc_0, ...]    |
    +--------------------+---------------------------------------------+

The reader memory-maps both files, so opening a 100 GB dataset costs a few
page faults and no resident memory. The writer streams tokens to a temporary
.bin and writes the .idx last, then renames both, so a crash never leaves a
pair that looks valid.
"""

from __future__ import annotations

import array
import logging
import os
import struct
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}

PathLike = Union[str, os.PathLike]


class IndexFormatError(ValueError):
    """Raised when a .idx/.bin pair is truncated, foreign or inconsistent."""


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Return the token dtype Megatron picks for a vocabulary of this size.

    uint16 when the vocabulary is below 65500 (Megatron's threshold, leaving
    headroom below 2**16), int32 otherwise or when the size is unknown.
    """
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: PathLike) -> str:
    """Path of the index file for a dataset prefix."""
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: PathLike) -> str:
    """Path of the data file for a dataset prefix."""
    return f"{os.fspath(prefix)}.bin"


def dataset_exists(prefix: PathLike) -> bool:
    """True when both files of the dataset exist (says nothing about validity)."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def write_index(path: PathLike, dtype: type, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a .idx file for the given sequence lengths and document indices.

    Pointers are derived from the lengths (cumulative byte offsets), which is
    how Megatron writes them. The file is written in one go to ``path``; the
    caller is responsible for writing to a temporary name and renaming.
    """
    lengths = np.asarray(lengths, dtype=np.int32)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF_DTYPE[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(document_indices.tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams sequences into ``{prefix}.bin`` and writes ``{prefix}.idx`` at the end.

    Mirrors Megatron's builder (``add_item``, ``end_document``, ``add_document``,
    ``add_index``, ``finalize``). Both files are written under temporary names
    (``.tmp-<pid>``) and only renamed into place by :meth:`finalize`, the .bin
    first and the .idx last: an interrupted run leaves only ``*.tmp-*`` files.
    """

    def __init__(self, prefix: PathLike, dtype: type = np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = bin_path(prefix) + suffix
        self._idx_tmp = idx_path(prefix) + suffix
        Path(self._bin_tmp).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        # Compact growable C arrays (4/8 bytes an entry), not lists of Python ints:
        # a billion-document corpus must not need tens of GB for its index.
        self._lengths = array.array("i")
        self._doc_indices = array.array("q", [0])
        self.num_tokens = 0

    def add_item(self, tokens: Union[np.ndarray, Sequence[int]]) -> None:
        """Append one sequence (any int array-like) to the current document."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def add_raw(self, data: bytes, length: int) -> None:
        """Append a sequence already encoded in this builder's dtype (from a worker)."""
        self._bin.write(data)
        self._lengths.append(length)
        self.num_tokens += length

    def end_document(self) -> None:
        """Close the current document (all sequences added since the last call)."""
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        """Append a whole document made of consecutive sequences of ``lengths``."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if int(sum(lengths)) != arr.size:
            raise ValueError("document lengths do not add up to its token count")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.extend(int(n) for n in lengths)
        self.num_tokens += arr.size
        self.end_document()

    def add_index(self, prefix: PathLike, chunk_bytes: int = 64 << 20) -> None:
        """Append a whole existing dataset (same dtype), copying its .bin in chunks."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype} differs from {self.dtype}")
        offset = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.astype(np.int32).tobytes())
        ends = (other.document_indices[1:] + offset).astype(np.int64)
        self._doc_indices.frombytes(ends.tobytes())
        self.num_tokens += int(other.sequence_lengths.sum(dtype=np.int64))
        with open(bin_path(prefix), "rb") as src:
            while True:
                block = src.read(chunk_bytes)
                if not block:
                    break
                self._bin.write(block)

    def finalize(self) -> None:
        """Write the .idx and atomically move both files to their final names."""
        if self._doc_indices[-1] != len(self._lengths):
            self.end_document()  # an unterminated trailing document
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        write_index(
            self._idx_tmp,
            self.dtype.type,
            np.frombuffer(self._lengths, dtype=np.int32),
            np.frombuffer(self._doc_indices, dtype=np.int64),
        )
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        logger.info("wrote %s (.bin/.idx): %d sequences, %d tokens", self.prefix, len(self._lengths), self.num_tokens)

    def abort(self) -> None:
        """Close and delete the temporary files (after an error)."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)


_REBUILD = "rebuild the dataset with tools/preprocess_data.py"
# Elements per vectorised pass of the index checks: bounds the temporaries to
# about 30 MB however large the index (a 100M-sequence .idx is 2 GB).
_CHECK_CHUNK = 1 << 20


def _bad(path: str, problem: str) -> IndexFormatError:
    """The one-line refusal: file, what is wrong, what to do."""
    return IndexFormatError(f"{path}: {problem}; {_REBUILD}")


def _first_bad(mask, n: int) -> int:
    """First i in [0, n) where ``mask(start, stop)`` (a bool array) is True, or -1.

    Runs in chunks so that checking a huge memory-mapped index never holds
    more than one chunk's temporaries.
    """
    for start in range(0, n, _CHECK_CHUNK):
        bad = mask(start, min(n, start + _CHECK_CHUNK))
        if bad.any():
            return start + int(bad.argmax())
    return -1


def _read_header(path: str, idx_size: int) -> tuple[type, int, int]:
    """Parse and validate the fixed-size header; return (dtype, S, D)."""
    if idx_size < HEADER_SIZE:
        raise _bad(path, f"truncated index ({idx_size} bytes, header needs {HEADER_SIZE})")
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head[:9] != MAGIC:
        raise _bad(path, f"not a Megatron MMIDIDX index (magic {head[:9]!r}, expected {MAGIC!r})")
    version = struct.unpack("<Q", head[9:17])[0]
    if version != VERSION:
        raise _bad(path, f"unsupported index version {version} (expected {VERSION})")
    code = head[17]
    if code not in DTYPE_CODES:
        raise _bad(path, f"unknown dtype code {code} (valid: {min(DTYPE_CODES)}-{max(DTYPE_CODES)})")
    seq_count, doc_count = struct.unpack("<QQ", head[18:34])
    return DTYPE_CODES[code], seq_count, doc_count


class IndexedDataset:
    """Read-only, memory-mapped view of a ``{prefix}.bin/.idx`` pair.

    ``ds[i]`` returns sequence ``i`` as a numpy array (a view on the mmap);
    ``ds.get(i, offset, length)`` returns a slice of it. Opening checks the
    whole index (header, file sizes, lengths, pointers, document indices) in
    vectorised chunks, so a corrupt, truncated or foreign pair is refused at
    once with a one-line IndexFormatError naming the file and the problem,
    not hours into training.
    """

    def __init__(self, prefix: PathLike):
        self.prefix = os.fspath(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                # The usual slip is a path with .bin/.idx where the prefix is wanted.
                raise FileNotFoundError(
                    f"indexed dataset file not found: {p} (a dataset is the {{prefix}}.bin/.idx "
                    "pair written by tools/preprocess_data.py; give the prefix without .bin/.idx)"
                )
        idx_size = os.path.getsize(ipath)
        dtype, seq_count, doc_count = _read_header(ipath, idx_size)
        expected = HEADER_SIZE + seq_count * 12 + doc_count * 8
        if idx_size != expected:
            what = "truncated index" if idx_size < expected else "trailing bytes after the index"
            raise _bad(
                ipath,
                f"size {idx_size} bytes does not match header ({seq_count} "
                f"sequences, {doc_count} document indices -> {expected} bytes): {what}",
            )
        self.dtype = np.dtype(dtype)
        self._idx_mmap = np.memmap(ipath, mode="r", dtype=np.uint8)
        buf = self._idx_mmap
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, np.int32, seq_count, off)
        off += seq_count * 4
        self.sequence_pointers = np.frombuffer(buf, np.int64, seq_count, off)
        off += seq_count * 8
        self.document_indices = np.frombuffer(buf, np.int64, doc_count, off)
        bin_size = os.path.getsize(bpath)
        self._check_documents(ipath, seq_count)
        self._check_sequences(ipath, bpath, bin_size)
        self._bin = np.memmap(bpath, mode="r", dtype=self.dtype) if bin_size else np.zeros(0, dtype=self.dtype)

    def _check_documents(self, ipath: str, seq_count: int) -> None:
        """Document indices: 0 first, never decreasing, the sequence count last."""
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0:
            first = docs[0] if len(docs) else "none"
            raise _bad(ipath, f"document indices must start with 0 (first is {first})")
        i = _first_bad(lambda a, b: docs[a + 1 : b + 1] < docs[a:b], len(docs) - 1)
        if i >= 0:
            raise _bad(
                ipath,
                f"document index {i + 1} ({docs[i + 1]}) is below document index "
                f"{i} ({docs[i]}): document indices must be non-decreasing",
            )
        if docs[-1] != seq_count:
            raise _bad(ipath, f"last document index {docs[-1]} != sequence count {seq_count}")

    def _check_sequences(self, ipath: str, bpath: str, bin_size: int) -> None:
        """Lengths >= 0; pointers back to back from 0; the .bin exactly their extent.

        Megatron's writer (and ours) lays sequences out contiguously, so pointer
        i+1 must be pointer i plus length i items; with the first at 0 and the
        last ending at the .bin's end, every pointer is inside the .bin.
        """
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        itemsize = self.dtype.itemsize
        if bin_size % itemsize:
            raise _bad(
                bpath,
                f"size {bin_size} bytes is not a multiple of the {self.dtype} "
                f"item size ({itemsize} bytes): truncated .bin, or a wrong dtype code "
                "in the .idx",
            )
        i = _first_bad(lambda a, b: lengths[a:b] < 0, len(lengths))
        if i >= 0:
            raise _bad(ipath, f"sequence {i} has negative length {lengths[i]}")
        if len(pointers) and pointers[0] != 0:
            raise _bad(ipath, f"sequence pointer 0 is {pointers[0]}, expected 0")
        i = _first_bad(
            lambda a, b: pointers[a + 1 : b + 1] - pointers[a:b] != lengths[a:b].astype(np.int64) * itemsize,
            len(pointers) - 1,
        )
        if i >= 0:
            want = int(pointers[i]) + int(lengths[i]) * itemsize
            past = f", past the end of the .bin ({bin_size} bytes)" if pointers[i + 1] > bin_size else ""
            raise _bad(
                ipath,
                f"sequence pointer {i + 1} is {pointers[i + 1]}{past}, expected "
                f"{want} (pointer {i} + length {lengths[i]} x {itemsize} bytes)",
            )
        expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(pointers) else 0
        if bin_size != expected:
            raise _bad(
                bpath,
                f"size {bin_size} bytes, but the index describes {expected} bytes "
                "(truncated .bin, or .bin/.idx from different runs)",
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (document indices minus the leading 0)."""
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens in the dataset."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (a read-only view)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) out of sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]


def merge_datasets(input_prefixes: Iterable[PathLike], output_prefix: PathLike) -> int:
    """Concatenate datasets (same dtype) into ``output_prefix``; return sequences written.

    Used by ``tools/merge_datasets.py`` and by partitioned preprocessing. The
    output is written atomically (temporary names, then rename).
    """
    prefixes = [os.fspath(p) for p in input_prefixes]
    if not prefixes:
        raise ValueError("merge_datasets: no input datasets")
    dtype = IndexedDataset(prefixes[0]).dtype
    builder = IndexedDatasetBuilder(output_prefix, dtype.type)
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    return len(builder._lengths)
