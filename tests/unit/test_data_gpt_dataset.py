"""GPTDataset indices (against a transcription of Megatron's C++ loop), caching, builder."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megalite.config import DataConfig
from megalite.data.builder import build_train_valid_test_datasets
from megalite.data.gpt_dataset import (
    GPTDataset,
    build_document_index,
    build_sample_index,
    num_epochs_needed,
    sample_index_from_sizes,
    shuffled_documents,
    split_document_ranges,
)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _reference_sample_index(sizes, doc_idx, seq_length):
    """Megatron's helpers.cpp build_sample_idx, line for line in Python (add_extra_token=1)."""
    total = int(sum(sizes[d] for d in doc_idx))
    num_samples = (total - 1) // seq_length
    out = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    for sample in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                if doc_idx_index == len(doc_idx) - 1:
                    assert sample == num_samples
                    doc_offset = int(sizes[doc_idx[doc_idx_index]]) - 1
                    break
                doc_idx_index += 1
                doc_offset = 0
        out.append((doc_idx_index, doc_offset))
    return np.array(out)


@pytest.mark.parametrize("seed, seq", [(0, 7), (1, 16), (2, 1), (3, 50)])
def test_sample_index_equals_megatron_loop(seed, seq):
    rng = np.random.RandomState(seed)
    sizes = rng.randint(0, 30, size=200).astype(np.int32)
    sizes[0] = max(sizes[0], 1)
    doc_idx = build_document_index(np.arange(200), 3, rng, False)
    np.testing.assert_array_equal(build_sample_index(sizes, doc_idx, seq), _reference_sample_index(sizes, doc_idx, seq))


def test_packed_shuffle_and_chunked_sample_index_equal_the_plain_ones():
    rng = np.random.RandomState(4)
    sizes = rng.randint(0, 30, size=300).astype(np.int32)
    sizes[rng.rand(300) < 0.2] = 0
    docs = np.arange(50, 250)
    for epochs, separate in ((1, False), (3, False), (3, True)):
        pairs = shuffled_documents(docs, sizes, epochs, np.random.RandomState(8), separate)
        doc_idx, doc_sizes = pairs[:, 0].copy(), pairs[:, 1]
        plain = build_document_index(docs, epochs, np.random.RandomState(8), separate)
        assert doc_idx.dtype == np.int32 and doc_idx.tobytes() == plain.tobytes()
        np.testing.assert_array_equal(doc_sizes, sizes[plain])
        expected = _reference_sample_index(sizes, plain, 9)
        for chunk in (1, 2, 5, 64):
            np.testing.assert_array_equal(sample_index_from_sizes(doc_sizes, 9, np.dtype(np.int32), chunk), expected)


def test_split_ranges_megatron_core_rounding():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    # a zero-weight split has no range at all (megatron-core builds nothing for it)
    assert split_document_ranges("98,2", 10) == [(0, 10), (10, 10), None]
    # each running bookend is rounded on its own; legacy Megatron-LM gave (0,4),(4,7),(7,10)
    assert split_document_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_document_ranges("99 1", 7) == [(0, 7), (7, 7), None]
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,0,0", ""):
        with pytest.raises(ValueError, match="--split"):
            split_document_ranges(bad, 10)


def _dataset(tmp_path, n_docs=120, seed=0, max_len=40):
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    token = 0
    for _ in range(n_docs):
        n = rng.randint(1, max_len)
        b.add_item(np.arange(token, token + n) % 60000)  # every token value unique
        token += n
        b.end_document()
    b.finalize()
    return IndexedDataset(tmp_path / "d")


def test_samples_cover_every_token_once_per_epoch(tmp_path):
    ds = _dataset(tmp_path)
    docs = np.arange(100, dtype=np.int32)
    seq = 16
    total = int(ds.sequence_lengths[:100].sum())
    n = (total - 1) // seq
    gpt = GPTDataset(ds, docs, n, seq, seed=5, cache_dir=str(tmp_path / "c"))
    assert len(gpt) == n
    seen = []
    for i in range(len(gpt)):
        s = gpt[i]["text"]
        assert s.shape == (seq + 1,) and s.dtype == np.int64
        seen.append(s[:-1])
    seen = np.concatenate(seen)
    expected = np.concatenate([ds[d] for d in docs]).astype(np.int64)
    assert len(np.unique(seen)) == len(seen)  # nothing twice
    assert set(seen.tolist()) <= set(expected.tolist()) and len(seen) >= len(expected) - seq


