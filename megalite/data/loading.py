"""Which data a run reads and how many samples: the default corpus, Megatron's sample counts, the datasets.

``resolve_data`` fills in the default corpus and the tokenizer's vocabulary before any
process group exists; ``validation_plan`` sizes the train/valid/test splits as Megatron
does (every evaluation reads new validation batches); ``build_datasets`` builds them
once per node, with every rank agreeing on a failure so that one rank reports it.
``split_dataset`` is the same recipe for one split in one process (tools/evaluate.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import NamedTuple, Optional

from megalite.config import Config, DataConfig
from megalite.config.checks import check_tokenizer_given, check_training_documents
from megalite.data.builder import build_train_valid_test_datasets, megatron_num_samples
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel.agreement import flag_on_any_rank, lowest_rank_with
from megalite.parallel.state import ParallelState

logger = logging.getLogger("megalite")
_DEFAULT_CORPUS = "pydoc_topics_text_document"  # default_corpus.py's data prefix, in its cache directory


def _with_default_corpus(data: DataConfig) -> DataConfig:
    """``data`` reading the embedded default corpus (built under the cache directory when missing)."""
    from megalite.data.default_corpus import prepare_default_corpus

    corpus = prepare_default_corpus()
    return replace(
        data,
        data_path=(corpus["data_prefix"],),
        tokenizer_type=corpus["tokenizer_type"],
        vocab_file=corpus["vocab_file"],
        merge_file=corpus["merge_file"],
    )


def resolve_default_corpus(data: DataConfig) -> DataConfig:
    """A saved run's data: the default corpus's files rebuilt when its stored cache paths are gone."""
    paths = data.data_path
    if len(paths) != 1 or os.path.basename(paths[0]) != _DEFAULT_CORPUS or os.path.exists(paths[0] + ".idx"):
        return data
    return _with_default_corpus(data)


def resolve_data(cfg: Config) -> Config:
    """Fill in the default corpus (when no data is given) and the vocabulary size from the tokenizer.

    Mock data without a tokenizer has ``--vocab-size`` ids; with ``--tokenizer-type`` the vocabulary is
    the tokenizer's, as in Megatron (``NullTokenizer --vocab-size N``: N + 1 ids, eod = N).
    """
    data = cfg.data
    if data.mock_data and not data.tokenizer_type:
        return cfg
    if not (data.mock_data or data.data_path or data.train_data_path):
        data = _with_default_corpus(data)
    check_tokenizer_given(data)
    from megalite.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(data, cfg.model.vocab_size or None)
    return cfg.with_(data=data, model=replace(cfg.model, vocab_size=tokenizer.vocab_size))


def validation_plan(t) -> tuple:
    """(train, valid, test) sample counts, as Megatron asks for them.

    Every evaluation reads the next ``eval_iters`` global batches of the validation split
    (not the same ones again), once per ``eval_interval`` and once at the end, so the
    split is sized (train_iters // eval_interval + 1) x eval_iters x global batch.
    """
    if t.eval_iters <= 0 or t.eval_interval <= 0:
        return t.train_iters * t.global_batch_size, 0, 0
    return megatron_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)


def valid_samples_before(iteration: int, t) -> int:
    """Validation samples read by the evaluations before the one logged at ``iteration``.

    An evaluation on the interval, or the one at the end of a run whose last iteration is
    off the interval, which comes after every interval one: both give this formula.
    """
    return max(0, (iteration - 1) // t.eval_interval) * t.eval_iters * t.global_batch_size


def validation_start(iteration: int, t, available: int) -> int:
    """Where the evaluation logged at ``iteration`` starts reading a split of ``available`` samples:
    after the earlier evaluations' samples, or over from 0 when a capped split (a blend smaller
    than Megatron's plan) cannot hold this evaluation there."""
    start = valid_samples_before(iteration, t)
    return start if start + t.eval_iters * t.global_batch_size <= available else 0


class DatasetError(ValueError):
    """The datasets could not be built; ``report`` is true on the one rank that should print why."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


class Datasets(NamedTuple):
    train: Optional[object]
    valid: Optional[object]
    test: Optional[object]


def build_datasets(cfg: Config, ps: ParallelState) -> Datasets:
    """Train, validation and test datasets (samples of seq_length + 1 ids), built once per node.

    Rank 0 builds the index caches while the others wait; a failure there is agreed on
    (the builder's barrier is an all-reduce of a failure flag) so that every rank stops
    at once and only one prints, instead of the others waiting out the timeout.
    """
    t = cfg.train
    n_train, n_valid, n_test = validation_plan(t)
    if t.skip_train:  # only evaluates: the validation split keeps the training run's size (its order)
        n_train = 0
    if cfg.data.mock_data:

        def make(n: int, salt: int) -> Optional[MockGPTDataset]:
            return MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed + salt, n) if n else None

        return Datasets(make(n_train, 0), make(n_valid, 1), make(n_test, 2))
    agreed = []

    def barrier() -> None:  # phase 1: has the primary rank failed?
        agreed.append(True)
        if flag_on_any_rank(False, ps):
            raise DatasetError("the dataset build failed on rank 0", report=False)

    error: Optional[str] = None
    try:
        train, valid, test = build_train_valid_test_datasets(
            cfg.data,
            (n_train, n_valid, n_test),
            seq_length=cfg.model.seq_length,
            seed=cfg.train.seed,
            is_primary=ps.rank == 0,
            barrier=barrier,
        )
        check_training_documents(cfg.data, found=train is not None or n_train == 0)
    except DatasetError:
        raise
    except (ValueError, OSError) as e:  # bad files, split or cache (ConfigError is a ValueError)
        if not agreed:  # the primary failed before its barrier: tell the waiting ranks
            flag_on_any_rank(True, ps)
            raise DatasetError(str(e), report=True) from None
        error = str(e)
    if error is None and valid is not None and len(valid) < n_valid and len(valid) < t.eval_iters * t.global_batch_size:
        error = (
            f"the validation split has {len(valid)} samples, fewer than one evaluation reads (--eval-iters "
            f"{t.eval_iters} x --global-batch-size {t.global_batch_size}); lower --eval-iters or give more "
            f"validation data (--split / --valid-data-path)"
        )
    reporter = lowest_rank_with(error is not None, ps)  # phase 2: did any rank fail loading?
    if reporter is not None:
        raise DatasetError(error or "the dataset build failed on another rank", report=reporter == ps.rank)
    if test is not None and len(test) < t.eval_iters * t.global_batch_size:  # a capped blend: too small to read
        if ps.rank == 0:
            logger.warning(
                f"the test split has {len(test)} samples, fewer than one evaluation reads (--eval-iters "
                f"{t.eval_iters} x --global-batch-size {t.global_batch_size}): it is not evaluated"
            )
        test = None
    return Datasets(train, valid, test)


def split_dataset(cfg: Config, split: str):
    """The samples pretrain_gpt.py evaluates on (valid), or the same recipe for test / train, in one process.

    The sample order of a real dataset depends on how many samples are asked for, so
    each split asks for what the training run asked (``validation_plan``, Megatron's
    counts), and at least one evaluation's worth.
    """
    t, index = cfg.train, ("train", "valid", "test").index(split)
    n = max(t.eval_iters * t.global_batch_size, validation_plan(t)[index])
    if cfg.data.mock_data:  # pretrain_gpt.py's seeds: train seed + 0, valid seed + 1 (here test: + 2)
        return MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, t.seed + index, n)
    counts = [0, 0, 0]
    counts[index] = n
    ds = build_train_valid_test_datasets(cfg.data, tuple(counts), seq_length=cfg.model.seq_length, seed=t.seed)[index]
    if ds is None:
        raise ValueError(f"the {split} split has no documents (see --split, or give --{split}-data-path)")
    return ds
