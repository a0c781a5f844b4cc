"""Preprocessing: round trips through the tool, workers/partitions/gzip, bad input, crashes."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megalite.config import DataConfig
from megalite.data.indexed_dataset import IndexedDataset, dataset_exists
from megalite.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megalite.data.tokenizers import build_tokenizer
from tests.helpers import REPO

NULL = DataConfig(tokenizer_type="NullTokenizer")


def _run(tmp_path, path, **kw):
    opts = dict(input=str(path), output_prefix=str(tmp_path / "out"), tokenizer=NULL, log_interval=0, vocab_size=1000)
    opts.update(kw)
    return preprocess(PreprocessOptions(**opts))


@pytest.mark.parametrize("workers, partitions, gz", [(1, 1, False), (2, 1, True), (2, 2, False)])
def test_random_documents_round_trip(tmp_path, data_write_jsonl, data_random_id_docs, workers, partitions, gz):
    docs, texts = data_random_id_docs(700)
    path = data_write_jsonl(tmp_path / "in.jsonl", texts)
    if gz:
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            dst.write(src.read())
        path += ".gz"
    stats = _run(tmp_path, path, append_eod=True, workers=workers, partitions=partitions)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert stats.documents == {"text": 700} and len(ds) == 700
    # Megatron's partition order: line i goes to partition i mod P, partitions concatenated
    order = [i for p in range(partitions) for i in range(p, 700, partitions)]
    assert [ds[i].tolist() for i in range(700)] == [docs[i] + [1000] for i in order]
    assert ds.dtype.name == "uint16"
    assert [p for p in os.listdir(tmp_path) if "tmp" in p or "part" in p] == []


def test_gpt2_bpe_multiple_keys_through_the_cli(tmp_path, data_bpe_files, data_texts):
    import json

    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for t in data_texts:
            if t:
                f.write(json.dumps({"text": t, "title": t[:20]}) + "\n")
    cmd = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "o"),
        "--json-keys",
        "text",
        "title",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        data_bpe_files[0],
        "--merge-file",
        data_bpe_files[1],
        "--append-eod",
        "--workers",
        "2",
        "--log-interval",
        "10",
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "docs/s" in out.stdout and "MB/s" in out.stdout and "tokens/s" in out.stdout
    tok = build_tokenizer(
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=data_bpe_files[0], merge_file=data_bpe_files[1])
    )
    texts = [t for t in data_texts if t]
    for key, want in (("text", texts), ("title", [t[:20] for t in texts])):
        ds = IndexedDataset(tmp_path / f"o_{key}_document")
        assert [tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == want
        assert all(ds[i][-1] == tok.eod for i in range(len(ds)))


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"text": "1 2"', "invalid JSON"),
        ('["1 2"]', "expected a JSON object"),
        ('{"body": "1 2"}', "missing key 'text'"),
        ('{"text": 12}', "not a string"),
        ('{"text": "1 x 2"}', "invalid literal"),
    ],
)
def test_bad_line_stops_with_file_and_line(tmp_path, line, reason):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2"}\n\n{"text": "3"}\n' + line + '\n{"text": "4"}\n')
    with pytest.raises(PreprocessError, match=f"{path}:4: .*{reason}"):
        _run(tmp_path, path, workers=2)
    assert not dataset_exists(tmp_path / "out_text_document")
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_skip_invalid_counts_and_empty_documents(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2"}\n{"text": \n{"x": "1"}\n{"text": ""}\n{"text": "  "}\n{"text": "5"}\n')
    stats = _run(tmp_path, path, skip_invalid=True, append_eod=True)
    assert (stats.invalid_skipped, stats.empty_documents, stats.documents["text"]) == (2, 2, 4)
    assert "2 empty (kept" in stats.summary() and "skipped 2 invalid" in stats.summary()
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 1000], [5, 1000]]
    # the two documents without tokens stay documents with no sequences, as in Megatron
    assert ds.document_indices.tolist() == [0, 1, 1, 1, 2]


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, data_bpe_files):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "caf\xe9 ok"}\n{"text": "lone \\ud800 surrogate"}\n{"text": "fine"}\n')
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=data_bpe_files[0], merge_file=data_bpe_files[1])
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
    cmd = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
        "--log-interval",
        "0",
    ]
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
    out = subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            "x.jsonl",
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "GPT2BPETokenizer",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "preprocess_data.py: error:" in out.stderr


def test_partitioned_error_reports_true_line_number(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = ['{"text": "1 2 3"}'] * 100
    lines[89] = '{"text": oops}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PreprocessError, match=f"{path}:90: invalid JSON"):
        _run(tmp_path, path, partitions=2)
    assert os.listdir(tmp_path) == ["in.jsonl"]


# ------------------------------------------------ Megatron's bytes (megatron-core as oracle)
def _megatron_preprocess(path, prefix, tokenize, eod, vocab_size, keys, partitions, sequential):
    """What Megatron-LM's tools/preprocess_data.py (core_v0.16.1) writes, built with
    megatron-core's own IndexedDatasetBuilder: lines read in text mode, each line's
    key values encoded as its Encoder.encode does (a list is sentences, empty ones
    dropped, eod on the last), add_document per line; with partitions, lines dealt
    round robin (or in consecutive runs) and the parts merged with add_index."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    with open(path, encoding="utf-8") as f:
        lines = list(f)
    if partitions == 1:
        parts = [lines]
    elif sequential:
        run = -(-len(lines) // partitions)
        parts = [lines[p * run : (p + 1) * run] for p in range(partitions)]
    else:
        parts = [lines[p::partitions] for p in range(partitions)]
    dtype = DType.optimal_dtype(vocab_size)
    for key in keys:
        merged = IndexedDatasetBuilder(f"{prefix}_{key}_document.bin", dtype=dtype)
        for p, part in enumerate(parts):
            part_prefix = f"{prefix}.p{p}_{key}_document"
            builder = IndexedDatasetBuilder(part_prefix + ".bin", dtype=dtype)
            for line in part:
                value = json.loads(line)[key]
                ids, lens = [], []
                for sentence in value if isinstance(value, list) else [value]:
                    piece = tokenize(sentence)
                    if piece:
                        ids += piece
                        lens.append(len(piece))
                if ids and eod is not None:
                    ids.append(eod)
                    lens[-1] += 1
                builder.add_document(ids, lens)
            builder.finalize(part_prefix + ".idx")
            merged.add_index(part_prefix)
        merged.finalize(f"{prefix}_{key}_document.idx")


def _awkward_corpus(path, texts):
    """Real text plus what a scraped corpus holds: empty documents, sentence lists with
    empty sentences, an empty list, CRLF endings and a bare CR between two objects."""
    rows = []
    for i, t in enumerate(texts):
        rows.append({"text": t, "title": t[:12]})
        if i % 9 == 0:
            rows.append({"text": "", "title": t[:5]})
        if i % 13 == 0:
            rows.append({"text": [t[:40], "", t[40:90]], "title": []})
    rows.append({"text": "", "title": ""})  # an empty document last
    lines = [json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(rows)]
    body = "\n".join(lines[:10]) + "\r\n" + "\r\n".join(lines[10:20]) + "\r"
    path.write_bytes((body + "\n".join(lines[20:]) + "\n").encode("utf-8"))
    return str(path)


@pytest.mark.parametrize("workers, partitions, sequential", [(1, 1, False), (2, 1, False), (2, 2, False), (3, 3, True)])
def test_bytes_equal_megatron_gpt2_bpe(tmp_path, data_bpe_files, data_texts, workers, partitions, sequential):
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tokenizers = pytest.importorskip("tokenizers")
    # Megatron's GPT2BPETokenizer is Hugging Face's GPT-2 byte-level BPE on the same files
    hf = tokenizers.ByteLevelBPETokenizer(*data_bpe_files)
    path = _awkward_corpus(tmp_path / "in.jsonl", data_texts)
    keys = ("text", "title")
    eod = hf.token_to_id("<|endoftext|>")
    _megatron_preprocess(
        path, str(tmp_path / "mlm"), lambda s: hf.encode(s).ids, eod, hf.get_vocab_size(), keys, partitions, sequential
    )
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=data_bpe_files[0], merge_file=data_bpe_files[1])
    stats = _run(
        tmp_path,
        path,
        tokenizer=cfg,
        json_keys=keys,
        append_eod=True,
        workers=workers,
        partitions=partitions,
        keep_sequential_samples=sequential,
    )
    assert stats.empty_documents > 0
    for key in keys:
        for ext in (".bin", ".idx"):
            ours = (tmp_path / f"out_{key}_document{ext}").read_bytes()
            assert ours == (tmp_path / f"mlm_{key}_document{ext}").read_bytes(), (key, ext)


