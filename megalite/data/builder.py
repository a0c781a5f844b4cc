"""Builds the train/valid/test datasets the training loop asks for.

``--data-path`` (one prefix, ``w1 p1 w2 p2 ...`` or bare prefixes weighted
by the samples in one epoch of each) is cut by ``--split`` into document
ranges exactly as megatron-core cuts it;
``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` give a
split its own blend, used whole. Rank coordination is injected: the primary
rank builds and caches the indices, then calls ``barrier()``; the others
call ``barrier()`` first and load the cache. Nothing here talks to
torch.distributed.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Sequence

import numpy as np

from megalite.config import DataConfig
from megalite.data.blended_dataset import SURPLUS, BlendedDataset, normalize, parse_blend, samples_per_dataset
from megalite.data.gpt_dataset import GPTDataset, split_document_ranges
from megalite.data.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def default_cache_dir(prefix: str, kind: str) -> str:
    """Megatron-like default: a ``cache/{kind}_indices`` directory next to the data."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", f"{kind}_indices")


def megatron_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> tuple[int, int, int]:
    """The (train, valid, test) sample counts Megatron-LM asks its dataset builder for.

    Megatron evaluates ``eval_iters`` batches every ``eval_interval`` iterations
    and once more at the end, each evaluation going on where the last one
    stopped: (train_iters // eval_interval + 1) * eval_iters batches of
    validation; test is one evaluation. The counts decide how many epochs a
    split's indices span, so valid/test samples come in Megatron's order only
    when these exact counts are requested.
    """
    valid_iters = (train_iters // eval_interval + 1) * eval_iters if eval_interval > 0 else 0
    return (train_iters * global_batch_size, valid_iters * global_batch_size, eval_iters * global_batch_size)


class _Builder:
    """One build pass; opens each prefix once and shares it across splits.

    The structure is megatron-core's BlendedMegatronDatasetBuilder, case by
    case, since every case changes which indices get built:

    * one prefix without a weight: a GPTDataset of the requested size;
    * weights (even for one prefix): part d is asked for ceil(n * w_d) samples
      and built ``SURPLUS`` larger; the blend holds the sum of the asks (>= n);
    * several prefixes without weights: each part is one epoch of its
      documents, weighted by its sample count; the blend holds
      min(n, all their samples), which can be fewer than asked for.
    """

    def __init__(self, cfg: DataConfig, seq_length: int, seed: int, write_cache: bool):
        self.cfg, self.seq_length, self.seed = cfg, seq_length, seed
        self.write = write_cache
        self._opened: dict[str, IndexedDataset] = {}

    def open(self, prefix: str) -> IndexedDataset:
        """The memory-mapped dataset at ``prefix``, opened once per build."""
        if prefix not in self._opened:
            self._opened[prefix] = IndexedDataset(prefix)
        return self._opened[prefix]

    def documents(self, prefix: str, split: int, whole: bool) -> Optional[np.ndarray]:
        """Sequence indices of ``prefix`` in split ``split``; None for a zero-weight split."""
        n = len(self.open(prefix))
        bounds = (0, n) if whole else split_document_ranges(self.cfg.split, n)[split]
        return None if bounds is None else np.arange(*bounds, dtype=np.int32)

    def gpt(self, prefix: str, docs: np.ndarray, num_samples: Optional[int], split: int) -> GPTDataset:
        """A GPTDataset over ``docs`` of ``prefix``, its indices cached per the config."""
        cache = self.cfg.data_cache_path or default_cache_dir(prefix, "GPTDataset")
        return GPTDataset(
            self.open(prefix), docs, num_samples, self.seq_length, self.seed, cache, SPLIT_NAMES[split], self.write
        )

    def has_tokens(self, prefix: str, docs: np.ndarray, split: int) -> bool:
        """False (with a warning) when the split's share of ``prefix`` holds no tokens.

        A small dataset can round to no documents for a small split (e.g. the
        test part of 969,30,1 with fewer than 500 documents); megatron-core
        loops forever there. Leaving the dataset out of that split is the only
        sensible reading.
        """
        if int(self.open(prefix).sequence_lengths[docs].sum(dtype=np.int64)) > 0:
            return True
        logger.warning(
            "%s: no tokens in the %s split (documents %d..%d of %d); it gives that split nothing",
            prefix,
            SPLIT_NAMES[split],
            docs[0] if len(docs) else 0,
            docs[-1] + 1 if len(docs) else 0,
            len(self.open(prefix)),
        )
        return False

    def split_dataset(self, paths: Sequence[str], split: int, num_samples: int, whole: bool):
        """The dataset for one split, or None when nothing is requested or available."""
        if num_samples <= 0:
            return None
        prefixes, weights = parse_blend(paths)
        if len(prefixes) == 1 and (weights is None or whole):
            docs = self.documents(prefixes[0], split, whole)
            if docs is None or not self.has_tokens(prefixes[0], docs, split):
                return None
            return self.gpt(prefixes[0], docs, num_samples, split)
        docs = [self.documents(p, split, whole) for p in prefixes]
        if any(d is None for d in docs):  # the split has weight 0: all parts are empty
            return None
        keep = [
            i
            for i in range(len(prefixes))
            if (weights is None or weights[i] > 0) and self.has_tokens(prefixes[i], docs[i], split)
        ]
        if not keep:
            return None
        if weights is None:
            parts = [self.gpt(prefixes[i], docs[i], None, split) for i in keep]
            blend_weights = [len(p) for p in parts]
            size = min(num_samples, sum(blend_weights))
            if size < num_samples:
                short = (
                    f"the unweighted {SPLIT_NAMES[split]} blend holds {size} samples (one "
                    f"epoch of each dataset, as megatron-core builds it), fewer than the "
                    f"{num_samples} asked for; give weights (e.g. 1 A 1 B) to draw more"
                )
                if split == 0:  # training would run dry part way: say so now, in one line
                    raise ValueError(short + " or train for fewer iterations")
                logger.warning("%s", short)
        else:
            blend_weights = normalize([weights[i] for i in keep])
            targets = samples_per_dataset(num_samples, blend_weights)
            asks = samples_per_dataset(num_samples, blend_weights, SURPLUS)
            parts = [self.gpt(prefixes[i], docs[i], n, split) for i, n in zip(keep, asks)]
            size = sum(targets)
        cache = self.cfg.data_cache_path or default_cache_dir(prefixes[keep[0]], "BlendedDataset")
        description = {
            "prefixes": [os.path.abspath(prefixes[i]) for i in keep],
            "split": SPLIT_NAMES[split],
            "parts": [len(p) for p in parts],
            "seed": self.seed,
            "seq_length": self.seq_length,
        }
        return BlendedDataset(parts, blend_weights, size, cache, description, self.write, SPLIT_NAMES[split])


def _build(cfg: DataConfig, num_samples: Sequence[int], seq_length: int, seed: int, write_cache: bool) -> tuple:
    per_split = (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path)
    if not cfg.data_path and not any(per_split):
        raise ValueError(
            "no data: give --data-path or --train-data-path/--valid-data-path/--test-data-path (or --mock-data)"
        )
    builder = _Builder(cfg, seq_length, seed, write_cache)
    out = []
    for split, n in enumerate(num_samples):
        if per_split[split]:
            out.append(builder.split_dataset(per_split[split], split, int(n), whole=True))
        elif cfg.data_path:
            out.append(builder.split_dataset(cfg.data_path, split, int(n), whole=False))
        else:
            out.append(None)
    for name, ds, n in zip(SPLIT_NAMES, out, num_samples):
        logger.info("%s dataset: %s samples (requested %d)", name, len(ds) if ds is not None else "no", n)
    return tuple(out)


def build_train_valid_test_datasets(
    cfg: DataConfig,
    num_samples: tuple[int, int, int],
    *,
    seq_length: int,
    seed: int,
    is_primary: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[Optional[object], ...]:
    """Build (train, valid, test) datasets as megatron-core builds them for ``num_samples``.

    Each holds at least its ``num_samples``, except an unweighted blend, which
    holds at most one epoch of its parts (as in megatron-core). Each dataset
    maps ``i`` to ``{"text": int64 array [seq_length + 1]}`` (documents
    shuffled with ``seed``); a split with no requested samples, no weight in
    --split or no tokens is None. The primary rank
    builds and caches the index arrays and then calls ``barrier()``; other
    ranks call ``barrier()`` first and then load the cache (memory-mapped),
    so every rank ends with identical datasets and one rank did the work.
    """
    if len(num_samples) != 3:
        raise ValueError("num_samples must be (train, valid, test)")
    if is_primary:
        datasets = _build(cfg, num_samples, seq_length, seed, write_cache=True)
        barrier()
        return datasets
    barrier()
    return _build(cfg, num_samples, seq_length, seed, write_cache=False)
