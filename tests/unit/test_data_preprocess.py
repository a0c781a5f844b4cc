"""Preprocessing: round trips through the tool, workers/partitions/gzip, bad input, crashes."""
from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.config import DataConfig
from megalite.data.indexed_dataset import IndexedDataset, dataset_exists
from megalite.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megalite.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
NULL = DataConfig(tokenizer_type="NullTokenizer")


def _run(tmp_path, path, **kw):
    opts = dict(input=str(path), output_prefix=str(tmp_path / "out"), tokenizer=NULL,
                log_interval=0, vocab_size=1000)
    opts.update(kw)
    return preprocess(PreprocessOptions(**opts))


@pytest.mark.parametrize("workers, partitions, gz", [(1, 1, False), (2, 1, True), (2, 2, False)])
def test_random_documents_round_trip(tmp_path, data_write_jsonl, data_random_id_docs,
                                     workers, partitions, gz):
    docs, texts = data_random_id_docs(700)
    path = data_write_jsonl(tmp_path / "in.jsonl", texts)
    if gz:
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            dst.write(src.read())
        path += ".gz"
    stats = _run(tmp_path, path, append_eod=True, workers=workers, partitions=partitions)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert stats.documents == {"text": 700} and len(ds) == 700
    assert [ds[i].tolist() for i in range(700)] == [d + [1000] for d in docs]
    assert ds.dtype.name == "uint16"
    assert [p for p in os.listdir(tmp_path) if "tmp" in p or "part" in p] == []


def test_gpt2_bpe_multiple_keys_through_the_cli(tmp_path, data_bpe_files, data_texts):
    import json
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for t in data_texts:
            if t:
                f.write(json.dumps({"text": t, "title": t[:20]}) + "\n")
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(path),
           "--output-prefix", str(tmp_path / "o"), "--json-keys", "text", "title",
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data_bpe_files[0],
           "--merge-file", data_bpe_files[1], "--append-eod", "--workers", "2",
           "--log-interval", "10"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "docs/s" in out.stdout and "MB/s" in out.stdout and "tokens/s" in out.stdout
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer",
                                     vocab_file=data_bpe_files[0], merge_file=data_bpe_files[1]))
    texts = [t for t in data_texts if t]
    for key, want in (("text", texts), ("title", [t[:20] for t in texts])):
        ds = IndexedDataset(tmp_path / f"o_{key}_document")
        assert [tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == want
        assert all(ds[i][-1] == tok.eod for i in range(len(ds)))


@pytest.mark.parametrize("line, reason", [
    ('{"text": "1 2"', "invalid JSON"),
    ('["1 2"]', "expected a JSON object"),
    ('{"body": "1 2"}', "missing key 'text'"),
    ('{"text": 12}', "not a string"),
    ('{"text": "1 x 2"}', "invalid literal"),
])
def test_bad_line_stops_with_file_and_line(tmp_path, line, reason):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2"}\n\n{"text": "3"}\n' + line + '\n{"text": "4"}\n')
    with pytest.raises(PreprocessError, match=f"{path}:4: .*{reason}"):
        _run(tmp_path, path, workers=2)
    assert not dataset_exists(tmp_path / "out_text_document")
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_skip_invalid_counts_and_empty_documents(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2"}\n{"text": \n{"x": "1"}\n{"text": ""}\n{"text": "  "}\n'
                    '{"text": "5"}\n')
    stats = _run(tmp_path, path, skip_invalid=True, append_eod=True)
    assert (stats.invalid_skipped, stats.empty_skipped, stats.documents["text"]) == (2, 2, 2)
    assert "2 invalid, 2 empty" in stats.summary()
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 1000], [5, 1000]]


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, data_bpe_files):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "caf\xe9 ok"}\n{"text": "lone \\ud800 surrogate"}\n'
                     b'{"text": "fine"}\n')
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=data_bpe_files[0],
                     merge_file=data_bpe_files[1])
    stats = _run(tmp_path, path, tokenizer=cfg)
    assert stats.utf8_replaced == 2 and stats.documents["text"] == 3
    tok = build_tokenizer(cfg)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert tok.detokenize(ds[0]) == "caf\ufffd ok"


def test_killed_halfway_leaves_no_valid_looking_output(tmp_path):
    path = tmp_path / "in.jsonl"
    line = '{"text": "' + " ".join(["7"] * 200) + '"}\n'
    with open(path, "w") as f:
        f.write(line * 200_000)  # ~160 MB of tokens: far from done within the wait below
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(path), "--output-prefix",
           str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
           "--log-interval", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        tmp = [p for p in os.listdir(tmp_path) if ".tmp-" in p and p.endswith(tuple("0123456789"))]
        if any(os.path.getsize(tmp_path / p) > 0 for p in tmp):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dataset_exists(tmp_path / "out_text_document")
    with pytest.raises(FileNotFoundError):
        IndexedDataset(tmp_path / "out_text_document")
    assert not [p for p in os.listdir(tmp_path) if p.endswith((".idx", ".bin"))]
    for p in os.listdir(tmp_path):  # do not leave ~100 MB behind in pytest's tmp dirs
        os.remove(tmp_path / p)


def test_missing_input_and_tool_error_exit(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input"):
        _run(tmp_path, tmp_path / "nope.jsonl")
    out = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", "x.jsonl",
                          "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                          "GPT2BPETokenizer"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1 and "error:" in out.stderr


def test_partitioned_error_reports_true_line_number(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = ['{"text": "1 2 3"}'] * 100
    lines[89] = '{"text": oops}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PreprocessError, match=f"{path}:90: invalid JSON"):
        _run(tmp_path, path, partitions=2)
    assert os.listdir(tmp_path) == ["in.jsonl"]
