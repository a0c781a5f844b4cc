"""Data order equals megatron-core 0.16's, checked against megatron-core itself.

The oracle is megatron-core's own code, run here on CPU: its
BlendedMegatronDatasetBuilder (split ranges, mid-level sizes, blends), its
GPTDataset and its index builders (numpy parts byte for byte, and its compiled C++
helpers ``helpers_cpp``: build_sample_idx, build_blending_indices). Skipped as a whole
when megatron-core is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
helpers = pytest.importorskip("megatron.core.datasets.helpers")  # needs the compiled helpers_cpp

from megatron.core.datasets.blended_dataset import BlendedDataset as MBlendedDataset  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.blended_megatron_dataset_config import (  # noqa: E402
    BlendedMegatronDatasetConfig,
)
from megatron.core.datasets.gpt_dataset import GPTDataset as MGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.gpt_dataset import _build_document_index as m_document_index  # noqa: E402
from megatron.core.datasets.gpt_dataset import _build_shuffle_index as m_shuffle_index  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizer  # noqa: E402

from megalite.config import DataConfig  # noqa: E402
from megalite.data.blended_dataset import BlendedDataset, build_blending_indices  # noqa: E402
from megalite.data.builder import build_train_valid_test_datasets  # noqa: E402
from megalite.data.gpt_dataset import (  # noqa: E402
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    sample_index_dtype,
    sample_index_from_sizes,
    shuffled_documents,
    split_document_ranges,
)
from megalite.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402

SPLITS = [
    "969,30,1",
    "98,2,0",
    "1,1,1",
    "80,10,10",
    "99,1",
    "100,0,0",
    "0,50,50",
    "7,2,1",
    "33,33,34",
    "949,50,1",
    "9,0,1",
    "90,5,5",
    "2,1",
    "1,2,3",
    "0.5,0.3,0.2",
    "999,1,0",
    "3,0,0",
    "10,89,1",
]


class _Recorder:
    """Stands in for GPTDataset inside megatron-core's builder: records the documents it is given."""

    num_documents = 0

    @staticmethod
    def build_low_level_dataset(path, config):
        return None

    @staticmethod
    def numel_low_level_dataset(low_level):
        return _Recorder.num_documents

    def __init__(self, low_level, path, indices, num_samples, split, config):
        self.indices = indices


def _megatron_ranges(split: str, n: int) -> list:
    cfg = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8, blend=(["x"], None), split=split)
    builder = BlendedMegatronDatasetBuilder(_Recorder, [1, 1, 1], lambda: True, cfg)
    _Recorder.num_documents = n
    out = builder._build_megatron_dataset_splits("x", cfg.split_matrix, [1, 1, 1])
    return [None if d is None else (int(d.indices[0]) if len(d.indices) else None, len(d.indices)) for d in out]


def test_split_ranges_equal_megatron_core_over_many_document_counts():
    counts = list(range(0, 302)) + [997, 1000, 1001, 4097, 12345, 99_999, 1_000_003, 10**7 + 7]
    checked = 0
    for split in SPLITS:
        for n in counts:
            ours = split_document_ranges(split, n)
            theirs = _megatron_ranges(split, n)
            as_theirs = [None if r is None else (r[0] if r[1] > r[0] else None, r[1] - r[0]) for r in ours]
            assert as_theirs == theirs, (split, n, ours)
            checked += 1
    assert checked == len(SPLITS) * len(counts)
    # the legacy Megatron-LM rounding (round each weight, shift the ends) differs here:
    assert split_document_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]