def test_more_epochs_determinism_and_cache(tmp_path):
    ds = _dataset(tmp_path)
    docs = np.arange(20, 80, dtype=np.int32)
    args = (ds, docs, 500, 32, 1234, str(tmp_path / "cache"))
    a = GPTDataset(*args)
    assert not a.cache_hit and len(a) >= 500
    assert num_epochs_needed(int(ds.sequence_lengths[docs].sum()), 32, 500) > 1
    b = GPTDataset(*args)
    assert b.cache_hit and isinstance(b.sample_index, np.memmap)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = GPTDataset(ds, docs, 500, 32, 1234, None)
    np.testing.assert_array_equal(a.shuffle_index, c.shuffle_index)
    d = GPTDataset(ds, docs, 500, 32, 99, str(tmp_path / "cache"))
    assert not d.cache_hit and not np.array_equal(a.document_index, d.document_index)
    assert all(len(a[i]["text"]) == 33 for i in range(len(a)))
    files = os.listdir(tmp_path / "cache")
    assert len([f for f in files if f.endswith("description.json")]) == 2
    assert not [f for f in files if "tmp" in f]


SEQ = dict(seq_length=16, seed=3)


def _cfg(tmp_path, **kw):
    base = dict(data_path=(str(tmp_path / "d"),), split="80,10,10", data_cache_path=str(tmp_path / "cache"))
    base.update(kw)
    return DataConfig(**base)


def test_builder_single_prefix_and_none_cases(tmp_path):
    _dataset(tmp_path)
    train, valid, test = build_train_valid_test_datasets(_cfg(tmp_path), (300, 20, 0), **SEQ)
    assert len(train) >= 300 and len(valid) >= 20 and test is None
    assert train[0]["text"].shape == (17,)
    t2, v2, _ = build_train_valid_test_datasets(_cfg(tmp_path, split="100,0,0"), (10, 10, 10), **SEQ)
    assert t2 is not None and v2 is None
    # 120 documents: the test part of 969,30,1 rounds to none (megatron-core would hang)
    t3, v3, e3 = build_train_valid_test_datasets(_cfg(tmp_path, split="969,30,1"), (10, 10, 10), **SEQ)
    assert len(t3) >= 10 and len(v3) >= 10 and e3 is None
    with pytest.raises(ValueError, match="--data-path"):
        build_train_valid_test_datasets(DataConfig(), (1, 1, 1), **SEQ)


def test_builder_primary_builds_then_barrier_others_load(tmp_path):
    _dataset(tmp_path)
    events = []
    cfg = _cfg(tmp_path)
    build_train_valid_test_datasets(
        cfg,
        (50, 5, 5),
        **SEQ,
        is_primary=True,
        barrier=lambda: events.append(("primary", len(os.listdir(tmp_path / "cache")))),
    )
    assert events[0][1] > 0  # the cache was written before the barrier
    out = build_train_valid_test_datasets(
        cfg, (50, 5, 5), **SEQ, is_primary=False, barrier=lambda: events.append(("other", 0))
    )
    assert events[1] == ("other", 0) and all(ds.cache_hit for ds in out)


def test_non_primary_ranks_only_map_the_cached_indices(tmp_path, monkeypatch):
    import megalite.data.blended_dataset as blended
    import megalite.data.gpt_dataset as gpt

    _dataset(tmp_path)
    (tmp_path / "two").mkdir()
    _dataset(tmp_path / "two", seed=1)
    cfg = _cfg(tmp_path, data_path=("0.6", str(tmp_path / "d"), "0.4", str(tmp_path / "two" / "d")))
    build_train_valid_test_datasets(cfg, (200, 20, 20), **SEQ, is_primary=True)

    def refuse(*args, **kwargs):
        raise AssertionError("an index was built on a non-primary rank")

    for module, name in (
        (gpt, "shuffled_documents"),
        (gpt, "sample_index_from_sizes"),
        (gpt, "build_shuffle_index"),
        (blended, "build_blending_indices"),
    ):
        monkeypatch.setattr(module, name, refuse)
    out = build_train_valid_test_datasets(cfg, (200, 20, 20), **SEQ, is_primary=False)
    mapped = []

    def check(ds):
        names = (
            ("dataset_index", "dataset_sample_index")
            if hasattr(ds, "datasets")
            else ("document_index", "sample_index", "shuffle_index")
        )
        assert ds.cache_hit
        mapped.extend(isinstance(getattr(ds, n), np.memmap) for n in names)
        for part in getattr(ds, "datasets", ()):
            check(part)

    for ds in out:
        check(ds)
    assert len(mapped) == 3 * (2 + 2 * 3) and all(mapped)


