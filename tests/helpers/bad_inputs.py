"""The bad-input tests' flag lists (the tiny model with vocabulary 100) and their data directory: a good
dataset, damaged copies, out-of-vocabulary ids and a damaged index cache."""

import os
import shutil

import numpy as np

import pretrain_gpt
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from tests.helpers import TINY_MODEL

# the tiny model with vocabulary 100 (the data files' ids are checked against it) and global batch 4
TINY = [
    "--vocab-size",
    "100",
    *TINY_MODEL,
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "3",
    "--eval-iters",
    "1",
    "--eval-interval",
    "2",
    "--log-interval",
    "1",
]
MOCK = ["--mock-data"] + TINY
DATA = TINY + ["--tokenizer-type", "NullTokenizer", "--split", "80,20,0"]


def _write(prefix, docs):
    b = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    for d in docs:
        b.add_item(np.asarray(d))
        b.end_document()
    b.finalize()


def write_data_dir(t):
    """A good dataset (ids < 100), damaged copies, one with out-of-vocabulary ids, a damaged cache, in ``t``."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, size=int(rng.integers(5, 40))) for _ in range(60)]
    _write(t / "good", docs)
    _write(t / "oov", [np.append(d, 150) if i % 4 == 1 else d for i, d in enumerate(docs)])
    for name in ("trunc_bin", "trunc_idx", "magic", "dtype"):
        for ext in ("bin", "idx"):
            shutil.copy(t / f"good.{ext}", t / f"{name}.{ext}")
    with open(t / "trunc_bin.bin", "r+b") as f:
        f.truncate(os.path.getsize(t / "good.bin") - 10)
    with open(t / "trunc_idx.idx", "r+b") as f:
        f.truncate(40)
    with open(t / "magic.idx", "r+b") as f:
        f.write(b"XXXXXXXXX")
    with open(t / "dtype.idx", "r+b") as f:
        f.seek(17)
        f.write(bytes([42]))
    (t / "afile").write_text("x")
    (t / "list.json").write_text("[1, 2]")
    (t / "vocab.json").write_text('{"<|endoftext|>": 0, "a": 1}')
    (t / "merges.txt").write_text("#version: 0.2\n")
    (t / "bad_merges.txt").write_text("#version: 0.2\na b c\n")
    (t / "latin1.txt").write_bytes("#version: 0.2\né e\n".encode("latin-1"))
    # A cache built by a good run, then damaged: every .npy cut short.
    assert pretrain_gpt.main(DATA + ["--data-path", str(t / "good"), "--data-cache-path", str(t / "badcache")]) == 0
    for npy in (t / "badcache").rglob("*.npy"):
        npy.write_bytes(npy.read_bytes()[:100])
    return t


def _argv(base, extra, t):
    return base + extra.replace("$T", str(t)).split()
