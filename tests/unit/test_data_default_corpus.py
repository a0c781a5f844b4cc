"""The default corpus: built once from pydoc topics, cached atomically, usable end to end."""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor

from megalite.config import DataConfig
from megalite.data.builder import build_train_valid_test_datasets
from megalite.data.default_corpus import prepare_default_corpus
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import build_tokenizer


def test_default_corpus_builds_once_and_trains(tmp_path):
    with ProcessPoolExecutor(2) as pool:  # two "ranks" racing for the same cache
        results = list(pool.map(prepare_default_corpus, [str(tmp_path)] * 2))
    info = results[0]
    assert results[1] == info and info["tokenizer_type"] == "GPT2BPETokenizer"
    assert [p for p in os.listdir(tmp_path) if not p.startswith(".")] == [
        os.path.basename(os.path.dirname(info["data_prefix"]))
    ]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".building")]
    t0 = time.time()
    assert prepare_default_corpus(str(tmp_path)) == info
    assert time.time() - t0 < 1.0  # cached: no rebuild
    cfg = DataConfig(
        tokenizer_type=info["tokenizer_type"],
        vocab_file=info["vocab_file"],
        merge_file=info["merge_file"],
        data_path=(info["data_prefix"],),
        data_cache_path=str(tmp_path / "idx"),
    )
    tok = build_tokenizer(cfg)
    assert 4000 <= tok.vocab_size <= 4096
    ds = IndexedDataset(info["data_prefix"])
    assert ds.num_documents > 50 and ds[0][-1] == tok.eod
    train, valid, test = build_train_valid_test_datasets(cfg, (1000, 10, 10), seq_length=64, seed=1234)
    assert len(train) >= 1000 and train[0]["text"].max() < tok.vocab_size
    assert " the " in "".join(tok.detokenize(train[i]["text"]) for i in range(20))