def test_bytes_equal_megatron_null_tokenizer_without_eod(tmp_path, data_random_id_docs):
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tokenizers_mod = pytest.importorskip("megatron.core.tokenizers")
    tok = tokenizers_mod.MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=70000)
    docs, texts = data_random_id_docs(300, vocab=70000)
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": [t, t[:9].strip()] if i % 5 == 0 else t}) + "\n")
    _megatron_preprocess(str(path), str(tmp_path / "mlm"), tok.tokenize, None, tok.vocab_size, ("text",), 1, False)
    _run(tmp_path, path, vocab_size=70000, workers=2)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype.name == "int32"  # 70001 ids do not fit uint16's Megatron range
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out_text_document{ext}").read_bytes() == (
            tmp_path / f"mlm_text_document{ext}"
        ).read_bytes(), ext


@pytest.mark.parametrize("extra", [["--workers", "2"], ["--workers", "2", "--partitions", "2"]])
def test_tool_prints_its_summary_once(tmp_path, data_write_jsonl, data_random_id_docs, extra):
    _, texts = data_random_id_docs(50)
    path = data_write_jsonl(tmp_path / "in.jsonl", texts)
    cmd = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        path,
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "1000",
        "--log-interval",
        "0",
        *extra,
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    both = out.stdout + out.stderr
    assert both.count("docs/s") == 1 and both.count("50 lines") == 1, both


def test_merge_tool_takes_a_directory_in_megatron_prefix_order(tmp_path):
    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    shards = tmp_path / "shards"
    for name, value in (("a-b", 2), ("a", 1), ("a_c", 3)):
        b = IndexedDatasetBuilder(shards / name, np.uint16)
        b.add_document([value] * 3, [3])
        b.finalize()
    out = subprocess.run(
        [sys.executable, "tools/merge_datasets.py", "--input", str(shards), "--output-prefix", str(tmp_path / "m")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    ds = IndexedDataset(tmp_path / "m")
    # Megatron sorts the prefixes: "a" < "a-b" < "a_c" (file names would put "a-b.idx" first)
    assert [int(ds[i][0]) for i in range(3)] == [1, 2, 3]
    out = subprocess.run(
        [
            sys.executable,
            "tools/merge_datasets.py",
            "--input",
            str(tmp_path / "m"),
            "--output-prefix",
            str(tmp_path / "n"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0  # a prefix, not a directory


def test_split_sentences_is_refused_in_one_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            "x.jsonl",
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "NullTokenizer",
            "--split-sentences",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "JSON list of sentences" in out.stderr
