"""Shared fixtures for the data pipeline tests (all prefixed ``data_``)."""

from __future__ import annotations

import json
import random

import pytest

UNICODE_SAMPLES = [
    "Hello, world! It's a test: they'll've done it.",
    "Ünïcödé ñoño façade — “quotes” … ½ ∑ ∞ ≈ ≠",
    "日本語のテキストと中文字符 한국어 텍스트",
    "emoji 🎉🚀👩‍💻 and flags 🇫🇷 mixed with text",
    "tabs\tand\nnewlines\n\n  multiple   spaces   ",
    "numbers 1234567890 3.14159 1e-9 0x1F",
    "Русский текст и ελληνικά γράμματα",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
    " leading space and trailing ",
    "ﬁ ligature, Å vs Å (combining), zero\u200bwidth",
]


def _pydoc_texts(n: int) -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:n]]


@pytest.fixture(scope="session")
def data_texts() -> list[str]:
    """Real English documentation text plus varied Unicode (deterministic)."""
    return _pydoc_texts(60) + UNICODE_SAMPLES


@pytest.fixture(scope="session")
def data_bpe_files(tmp_path_factory, data_texts) -> tuple[str, str]:
    """A small byte-level BPE (vocab 800) trained by our trainer: (vocab.json, merges.txt)."""
    from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe

    vocab, merges = train_bpe(data_texts, 800)
    return save_bpe(vocab, merges, str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture
def data_write_jsonl():
    """Returns write(path, docs, key="text"): one JSON object per line."""

    def write(path, docs, key="text"):
        with open(path, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({key: d}) + "\n")
        return str(path)

    return write


@pytest.fixture
def data_random_id_docs():
    """Returns make(n, vocab, seed): n non-empty documents of random ids, as text and lists."""

    def make(n, vocab=1000, seed=0, max_len=50):
        rng = random.Random(seed)
        docs = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
        return docs, [" ".join(map(str, d)) for d in docs]

    return make
