"""The default training job's data, built offline from CPython's own documentation.

Every CPython ships ``pydoc_data.topics.topics``: about 460 KB of English
reference text, one entry per topic. We write it as jsonl (one document per
topic, sorted), train a ~4k byte-level BPE with our trainer, and preprocess
it with eod appended. The result is cached under a directory keyed by the
Python version and a hash of the text and of this recipe; it is built in a
temporary directory and renamed into place, so concurrent ranks or a crash
never expose a half-built cache (the loser of a rename race discards its copy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Optional

from megalite.config import DataConfig
from megalite.data.indexed_dataset import dataset_exists
from megalite.data.preprocess import PreprocessOptions, output_prefix_for, preprocess
from megalite.data.tokenizers.bpe_trainer import save_bpe, train_bpe

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 4096
_RECIPE_VERSION = "1"  # bump when the recipe below changes the output


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _cache_key(texts: list[str]) -> str:
    h = hashlib.sha256(f"{_RECIPE_VERSION}:{DEFAULT_VOCAB_SIZE}".encode())
    for t in texts:
        h.update(t.encode("utf-8", "replace"))
        h.update(b"\0")
    ver = f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return f"{ver}-{h.hexdigest()[:16]}"


def _result(root: str) -> dict:
    return {
        "data_prefix": output_prefix_for(os.path.join(root, "pydoc_topics"), "text"),
        "vocab_file": os.path.join(root, "vocab.json"),
        "merge_file": os.path.join(root, "merges.txt"),
        "tokenizer_type": "GPT2BPETokenizer",
    }


def _build_into(root: str, texts: list[str]) -> None:
    jsonl = os.path.join(root, "pydoc_topics.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    vocab, merges = train_bpe(texts, DEFAULT_VOCAB_SIZE)
    vocab_file, merge_file = save_bpe(vocab, merges, root)
    tok = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    preprocess(
        PreprocessOptions(
            input=jsonl,
            output_prefix=os.path.join(root, "pydoc_topics"),
            tokenizer=tok,
            append_eod=True,
            workers=1,
            log_interval=0,
        )
    )


def prepare_default_corpus(cache_dir: Optional[str] = None) -> dict:
    """Build (once) and return the default corpus: data prefix, tokenizer files and type.

    ``cache_dir`` defaults to ``$MEGALITE_CACHE`` or ``~/.cache/megalite/default_corpus``.
    Returns ``{"data_prefix", "vocab_file", "merge_file", "tokenizer_type"}``;
    a cache hit costs a hash of the text and a few stat calls.
    """
    base = (
        cache_dir
        or os.environ.get("MEGALITE_CACHE")
        or os.path.join(os.path.expanduser("~"), ".cache", "megalite", "default_corpus")
    )
    texts = _topics()
    root = os.path.join(base, _cache_key(texts))
    result = _result(root)
    if dataset_exists(result["data_prefix"]):
        return result
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=base)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the cache from other users
    try:
        logger.info("building the default corpus under %s", root)
        _build_into(tmp, texts)
        try:
            os.rename(tmp, root)
        except OSError:
            if not dataset_exists(result["data_prefix"]):  # not a lost race: a real error
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return result