def test_builder_default_cache_next_to_data(tmp_path):
    _dataset(tmp_path)
    build_train_valid_test_datasets(_cfg(tmp_path, data_cache_path=None), (10, 0, 0), **SEQ)
    assert os.listdir(tmp_path / "cache" / "GPTDataset_indices")


# ------------------------------------------------ damaged index caches (issue 10)
def _damage_truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _damage_garbage(path):
    open(path, "wb").write(b"not an npy file at all")


def _damage_dtype(path):
    np.save(path, np.load(path).astype(np.int64))


def _damage_length(path):
    np.save(path, np.load(path)[:-1])


def _damage_pickle(path):
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)


@pytest.mark.parametrize("name", ["document_index", "sample_index", "shuffle_index"])
@pytest.mark.parametrize("damage", [_damage_truncate, _damage_garbage, _damage_dtype, _damage_length, _damage_pickle])
def test_damaged_cache_file_is_one_line_naming_it(tmp_path, name, damage):
    from megalite.data.index_cache import IndexCacheError

    ds = _dataset(tmp_path)
    docs = np.arange(10, 90, dtype=np.int32)
    args = (ds, docs, 300, 16, 7, str(tmp_path / "cache"))
    good = GPTDataset(*args)
    [path] = [str(tmp_path / "cache" / f) for f in os.listdir(tmp_path / "cache") if f.endswith(f"-{name}.npy")]
    damage(path)
    with pytest.raises(IndexCacheError) as err:
        GPTDataset(*args)
    msg = str(err.value)
    assert path in msg and "delete it" in msg and "\n" not in msg
    os.remove(path)  # what the message says to do: the cache is rebuilt
    again = GPTDataset(*args)
    assert not again.cache_hit
    np.testing.assert_array_equal(again.shuffle_index, good.shuffle_index)
    assert GPTDataset(*args).cache_hit


def test_damaged_description_and_blend_cache(tmp_path):
    from megalite.data.blended_dataset import BlendedDataset
    from megalite.data.index_cache import IndexCacheError

    parts = [[{"text": np.full(3, d)} for _ in range(100)] for d in range(2)]
    BlendedDataset(parts, [0.25, 0.75], 100, str(tmp_path), {"t": 1})
    [idx] = [str(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith("-dataset_index.npy")]
    np.save(idx, np.load(idx).astype(np.uint8))  # the dtype earlier megalite versions wrote
    with pytest.raises(IndexCacheError, match="dtype uint8, expected int16"):
        BlendedDataset(parts, [0.25, 0.75], 100, str(tmp_path), {"t": 1})
    [desc] = [str(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith("description.json")]
    open(desc, "w").write("{}")
    with pytest.raises(IndexCacheError, match="description does not match"):
        BlendedDataset(parts, [0.25, 0.75], 100, str(tmp_path), {"t": 1})


def test_megatron_num_samples():
    from megalite.data.builder import megatron_num_samples

    # Megatron-LM's get_train_valid_test_num_samples: 500 iterations, evaluation every 100
    # for 10 batches (five times plus the end), test one evaluation
    assert megatron_num_samples(500, 32, 100, 10) == (16000, 6 * 10 * 32, 320)
    assert megatron_num_samples(99, 8, 100, 2) == (792, 16, 16)
    assert megatron_num_samples(10, 4, 5, 0) == (40, 0, 0)


def test_damaged_cache_through_pretrain_gpt_is_one_line(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    b = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    rng = np.random.RandomState(0)
    for _ in range(200):
        b.add_item(rng.randint(0, 99, size=rng.randint(5, 40)))
        b.end_document()
    b.finalize()
    cmd = [
        sys.executable,
        "pretrain_gpt.py",
        "--vocab-size",
        "100",
        "--tokenizer-type",
        "NullTokenizer",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        "1",
        "--eval-iters",
        "0",
        "--data-path",
        str(tmp_path / "d"),
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--split",
        "90,10,0",
    ]
    ok = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    [path] = [str(tmp_path / "cache" / f) for f in os.listdir(tmp_path / "cache") if f.endswith("sample_index.npy")]
    _damage_truncate(path)
    bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr[-2000:]
    assert path in lines[0] and "delete it" in lines[0] and "Traceback" not in bad.stdout
