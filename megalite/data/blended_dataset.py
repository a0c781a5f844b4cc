"""BlendedDataset: interleave several datasets so each keeps its share of every prefix.

Megatron's greedy rule (helpers.cpp ``build_blending_indices``): sample i
goes to the dataset whose count lags furthest behind its target,
``argmax_d(weight_d * max(i, 1) - taken_d)`` (first index on ties). After any
prefix of n samples each dataset's count is within one sample of
``weight_d * n``. The loop is sequential by nature; it runs in plain Python
(about a million samples a second for three datasets) and is cached like
the GPT indices.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import numpy as np

from megalite.data.index_cache import cached_arrays

logger = logging.getLogger(__name__)


def parse_blend(paths: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """``[w1, p1, w2, p2, ...]`` -> (prefixes, weights); bare ``[p1, p2]`` -> weights None."""
    paths = [str(p) for p in paths]
    if not paths:
        raise ValueError("empty data path")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(paths) % 2 == 0 and all(is_number(w) for w in paths[0::2]):
        weights = [float(w) for w in paths[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--data-path weights must be non-negative with a positive sum: {weights}")
        return paths[1::2], weights
    if any(is_number(p) for p in paths):
        raise ValueError(f"--data-path: give either 'weight prefix' pairs or only prefixes, got {' '.join(paths)}")
    return paths, None


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to one, in numpy float64 as megatron-core's ``normalize``.

    numpy sums pairwise, Python's sum left to right: the last bit can differ,
    and the blend's greedy choice compares these floats.
    """
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


# megatron-core's default ``mid_level_dataset_surplus``: each part of a weighted
# blend is built this much larger than its share, so the greedy order never
# asks a part for more samples than it has.
SURPLUS = 0.005


def samples_per_dataset(num_samples: int, weights: Sequence[float], surplus: float = 0.0) -> list[int]:
    """Samples asked of each part for a blend of ``num_samples``: ceil(ceil(n * w) * (1 + surplus)).

    With surplus 0 these are the blend's targets (their sum is the blend's
    size); with :data:`SURPLUS` they are the sizes the parts are built with.
    """
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + surplus))) for w in normalize(weights)]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) by greedy error.

    The float arithmetic is helpers.cpp's (double products, ``max(i, 1)``,
    strict ``>`` so the first dataset wins a tie), so the order is its order.
    """
    w = normalize(weights)
    n = len(w)
    if n >= 32767:
        raise ValueError(f"a blend holds at most 32766 datasets, got {n}")
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * n
    others = range(1, n)
    for i in range(size):
        t = float(i) if i > 0 else 1.0
        best, best_err = 0, w[0] * t - taken[0]
        for d in others:
            err = w[d] * t - taken[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    ``ds[i]`` is the sample of dataset ``dataset_index[i]`` numbered
    ``dataset_sample_index[i]`` (same keys as the parts). Each dataset must
    hold at least its share of samples (the builder requests a margin).
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        cache_dir: Optional[str] = None,
        description: Optional[dict] = None,
        write_cache: bool = True,
        split_name: str = "train",
    ):
        if len(datasets) != len(weights):
            raise ValueError("BlendedDataset: one weight per dataset")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        # "order" tells these caches from earlier megalite ones (uint8 indices, other
        # sizes), which then miss and are rebuilt instead of failing the dtype check
        desc = {
            "class": "BlendedDataset",
            "weights": self.weights,
            "size": size,
            "datasets": description or {},
            "order": "megatron-core 0.16",
        }
        spec = {"dataset_index": (np.dtype(np.int16), (size,)), "dataset_sample_index": (np.dtype(np.int64), (size,))}

        def build() -> dict:
            d, s = build_blending_indices(self.weights, size)
            return {"dataset_index": d, "dataset_sample_index": s}

        arrays, self.cache_hit = cached_arrays(cache_dir, desc, spec, build, write_cache)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, ds in enumerate(self.datasets):
            if counts[d] > len(ds):
                raise ValueError(
                    f"the {split_name} blend asks dataset {d} for {counts[d]} samples but it has {len(ds)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
