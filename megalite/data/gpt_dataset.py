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
The arrays are cached as .npy under a directory keyed by an md5 of every
input that defines them, written atomically, and loaded by memory map.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable, Optional

import numpy as np

from megalite.data.indexed_dataset import IndexedDataset, idx_path

logger = logging.getLogger(__name__)


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalized train/valid/test weights (missing parts are 0)."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative weights, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's split of ``num_documents`` into three contiguous [begin, end) ranges."""
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    excess = bounds[-1] - num_documents  # rounding may over/undershoot: shift the ends
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest epoch count whose tokens make ``num_samples`` samples (+1 extra token)."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                         num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch alone when < 80% of it is used."""
    if num_epochs == 1:
        return False
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
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


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """Start (position in document_index, token offset) of every sample, plus the end.

    Sample i covers stream tokens [i * seq_length, (i + 1) * seq_length], so
    boundary i is the token at stream position i * seq_length; it lies in
    the last document whose start is <= that position (empty documents are
    passed over, as in Megatron's C++ loop). Vectorized: one cumsum and one
    searchsorted, about a second for 10M documents.
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
    big = max(len(document_index), int(offsets.max(initial=0))) >= np.iinfo(np.int32).max
    out = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    out[:, 0], out[:, 1] = doc_pos, offsets
    return out


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) then, separately, of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
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


def cached_arrays(cache_dir: Optional[str], description: dict, names: tuple[str, ...],
                  build: Callable[[], dict], write: bool) -> tuple[dict, bool]:
    """Load arrays ``names`` from the cache keyed by ``description``, or build them.

    Returns (arrays, cache_hit). With ``write`` (the primary rank), a miss is
    built and saved as ``{md5}-{name}.npy`` (temporary name, then rename, the
    description .json last so its presence means complete). Without
    ``write``, a miss is built in memory with a warning (cache not shared).
    """
    text = json.dumps(description, sort_keys=True, indent=2)
    key = hashlib.md5(text.encode()).hexdigest()
    if cache_dir is not None:
        paths = {n: os.path.join(cache_dir, f"{key}-{n}.npy") for n in names}
        marker = os.path.join(cache_dir, f"{key}-description.json")
        if os.path.isfile(marker) and all(os.path.isfile(p) for p in paths.values()):
            return {n: np.load(p, mmap_mode="r", allow_pickle=False)
                    for n, p in paths.items()}, True
    t0 = time.time()
    arrays = build()
    logger.info("built %s indices in %.2fs", description.get("class"), time.time() - t0)
    if cache_dir is None:
        return arrays, False
    if not write:
        logger.warning("index cache %s missing on a non-primary rank (is --data-cache-path "
                       "shared?); built in memory", cache_dir)
        return arrays, False
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for n, p in paths.items():
            tmp = f"{p}.tmp-{os.getpid()}.npy"
            np.save(tmp, arrays[n], allow_pickle=False)
            os.replace(tmp, p)
        tmp = f"{marker}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, marker)
    except OSError as e:
        logger.warning("could not write index cache under %s (%s); using in-memory indices",
                       cache_dir, e)
    return arrays, False


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens over a range of an IndexedDataset's documents.

    ``documents`` are sequence indices of ``indexed`` (one sequence per
    document, as our preprocessing and Megatron's write them). ``len(ds)`` is
    at least ``num_samples``; ``ds[i]`` is ``{"text": int64 array}``.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache_dir: Optional[str] = None,
                 split_name: str = "train", write_cache: bool = True):
        self.indexed = indexed
        self.seq_length = seq_length
        sizes = indexed.sequence_lengths
        tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
        if tokens_per_epoch == 0:
            raise ValueError(f"{indexed.prefix}: split {split_name!r} has no tokens")
        num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
        separate = separate_final_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
        description = {
            "class": "GPTDataset", "dataset_path": os.path.abspath(indexed.prefix),
            "fingerprint": data_fingerprint(indexed.prefix), "index_split": split_name,
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)],
            "num_samples": num_samples, "random_seed": seed, "sequence_length": seq_length,
            "add_extra_token_to_sequence": True,
        }

        def build() -> dict:
            rng = np.random.RandomState(seed)
            doc_index = build_document_index(documents, num_epochs, rng, separate)
            sample_index = build_sample_index(sizes, doc_index, seq_length)
            n = sample_index.shape[0] - 1
            first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else n
            return {"document_index": doc_index, "sample_index": sample_index,
                    "shuffle_index": build_shuffle_index(first, n, rng)}

        arrays, self.cache_hit = cached_arrays(
            cache_dir, description, ("document_index", "sample_index", "shuffle_index"),
            build, write_cache)
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