@pytest.mark.parametrize("seed, seq, epochs", [(0, 7, 1), (1, 16, 3), (2, 2, 2), (3, 50, 4), (4, 1024, 5)])
def test_sample_index_equals_megatron_cpp(seed, seq, epochs):
    rng = np.random.RandomState(seed)
    sizes = rng.randint(0, 60, size=500).astype(np.int32)
    sizes[rng.rand(500) < 0.1] = 0  # empty sequences are passed over
    sizes[0] = max(sizes[0], 2)
    docs = np.arange(10, 480, dtype=np.int32)
    doc_index = build_document_index(docs, epochs, rng, False)
    tokens_per_epoch = int(sizes[docs].sum())
    theirs = helpers.build_sample_idx(sizes, doc_index, seq, epochs, tokens_per_epoch, True, True)
    ours = build_sample_index(sizes, doc_index, seq)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


def _same_bytes(ours, theirs):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (ours.dtype, theirs.dtype)
    assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("epochs, separate", [(1, False), (3, False), (2, True), (4, True)])
def test_document_sample_shuffle_indices_byte_identical(epochs, separate):
    """The build GPTDataset runs (one packed shuffle, chunked sample index) against
    megatron-core's numpy parts and its C++ build_sample_idx, as its GPTDataset calls them."""
    rng = np.random.RandomState(epochs)
    sizes = rng.lognormal(3.0, 1.5, 3000).astype(np.int32)  # many empty, some >> seq
    docs = np.arange(400, 2700)  # int64, as the builder's ranges
    pairs = shuffled_documents(docs, sizes, epochs, np.random.RandomState(5), separate)
    ours, our_sizes = pairs[:, 0].copy(), pairs[:, 1]
    theirs_rng = np.random.RandomState(5)
    theirs = m_document_index(docs, epochs, theirs_rng, separate)
    _same_bytes(ours, theirs)
    _same_bytes(build_document_index(docs, epochs, np.random.RandomState(5), separate), theirs)
    np.testing.assert_array_equal(our_sizes, sizes[theirs])
    tokens = int(sizes[docs].sum())
    seq = 64
    m_sample = helpers.build_sample_idx(sizes, theirs, seq, epochs, tokens, True, True)
    dtype = sample_index_dtype(int(sizes.max()), len(ours))
    for chunk in (5, 1 << 16):  # chunk edges inside and between documents
        _same_bytes(sample_index_from_sizes(our_sizes, seq, dtype, chunk=chunk), m_sample)
    total = len(m_sample) - 1
    first = (((epochs - 1) * tokens - 1) // seq) if separate else total
    our_rng = np.random.RandomState(5)
    shuffled_documents(docs, sizes, epochs, our_rng, separate)  # the state after it
    _same_bytes(build_shuffle_index(first, total, our_rng), m_shuffle_index(first, total, theirs_rng))


def _edge_cases():
    rng = np.random.RandomState(3)
    long = rng.randint(100, 400, size=50).astype(np.int32)  # every document > a sample
    empty = rng.randint(0, 9, size=300).astype(np.int32)
    empty[rng.rand(300) < 0.4] = 0  # runs of empty documents
    exact = np.full(40, 8, dtype=np.int32)  # seq 8: samples start at document starts;
    # seq 7: a sample's shared last token is a document's last (the C++ loop's remaining == 0)
    return [
        ("long", long, 7),
        ("empty", empty, 4),
        ("exact", exact, 8),
        ("exact+1", exact, 7),
        ("one sample", np.array([3, 0, 2], np.int32), 4),
        ("no sample", np.array([2, 3], np.int32), 5),
        ("seq 2", empty, 2),
    ]


@pytest.mark.parametrize("name, sizes, seq", _edge_cases(), ids=[c[0] for c in _edge_cases()])
def test_sample_index_edge_cases_equal_megatron_cpp(name, sizes, seq):
    """Documents longer than a sample, empty ones (first included), exact fits, 0 samples;
    add_extra_token_to_sequence (samples of seq + 1 tokens sharing a token), as megalite."""
    docs = np.arange(len(sizes))
    for epochs, separate in ((1, False), (3, True)):
        pairs = shuffled_documents(docs, sizes, epochs, np.random.RandomState(1), separate)
        doc_index, doc_sizes = pairs[:, 0].copy(), pairs[:, 1]
        if name == "empty":  # an empty document first: Megatron still starts at (0, 0)
            doc_sizes = doc_sizes.copy()
            sizes = sizes.copy()
            sizes[doc_index[0]] = 0
            doc_sizes[doc_index == doc_index[0]] = 0
        theirs = helpers.build_sample_idx(sizes, doc_index, seq, epochs, int(sizes.sum()), True, True)
        for chunk in (1, 3, 1 << 16):
            _same_bytes(sample_index_from_sizes(doc_sizes, seq, np.dtype(np.int32), chunk), theirs)
        _same_bytes(build_sample_index(sizes, doc_index, seq), theirs)
        wide = sample_index_from_sizes(doc_sizes, seq, np.dtype(np.int64), 3)  # int64 rule
        np.testing.assert_array_equal(wide, theirs)


def _weightings():
    rng = np.random.RandomState(7)
    out = [[0.3, 0.7], [1, 1, 1], [0.5, 0.25, 0.2, 0.05], [9, 1], [1 / 3, 1 / 3, 1 / 3], [123, 4567, 89], [0.1] * 10]
    out += [list(rng.dirichlet(np.ones(k))) for k in (2, 3, 5, 8)]
    out += [list(rng.randint(1, 5000, size=k)) for k in (2, 4)]  # unweighted: sample counts
    return out


@pytest.mark.parametrize("weights", _weightings())
def test_blending_indices_equal_megatron_cpp(weights):
    size = 7919
    w = np.array(weights, dtype=np.float64)
    w = w / w.sum()
    d_theirs = np.zeros(size, dtype=np.int16)
    s_theirs = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(d_theirs, s_theirs, w, len(weights), size, False)
    d_ours, s_ours = build_blending_indices(weights, size)
    assert d_ours.dtype == d_theirs.dtype and s_ours.dtype == s_theirs.dtype
    np.testing.assert_array_equal(d_ours, d_theirs)
    np.testing.assert_array_equal(s_ours, s_theirs)


# ------------------------------------------------------------ whole builds, both builders
def _write(prefix, n_docs, seed, max_len=60):
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(n_docs):
        n = int(rng.randint(0, max_len)) if rng.rand() < 0.97 else 0
        b.add_item(rng.randint(0, 1000, size=n))
        b.end_document()
    b.finalize()
    return str(prefix)


def _megatron_build(blend, blend_per_split, split, sizes, seq, seed):
    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=1000)
    cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    return BlendedMegatronDatasetBuilder(MGPTDataset, list(sizes), lambda: True, cfg).build()


