"""BlendedDataset: interleave several datasets so each keeps its share of every prefix.

Megatron's greedy rule (helpers.cpp ``build_blending_indices``): sample i
goes to the dataset whose count lags furthest behind its target,
``argmax_d(weight_d * max(i, 1) - taken_d)`` (first index on ties). After any
prefix of n samples each dataset's count is within one sample of
``weight_d * n``. The loop is sequential by nature; it runs in plain Python
at a few million samples a second per dataset and is cached like the GPT
indices.
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import numpy as np

from megalite.data.gpt_dataset import cached_arrays

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
            raise ValueError(f"--data-path weights must be non-negative with a positive sum: "
                             f"{weights}")
        return paths[1::2], weights
    if any(is_number(p) for p in paths):
        raise ValueError("--data-path: give either 'weight prefix' pairs or only prefixes, "
                         f"got {' '.join(paths)}")
    return paths, None


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to one."""
    total = float(sum(weights))
    return [w / total for w in weights]


def samples_per_dataset(num_samples: int, weights: Sequence[float]) -> list[int]:
    """Megatron's per-dataset request: ceil(ceil(n * w) * 1.005), a 0.5% margin."""
    return [int(math.ceil(math.ceil(num_samples * w) * 1.005)) for w in normalize(weights)]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index uint8/int16 [size], dataset_sample_index int64 [size]) by greedy error."""
    w = normalize(weights)
    n = len(w)
    dataset_index = np.empty(size, dtype=np.uint8 if n < 255 else np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * n
    order = range(n)
    for i in range(size):
        t = i if i > 0 else 1  # Megatron uses max(i, 1)
        best, best_err = 0, w[0] * t - taken[0]
        for d in order:
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

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int,
                 cache_dir: Optional[str] = None, description: Optional[dict] = None,
                 write_cache: bool = True):
        if len(datasets) != len(weights):
            raise ValueError("BlendedDataset: one weight per dataset")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        desc = {"class": "BlendedDataset", "weights": self.weights, "size": size,
                "datasets": description or {}}

        def build() -> dict:
            d, s = build_blending_indices(self.weights, size)
            return {"dataset_index": d, "dataset_sample_index": s}

        arrays, self.cache_hit = cached_arrays(cache_dir, desc,
                                               ("dataset_index", "dataset_sample_index"),
                                               build, write_cache)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, ds in enumerate(self.datasets):
            need = int((np.asarray(self.dataset_index) == d).sum())
            if need > len(ds):
                raise ValueError(f"BlendedDataset: dataset {d} has {len(ds)} samples, "
                                 f"blend needs {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
