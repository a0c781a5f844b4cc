"""Training on preprocessed .bin/.idx data: every layout reads the same global batches.

The corpus, tokenizer and dataset are made with the project's own tools (as a
user would), then a TP=1 x PP=2 x DP=2 run must reproduce the single-process run.
"""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from megalite.config import DataConfig
from megalite.data.loading import resolve_data
from tests.helpers import REPO
from tests.helpers.parity import GPT2_STYLE, assert_close_run, reference_run, run_steps, tiny_config


def _make_dataset(tmp: Path) -> DataConfig:
    from pydoc_data.topics import topics

    corpus = tmp / "corpus.jsonl"
    with corpus.open("w") as f:
        for key in sorted(topics)[:30]:
            f.write(json.dumps({"text": topics[key]}) + "\n")

    def run(*a):
        return subprocess.run([sys.executable, *a], cwd=REPO, check=True, capture_output=True, text=True, timeout=300)

    run(
        "tools/train_tokenizer.py",
        "--input",
        str(corpus),
        "--type",
        "bpe",
        "--vocab-size",
        "500",
        "--output-dir",
        str(tmp / "tok"),
    )
    run(
        "tools/preprocess_data.py",
        "--input",
        str(corpus),
        "--output-prefix",
        str(tmp / "corpus"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp / "tok/vocab.json"),
        "--merge-file",
        str(tmp / "tok/merges.txt"),
        "--append-eod",
        "--workers",
        "1",
    )
    return DataConfig(
        data_path=(str(tmp / "corpus_text_document"),),
        split="90,10,0",
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(tmp / "tok/vocab.json"),
        merge_file=str(tmp / "tok/merges.txt"),
        data_cache_path=str(tmp / "cache"),
    )


def test_pp2_dp2_on_preprocessed_data_matches_single_process(tmp_path, run_distributed):
    base = tiny_config(GPT2_STYLE, gbs=8, mbs=1)
    cfg = resolve_data(base.with_(data=_make_dataset(tmp_path)))
    assert cfg.model.vocab_size == 500
    ref = reference_run(cfg, 3)
    dist_cfg = cfg.with_(parallel=replace(cfg.parallel, pp=2))
    results = run_distributed(run_steps, 4, dist_cfg, 3, ref["state"], pp=2)
    assert_close_run(results, ref)
    assert any(p.suffix == ".npy" for p in (tmp_path / "cache").rglob("*"))
