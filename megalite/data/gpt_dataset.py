"""GPTDataset: fixed-length samples cut across document boundaries, as Megatron builds them.

Three index arrays, built with numpy from ``seed`` exactly as Megatron's
GPTDataset (and its C++ ``build_sample_idx``) builds them::

    document_index  [E * D]     int32   the split's documents, repeated over E
                                        epochs and shuffled (numpy RandomState)
    sample_index    [N + 1, 2]  int32   sample i spans (doc position, offset)
                                        sample_index[i] .. sample_index[i+1],
                                        inclusive: seq_length + 1 tokens, the
                                        last token shared with sample i + 1
    shuffle_index   [N]         uint32  permutation of the samples

When the last epoch is needed only for a few samples (< 80% of one), it is
shuffled separately so those samples are not drawn from the whole epoch mix.
The arrays (dtypes included) and the --split document ranges equal
megatron-core 0.16's for the same inputs; tests/unit/test_data_megatron_parity.py
checks them against megatron-core itself. They are cached as .npy (see
index_cache.py) and loaded by memory map.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Optional

import numpy as np

from megalite.data.index_cache import cached_arrays
from megalite.data.indexed_dataset import IndexedDataset, idx_path

logger = logging.getLogger(__name__)


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> train/valid/test weights normalized as megatron-core does.

    Missing parts are 0. The division is numpy's float64 one, as in
    megatron-core's ``normalize``, so the split boundaries below round
    exactly as Megatron's do.
    """
    try:
        parts = [float(x) for x in re.split(r"[,/\s]+", split.strip()) if x]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or any(not p >= 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative weights, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    w = np.array(parts, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_document_ranges(split: str, num_documents: int) -> list[Optional[tuple[int, int]]]:
    """megatron-core's [begin, end) document range of each split, None for a zero-weight split.

    The bookends are running float sums of the normalized weights, each
    rounded on its own (``round(bookend * n)``), as in
    BlendedMegatronDatasetBuilder: two splits share a boundary, so the ranges
    tile [0, n) without gaps. (Legacy Megatron-LM rounded each weight and
    shifted the ends; that differs for many document counts.)
    """
    bookends = [0]
    for w in parse_split(split):
        bookends.append(bookends[-1] + w)
    ranges: list[Optional[tuple[int, int]]] = []
    for lo, hi in zip(bookends[:-1], bookends[1:]):
        if hi <= lo:  # megatron-core's split matrix has None here: no dataset at all
            ranges.append(None)
        else:
            ranges.append((int(round(lo * float(num_documents))),
                           int(round(hi * float(num_documents)))))
    return ranges


def num_epochs_needed(tokens_per_epoch: int, seq_length: int,
                      num_samples: Optional[int]) -> int:
    """Smallest epoch count whose tokens make ``num_samples`` samples (+1 extra token).

    ``num_samples`` None (a part of an unweighted blend) means one epoch.
    """
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def num_samples_built(tokens_per_epoch: int, seq_length: int, num_epochs: int) -> int:
    """Samples the sample index holds: every full sample the epochs' tokens make."""
    return (num_epochs * tokens_per_epoch - 1) // seq_length


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int],
                         num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch alone when < 80% of it is used."""
    if num_epochs == 1 or num_samples is None:
        return False
    before_last = num_samples_built(tokens_per_epoch, seq_length, num_epochs - 1)
    from_last = num_samples - before_last
    per_epoch = num_samples_built(tokens_per_epoch, seq_length, 1)
    return from_last < int(0.80 * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """Documents repeated ``num_epochs`` times and shuffled (int32)."""
    if not separate_final or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def sample_index_dtype(largest_size: int, document_index_length: int) -> np.dtype:
    """int32 unless a position or offset could pass int32: megatron-core's rule, on the
    largest sequence of the whole dataset and the document index's length."""
    largest = max(document_index_length, largest_size)
    return np.dtype(np.int32 if largest <= np.iinfo(np.int32).max else np.int64)


def largest_sequence(indexed: IndexedDataset) -> int:
    """The longest sequence's length, scanning the lengths only when it can matter.

    The dataset's token count bounds it and costs nothing (last pointer plus
    last length); a full scan of a billion-sequence index is paid only when
    that bound passes int32.
    """
    sizes = indexed.sequence_lengths
    if len(sizes) == 0:
        return 0
    total = int(indexed.sequence_pointers[-1]) // indexed.dtype.itemsize + int(sizes[-1])
    return total if total <= np.iinfo(np.int32).max else int(sizes.max())


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """Start (position in document_index, token offset) of every sample, plus the end.

    Sample i covers stream tokens [i * seq_length, (i + 1) * seq_length], so
    boundary i is the token at stream position i * seq_length; it lies in
    the last document whose start is <= that position (empty documents are
    passed over, as in Megatron's C++ loop). Vectorized: one cumsum and one
    searchsorted, about a second for 10M documents. ``sizes`` is every
    sequence length of the dataset (it also decides the dtype, as Megatron's).
    """
    doc_sizes = sizes[document_index].astype(np.int64)
    starts = np.zeros(len(doc_sizes), dtype=np.int64)
    np.cumsum(doc_sizes[:-1], out=starts[1:])
    total = int(starts[-1] + doc_sizes[-1]) if len(doc_sizes) else 0
    num_samples = (total - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(starts, positions, side="right") - 1
    offsets = positions - starts[doc_pos]
    doc_pos[0], offsets[0] = 0, 0  # Megatron always starts at (0, 0)
    dtype = sample_index_dtype(int(sizes.max(initial=0)), len(document_index))
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0], out[:, 1] = doc_pos, offsets
    return out


def shuffle_index_dtype(total_size: int) -> np.dtype:
    """uint32, or int64 for indices past uint32 (megatron-core's rule)."""
    return np.dtype(np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64)


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) then, separately, of [num_samples, total_size)."""
    dtype = shuffle_index_dtype(total_size)
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def data_fingerprint(prefix: str) -> str:
    """Cheap identity of a dataset's content: .idx size plus md5 of its head and tail."""
    path = idx_path(prefix)
    size = os.path.getsize(path)
    h = hashlib.md5(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens over a range of an IndexedDataset's documents.

    ``documents`` are sequence indices of ``indexed`` (one sequence per
    document, as our preprocessing and Megatron's write them). ``len(ds)`` is
    at least ``num_samples``; ``num_samples`` None builds exactly one epoch
    (megatron-core's mid-level datasets of an unweighted blend).
    ``ds[i]`` is ``{"text": int64 array}``.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray,
                 num_samples: Optional[int], seq_length: int, seed: int,
                 cache_dir: Optional[str] = None, split_name: str = "train",
                 write_cache: bool = True):
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.documents = documents
        sizes = indexed.sequence_lengths
        tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
        if tokens_per_epoch == 0:
            raise ValueError(f"{indexed.prefix}: split {split_name!r} has no tokens")
        num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
        separate = separate_final_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
        total = num_samples_built(tokens_per_epoch, seq_length, num_epochs)
        description = {
            "class": "GPTDataset", "dataset_path": os.path.abspath(indexed.prefix),
            "fingerprint": data_fingerprint(indexed.prefix), "index_split": split_name,
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)],
            "num_samples": num_samples, "random_seed": seed, "sequence_length": seq_length,
            "add_extra_token_to_sequence": True,
        }
        doc_len = num_epochs * len(documents)
        spec = {"document_index": (np.dtype(np.int32), (doc_len,)),
                "sample_index": (sample_index_dtype(largest_sequence(indexed), doc_len),
                                 (total + 1, 2)),
                "shuffle_index": (shuffle_index_dtype(total), (total,))}

        def build() -> dict:
            rng = np.random.RandomState(seed)
            doc_index = build_document_index(documents, num_epochs, rng, separate)
            sample_index = build_sample_index(sizes, doc_index, seq_length)
            first = num_samples_built(tokens_per_epoch, seq_length, num_epochs - 1) \
                if separate else total
            return {"document_index": doc_index, "sample_index": sample_index,
                    "shuffle_index": build_shuffle_index(first, total, rng)}

        arrays, self.cache_hit = cached_arrays(cache_dir, description, spec, build, write_cache)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> dict:
        return {"text": self.get_tokens(idx)}

    def get_tokens(self, idx: int) -> np.ndarray:
        """Tokens of sample ``idx`` (after shuffling) as int64, length seq_length + 1."""
        i = int(self.shuffle_index[idx])
        beg, beg_off = (int(x) for x in self.sample_index[i])
        end, end_off = (int(x) for x in self.sample_index[i + 1])
        get, docs = self.indexed.get, self.document_index
        if beg == end:
            parts = [get(int(docs[beg]), beg_off, end_off - beg_off + 1)]
        else:
            parts = [get(int(docs[beg]), beg_off)]
            parts += [get(int(docs[j])) for j in range(beg + 1, end)]
            parts.append(get(int(docs[end]), 0, end_off + 1))
        return np.concatenate(parts).astype(np.int64)