def _assert_same(ours, theirs, where):
    if theirs is None:
        assert ours is None, where
        return
    assert len(ours) == len(theirs), where
    if isinstance(theirs, MBlendedDataset):
        assert isinstance(ours, BlendedDataset), where
        for name in ("dataset_index", "dataset_sample_index"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.dtype == b.dtype, (where, name)
            np.testing.assert_array_equal(a, b, err_msg=f"{where} {name}")
        assert len(ours.datasets) == len(theirs.datasets), where
        for i, (o, t) in enumerate(zip(ours.datasets, theirs.datasets)):
            _assert_same(o, t, f"{where} part {i}")
        return
    assert ours.num_samples == theirs.num_samples, where
    np.testing.assert_array_equal(ours.documents, theirs.indices, err_msg=where)
    for name in ("document_index", "sample_index", "shuffle_index"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (where, name, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=f"{where} {name}")
    for i in (0, len(theirs) // 2, len(theirs) - 1):  # and the tokens themselves
        t = theirs[i]
        text = np.concatenate([t["tokens"].numpy(), t["labels"].numpy()[-1:]])
        np.testing.assert_array_equal(ours[i]["text"], text, err_msg=f"{where} sample {i}")


def _case(tmp_path, data_path=(), per_split=None, split="969,30,1", sizes=(500, 60, 20), seq=16, seed=1234):
    """Build with both builders from the same files and flags; compare every split."""
    per_split = per_split or {}
    cfg = DataConfig(
        data_path=tuple(data_path),
        split=split,
        data_cache_path=str(tmp_path / "cache"),
        train_data_path=tuple(per_split.get(0, ())),
        valid_data_path=tuple(per_split.get(1, ())),
        test_data_path=tuple(per_split.get(2, ())),
    )
    ours = build_train_valid_test_datasets(cfg, sizes, seq_length=seq, seed=seed)

    def blend(paths):
        if not paths:
            return None
        if len(paths) % 2 == 0 and all(_is_number(w) for w in paths[0::2]):
            return list(paths[1::2]), [float(w) for w in paths[0::2]]
        return list(paths), None

    if per_split:
        theirs = _megatron_build(None, [blend(per_split.get(i, ())) for i in range(3)], None, sizes, seq, seed)
    else:
        theirs = _megatron_build(blend(list(data_path)), None, split, sizes, seq, seed)
    for i, (o, t) in enumerate(zip(ours, theirs)):
        _assert_same(o, t, f"split {i}")
    return ours


def _is_number(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_parity")
    return [_write(root / name, n, seed) for name, n, seed in (("a", 301, 0), ("b", 157, 1), ("c", 89, 2))]


def test_single_prefix_several_splits(tmp_path, prefixes):
    for split in ("90,8,2", "80,10,10", "1,1,1", "98,2,0"):
        _case(tmp_path / split.replace(",", "_"), [prefixes[0]], split=split, sizes=(700, 90, 7))


def test_single_prefix_separate_final_epoch_and_one_epoch(tmp_path, prefixes):
    from megalite.data.gpt_dataset import separate_final_epoch
    from megalite.data.indexed_dataset import IndexedDataset

    tokens = int(IndexedDataset(prefixes[1]).sequence_lengths.sum())
    per_epoch = (tokens - 1) // 16
    # a few samples past one epoch: the final epoch is shuffled on its own
    assert separate_final_epoch(tokens, 16, per_epoch + 10, 2)
    ours = _case(tmp_path / "sep", [prefixes[1]], split="100,0,0", sizes=(per_epoch + 10, 5, 5), seq=16)
    assert len(ours[0].document_index) == 2 * len(ours[0].documents)
    # most of a second epoch: shuffled with the first
    assert not separate_final_epoch(tokens, 16, 2 * per_epoch - 3, 2)
    _case(tmp_path / "mix", [prefixes[1]], split="100,0,0", sizes=(2 * per_epoch - 3, 5, 5))
    _case(tmp_path / "one", [prefixes[1]], split="90,5,5", sizes=(3, 1, 1), seq=8)


def test_weighted_blends_including_one_weighted_prefix(tmp_path, prefixes):
    a, b, c = prefixes
    _case(tmp_path / "w3", ["0.2", a, "0.5", b, "0.3", c], split="80,15,5", sizes=(1000, 120, 30))
    _case(tmp_path / "w2", ["3", a, "1", c], split="90,6,4", sizes=(333, 41, 9), seq=32)
    _case(tmp_path / "w1", ["1.0", b], split="90,10,0", sizes=(250, 20, 5))


def test_unweighted_blends_are_sized_by_samples(tmp_path, prefixes):
    a, b, c = prefixes
    ours = _case(tmp_path / "u3", [a, b, c], split="90,5,5", sizes=(400, 30, 4000))
    assert len(ours[2]) < 4000  # capped at one epoch of each part, as megatron-core does
    _case(tmp_path / "u2", [a, c], split="1,1,1", sizes=(50, 50, 50), seq=8)


def test_per_split_blends(tmp_path, prefixes):
    a, b, c = prefixes
    _case(tmp_path / "ps", per_split={0: ["0.7", a, "0.3", b], 1: ["2", c], 2: [b, c]}, sizes=(600, 40, 25))
    _case(tmp_path / "ps1", per_split={0: [a], 1: [b, c]}, sizes=(200, 80, 0))
