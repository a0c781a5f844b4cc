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

The build is numpy only and faster than megatron-core's (benchmarks/bench_data.py):
the document index is shuffled as (document, size) pairs, which draws exactly
what Megatron's shuffle of the document index draws and hands the sample index
its sizes in order; the sample index is then a few sequential, chunked passes
(no per-document loop, no random gather, int64 temporaries of one chunk only).
numpy's shuffle itself is kept: Megatron's order depends on its draws.

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
            ranges.append((int(round(lo * float(num_documents))), int(round(hi * float(num_documents)))))
    return ranges


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
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


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int], num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch alone when < 80% of it is used."""
    if num_epochs == 1 or num_samples is None:
        return False
    before_last = num_samples_built(tokens_per_epoch, seq_length, num_epochs - 1)
    from_last = num_samples - before_last
    per_epoch = num_samples_built(tokens_per_epoch, seq_length, 1)
    return from_last < int(0.80 * per_epoch)


def _epochs_shuffled(
    items: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """``items`` repeated ``num_epochs`` times, shuffled as Megatron's _build_document_index shuffles.

    One shuffle of everything, or (``separate_final``) one of all but the last
    epoch and then one of the last. Shuffled in place, with no concatenation;
    with one epoch ``items`` itself is shuffled and returned (pass a fresh array).
    numpy's shuffle of a 1-D array draws one bounded integer per position
    whatever the item size, so the permutation depends only on the length.
    """
    if num_epochs == 1:
        rng.shuffle(items)
        return items
    n = len(items)
    out = np.empty(num_epochs * n, dtype=items.dtype)
    out.reshape(num_epochs, n)[:] = items
    if separate_final:
        rng.shuffle(out[: (num_epochs - 1) * n])
        rng.shuffle(out[(num_epochs - 1) * n :])
    else:
        rng.shuffle(out)
    return out


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """Documents repeated ``num_epochs`` times and shuffled (int32)."""
    return _epochs_shuffled(np.array(documents, dtype=np.int32), num_epochs, rng, separate_final)


def shuffled_documents(
    documents: np.ndarray, sizes: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """The document index and each of its entries' token count, from one shuffle.

    Returns an int32 array [E * D, 2]: column 0 is the document index, column 1
    the entries' sizes. Each (document, size) pair is shuffled as one 8-byte
    item: the same draws, so the same permutation, as shuffling the int32
    document index alone, in about the same time (the shuffle is bound by
    random memory access), and the sizes come out in document-index order
    without a random gather over ``sizes``. 8 bytes per entry (plus 8 per
    document while the epochs are laid out); with column 0 copied out after
    the sample index is built from column 1, the peak is 12 bytes per entry
    plus the sample index (megatron-core's numpy build: 20 bytes per entry).
    """
    pairs = np.empty((len(documents), 2), dtype=np.int32)
    pairs[:, 0] = documents
    pairs[:, 1] = np.take(sizes, documents)
    packed = _epochs_shuffled(pairs.view(np.int64).reshape(-1), num_epochs, rng, separate_final)
    return packed.view(np.int32).reshape(-1, 2)


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


def sample_index_from_sizes(
    doc_sizes: np.ndarray, seq_length: int, dtype: np.dtype, chunk: int = 1 << 16
) -> np.ndarray:
    """Start (position in the document index, token offset) of every sample, plus the end.

    ``doc_sizes[j]`` is the token count of document-index entry ``j``. Sample i
    covers stream tokens [i * seq_length, (i + 1) * seq_length], so boundary k
    is the token at stream position k * seq_length, in the entry whose tokens
    [start, end) hold it (empty entries hold none and are passed over, as in
    Megatron's C++ loop; boundary 0 is (0, 0) even before an empty entry, as
    there). Entry j holds boundaries up to (end - 1) // seq_length, so the
    boundaries per entry are differences of that; the entries holding any
    (np.flatnonzero, repeated where one holds several) give their rows. Done
    in chunks of ``chunk`` entries: sequential passes over ``doc_sizes`` (a
    strided view is fine), with int64 temporaries of one chunk only; about
    twice as fast as megatron-core's C++ loop, which gathers ``sizes`` at random.
    """
    total = int(doc_sizes.sum(dtype=np.int64))
    num_samples = max(total - 1, 0) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    start, done = 0, 0  # tokens before the chunk; boundaries placed (boundary 0 is (0, 0))
    for a in range(0, len(doc_sizes), chunk):
        if done == num_samples:
            break
        sizes = doc_sizes[a : a + chunk]
        ends = np.cumsum(sizes, dtype=np.int64)
        ends += start
        last = ends - 1
        last //= seq_length  # the last boundary at or before each entry's last token
        if start == 0:  # boundary 0 is placed already (and empty entries before it hold -1)
            np.maximum(last, 0, out=last)
        start = int(ends[-1])
        top = int(last[-1])
        if top == done:
            continue
        counts = np.empty_like(last)
        counts[0] = last[0] - done
        np.subtract(last[1:], last[:-1], out=counts[1:])
        holders = np.flatnonzero(counts)  # entries holding a boundary, usually one each
        if len(holders) < top - done:
            holders = np.repeat(holders, counts[holders])
        rows = out[done + 1 : top + 1]
        np.add(holders, a, out=rows[:, 0], casting="unsafe")
        ends -= sizes  # now each entry's first token
        offsets = np.arange(done + 1, top + 1, dtype=np.int64)
        offsets *= seq_length
        offsets -= ends[holders]
        rows[:, 1] = offsets
        done = top
    return out


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """Megatron's sample index of ``document_index`` over a dataset's sequence lengths ``sizes``.

    ``sizes`` is every sequence length of the dataset: its largest decides the
    dtype, as Megatron's. See :func:`sample_index_from_sizes`.
    """
    dtype = sample_index_dtype(int(sizes.max(initial=0)), len(document_index))
    return sample_index_from_sizes(np.take(sizes, document_index), seq_length, dtype)


def shuffle_index_dtype(total_size: int) -> np.dtype:
    """uint32, or int64 for indices past uint32 (megatron-core's rule)."""
    return np.dtype(np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
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

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: Optional[int],
        seq_length: int,
        seed: int,
        cache_dir: Optional[str] = None,
        split_name: str = "train",
        write_cache: bool = True,
    ):
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
            "class": "GPTDataset",
            "dataset_path": os.path.abspath(indexed.prefix),
            "fingerprint": data_fingerprint(indexed.prefix),
            "index_split": split_name,
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)],
            "num_samples": num_samples,
            "random_seed": seed,
            "sequence_length": seq_length,
            "add_extra_token_to_sequence": True,
        }
        doc_len = num_epochs * len(documents)
        spec = {
            "document_index": (np.dtype(np.int32), (doc_len,)),
            "sample_index": (sample_index_dtype(largest_sequence(indexed), doc_len), (total + 1, 2)),
            "shuffle_index": (shuffle_index_dtype(total), (total,)),
        }

        def build() -> dict:
            rng = np.random.RandomState(seed)
            pairs = shuffled_documents(documents, sizes, num_epochs, rng, separate)
            sample_index = sample_index_from_sizes(pairs[:, 1], seq_length, spec["sample_index"][0])
            doc_index = pairs[:, 0].copy()
            del pairs
            first = num_samples_built(tokens_per_epoch, seq_length, num_epochs - 1) if separate else total
            return {
                "document_index": doc_index,
                "sample_index": sample_index,
                "shuffle_index": build_shuffle_index(first, total, rng),
            }

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
