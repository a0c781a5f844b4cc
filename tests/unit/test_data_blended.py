"""BlendedDataset: greedy proportions at every prefix, blend parsing, builder blends."""

from __future__ import annotations

import numpy as np
import pytest

from megalite.config import DataConfig
from megalite.data.blended_dataset import (
    SURPLUS,
    BlendedDataset,
    build_blending_indices,
    parse_blend,
    samples_per_dataset,
)
from megalite.data.builder import build_train_valid_test_datasets
from megalite.data.indexed_dataset import IndexedDatasetBuilder


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [0.5, 0.25, 0.2, 0.05], [9, 1]])
def test_every_prefix_within_one_sample_of_weights(weights):
    size = 5000
    d_idx, s_idx = build_blending_indices(weights, size)
    w = np.array(weights, float) / sum(weights)
    onehot = np.eye(len(weights))[d_idx]
    counts = np.cumsum(onehot, axis=0)  # [n, datasets] after each prefix
    target = np.arange(1, size + 1)[:, None] * w[None, :]
    assert np.abs(counts - target).max() <= 1.0
    for d in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2...
        np.testing.assert_array_equal(s_idx[d_idx == d], np.arange((d_idx == d).sum()))


def test_parse_blend_forms():
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["a"]) == (["a"], None)
    with pytest.raises(ValueError):
        parse_blend(["0.3", "a", "b"])
    assert samples_per_dataset(1000, [0.3, 0.7]) == [300, 700]  # the blend's targets
    assert samples_per_dataset(1000, [0.3, 0.7], SURPLUS) == [302, 704]  # parts built larger


def test_blended_dataset_reads_parts_and_caches(tmp_path):
    parts = [[{"text": np.full(3, d)} for _ in range(100)] for d in range(2)]
    ds = BlendedDataset(parts, [0.25, 0.75], 100, str(tmp_path), {"t": 1})
    assert [int(ds[i]["text"][0]) for i in range(4)] == [1, 0, 1, 1]
    assert BlendedDataset(parts, [0.25, 0.75], 100, str(tmp_path), {"t": 1}).cache_hit
    with pytest.raises(ValueError, match="asks dataset 0 for 50 samples but it has 10"):
        BlendedDataset([parts[0][:10], parts[1]], [0.5, 0.5], 100)


def _write(prefix, n_docs, value):
    b = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(n_docs):
        b.add_item(np.full(20, value))
        b.end_document()
    b.finalize()
    return str(prefix)


def test_builder_blends_weighted_and_by_size(tmp_path):
    a, b = _write(tmp_path / "a", 100, 1), _write(tmp_path / "b", 300, 2)
    cfg = DataConfig(data_path=("0.3", a, "0.7", b), split="90,10,0", data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, (400, 40, 10), seq_length=8, seed=1234)
    assert len(train) == 400 and len(valid) == 40 and test is None
    share = np.mean([train[i]["text"][0] == 1 for i in range(400)])
    assert abs(share - 0.3) <= 1 / 400
    cfg = DataConfig(data_path=(a, b), split="1,0,0", data_cache_path=str(tmp_path / "c"))
    train, _, _ = build_train_valid_test_datasets(cfg, (400, 0, 0), seq_length=8, seed=1234)
    share = np.mean([train[i]["text"][0] == 1 for i in range(400)])
    assert abs(share - 0.25) <= 1 / 400  # 100 vs 300 documents of equal length


def test_builder_separate_split_paths(tmp_path):
    a, b = _write(tmp_path / "a", 50, 1), _write(tmp_path / "b", 50, 2)
    cfg = DataConfig(train_data_path=(a,), valid_data_path=("1", a, "1", b), data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, (100, 20, 5), seq_length=8, seed=1234)
    assert all(train[i]["text"][0] == 1 for i in range(100))
    assert {int(valid[i]["text"][0]) for i in range(20)} == {1, 2}
    assert test is None


def test_blend_sizes_follow_megatron_core(tmp_path, caplog):
    a, b, c = (_write(tmp_path / n, 60, v) for n, v in (("a", 1), ("b", 2), ("c", 3)))
    # weighted: every part asks ceil(n * w) and the blend holds their sum (1002, not 1000);
    # the parts are built 0.5% larger than they are asked
    cfg = DataConfig(data_path=("1", a, "1", b, "1", c), split="1,0,0", data_cache_path=str(tmp_path / "c"))
    train, _, _ = build_train_valid_test_datasets(cfg, (1000, 0, 0), seq_length=8, seed=3)
    assert len(train) == 1002
    assert [p.num_samples for p in train.datasets] == [336, 336, 336]  # ceil(334 * 1.005)
    # one weighted prefix is still a blend (its part gets the margin too)
    cfg = DataConfig(data_path=("0.5", a), split="1,0,0", data_cache_path=str(tmp_path / "c"))
    train, _, _ = build_train_valid_test_datasets(cfg, (100, 0, 0), seq_length=8, seed=3)
    assert isinstance(train, BlendedDataset) and train.datasets[0].num_samples == 101
    # unweighted: one epoch of each part, the blend capped at their samples, with a warning
    cfg = DataConfig(data_path=(a, b), split="1,1,0", data_cache_path=str(tmp_path / "c"))
    _, valid, _ = build_train_valid_test_datasets(cfg, (10, 10**6, 0), seq_length=8, seed=3)
    one_epoch = (30 * 20 - 1) // 8
    assert [p.num_samples for p in valid.datasets] == [None, None]
    assert len(valid) == 2 * one_epoch and "fewer than the 1000000 asked for" in caplog.text
    # ... which for training is an error now rather than a run that stops part way
    with pytest.raises(ValueError, match="unweighted train blend holds 148 samples"):
        build_train_valid_test_datasets(cfg, (10**6, 10, 0), seq_length=8, seed=3)
