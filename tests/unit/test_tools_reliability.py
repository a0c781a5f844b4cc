"""Tools under bad input and edge cases (issue 10, part 6).

SentencePiece must see every document, however long; the BPE trainer says why
it stops short; plot_pipeline without matplotlib and every bad input to the
tools end with one line on stderr, exit code 2 and no traceback.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import logging
import os
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch

from megalite.data.tokenizers.bpe_trainer import train_bpe
from megalite.data.tokenizers.sentencepiece import SP_MAX_SENTENCE_BYTES, split_for_sentencepiece
from tests.helpers import REPO


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _long_corpus() -> list[str]:
    """pydoc's topics (a third of them over the limit) plus a long single line and a long word."""
    from pydoc_data.topics import topics

    words = " ".join(f"word{i % 97}" for i in range(3000))  # ~20 KB on one line
    return [topics[k] for k in sorted(topics)] + [words, "日本語" * 1500]  # no whitespace, 13 KB


def test_split_for_sentencepiece_is_lossless_and_bounded():
    rng = random.Random(0)
    units = ["a", "é", "日", "🎉", " ", "\n", "  ", "word "]
    for _ in range(300):
        text = "".join(rng.choice(units) * rng.randint(1, 50) for _ in range(rng.randint(0, 400)))
        limit = rng.choice([4, 5, 8, 64, 300])
        pieces = list(split_for_sentencepiece(text, limit))
        assert "".join(pieces) == text
        assert all(0 < len(p.encode("utf-8")) <= limit for p in pieces)
    # whole lines are kept together when they fit
    assert list(split_for_sentencepiece("aaa\nbbb\nccc\n", 8)) == ["aaa\nbbb\n", "ccc\n"]


# Runs the library trainer with SentencePiece's own log on, so the test reads what
# the trainer itself loaded and counted, not what we believe we fed it.
_SP_SCRIPT = """
import json, sys
import sentencepiece as spm
from megalite.data.tokenizers.sentencepiece import train_sentencepiece
train = spm.SentencePieceTrainer.train
spm.SentencePieceTrainer.train = lambda **kw: train(**{**kw, "minloglevel": 0})
texts = json.load(open(sys.argv[1]))
used = train_sentencepiece(texts, sys.argv[2], 600)
print(json.dumps(used.__dict__))
"""


def test_sentencepiece_trains_on_every_character_of_long_documents(tmp_path):
    docs = _long_corpus()
    sizes = [len(d.encode("utf-8")) for d in docs]
    assert sum(s > SP_MAX_SENTENCE_BYTES for s in sizes) >= 20  # the case that used to drop
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    out = _run("-c", _SP_SCRIPT, str(tmp_path / "docs.json"), str(tmp_path / "tok"))
    assert out.returncode == 0, out.stderr[-2000:]
    used = json.loads(out.stdout.splitlines()[-1])
    assert (used["documents"], used["characters"], used["bytes"]) == (len(docs), sum(map(len, docs)), sum(sizes))
    assert used["split_documents"] == sum(s > SP_MAX_SENTENCE_BYTES for s in sizes)
    log = out.stderr
    assert "too long" not in log.lower() and "Skipped" not in log
    assert int(re.search(r"Loaded all (\d+) sentences", log)[1]) == used["pieces"]
    seen = int(re.search(r"all chars count=(\d+)", log)[1])
    # SentencePiece NFKC-normalizes and folds each whitespace run into one "▁",
    # so it sees every non-space character and at most one mark per space.
    text = unicodedata.normalize("NFKC", "".join(docs))
    non_space = sum(not c.isspace() for c in text)
    assert non_space <= seen <= len(text) + used["pieces"]
    short_only = sum(len(d) for d, s in zip(docs, sizes) if s <= SP_MAX_SENTENCE_BYTES)
    assert short_only < non_space / 4  # dropping long documents could not pass the bound


def test_train_tokenizer_sentencepiece_reports_what_it_used(tmp_path):
    docs = _long_corpus()
    corpus = tmp_path / "c.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    out = _run(
        "tools/train_tokenizer.py",
        "--input",
        str(corpus),
        "--type",
        "sentencepiece",
        "--vocab-size",
        "600",
        "--output-dir",
        str(tmp_path / "tok"),
    )
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "SentencePiece trained on" in ln)
    assert f"on {len(docs)} documents, {sum(map(len, docs))} characters" in line
    assert "none dropped" in line and (tmp_path / "tok" / "tokenizer.model").is_file()


def test_bpe_says_why_it_stops_below_the_requested_vocabulary(caplog):
    caplog.set_level(logging.WARNING, "megalite.data.tokenizers.bpe_trainer")
    vocab, merges = train_bpe(["hello hello world"] * 3, 400, min_frequency=4)
    assert len(vocab) < 400
    (msg,) = [r.getMessage() for r in caplog.records]
    assert f"vocabulary of {len(vocab)} of the 400 requested after {len(merges)} merges" in msg
    assert "occurs 3 times, below --min-frequency 4" in msg and "lower --min-frequency" in msg
    caplog.clear()
    vocab, merges = train_bpe(["ab cd"], 400, min_frequency=1)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "no pair left to merge" in msg and f"of {len(vocab)} of the 400" in msg
    caplog.clear()
    vocab, _ = train_bpe(["hello hello world"] * 3, 260)  # reached: no warning
    assert len(vocab) == 260 and not caplog.records


def _assert_one_line_error(out: subprocess.CompletedProcess, tool: str, expected: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"{tool}: error: ") and expected in lines[0], lines[0]


_NO_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; "
    "sys.argv = ['tools/plot_pipeline.py'] + sys.argv[1:]; "
    "runpy.run_path('tools/plot_pipeline.py', run_name='__main__')"
)


def test_plot_pipeline_without_matplotlib_says_how_to_install(tmp_path):
    out = _run("-c", _NO_MATPLOTLIB, "--schedule", "1f1b", "--pp", "2", "--out", str(tmp_path / "t.png"))
    _assert_one_line_error(out, "plot_pipeline.py", "pip install matplotlib")
    assert not (tmp_path / "t.png").exists()
    out = _run("-c", _NO_MATPLOTLIB, "--schedule", "1f1b", "--pp", "2", "--print")
    assert out.returncode == 0 and "rank 0: F0" in out.stdout  # text output needs no matplotlib


def test_train_tokenizer_without_sentencepiece_says_how_to_install(tmp_path):
    script = (
        "import runpy, sys; sys.modules['sentencepiece'] = None; "
        "sys.argv = ['tools/train_tokenizer.py'] + sys.argv[1:]; "
        "runpy.run_path('tools/train_tokenizer.py', run_name='__main__')"
    )
    (tmp_path / "c.txt").write_text("some text\n")
    out = _run(
        "-c",
        script,
        "--input",
        str(tmp_path / "c.txt"),
        "--type",
        "sentencepiece",
        "--output-dir",
        str(tmp_path / "tok"),
    )
    _assert_one_line_error(out, "train_tokenizer.py", "pip install sentencepiece")


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    from pydoc_data.topics import topics

    (d / "ok.jsonl").write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)[:20]))
    (d / "empty.jsonl").write_text("")
    (d / "blank.txt").write_text("\n  \n\n")
    (d / "other_key.jsonl").write_text(json.dumps({"content": "hello"}) + "\n")
    (d / "garbage.jsonl.gz").write_bytes(b"not gzip at all")
    (d / "a_file").write_text("x")
    (d / "not_json.json").write_text("{")
    (d / "not_timeline.json").write_text(json.dumps({"pp": 2}))
    (d / "mostly_invalid.jsonl").write_text(json.dumps({"text": "hello"}) + "\n" + "{not json\n" * 99)
    return d


TT, PP, PD = "tools/train_tokenizer.py", "tools/plot_pipeline.py", "tools/preprocess_data.py"
NULL = "--tokenizer-type NullTokenizer --vocab-size 10"
# (tool, arguments with {d} for the fixture dir, words the one-line error must hold)
_BAD_INPUTS = [
    (TT, "--input {d}/missing.jsonl --output-dir {d}/o", "--input file not found: {d}/missing"),
    (TT, "--input {d} --output-dir {d}/o", "is not a file"),
    (TT, "--input {d}/empty.jsonl --output-dir {d}/o", "no text in {d}/empty.jsonl"),
    (TT, "--input {d}/blank.txt --output-dir {d}/o", "every document is empty"),
    (TT, "--input {d}/other_key.jsonl --output-dir {d}/o", "--json-key 'text'"),
    (TT, "--input {d}/garbage.jsonl.gz --output-dir {d}/o", "cannot read --input {d}/garbage"),
    (
        TT,
        "--input {d}/ok.jsonl --vocab-size 100 --output-dir {d}/o",
        "--vocab-size 100 is too small for --type bpe: it needs at least 257",
    ),
    (
        TT,
        "--input {d}/ok.jsonl --type sentencepiece --vocab-size 259 --output-dir {d}/o",
        "--vocab-size 259 is too small for --type sentencepiece: it needs at least 260",
    ),
    (
        TT,
        "--input {d}/ok.jsonl --type sentencepiece --vocab-size 270 --output-dir {d}/o",
        "vocabulary size 270 is too small for this corpus",
    ),
    (TT, "--input {d}/ok.jsonl --min-frequency 0 --output-dir {d}/o", "--min-frequency must be"),
    (TT, "--input {d}/ok.jsonl --max-documents 0 --output-dir {d}/o", "--max-documents must be"),
    (TT, "--input {d}/ok.jsonl --output-dir {d}/a_file", "--output-dir {d}/a_file is not a writ"),
    (TT, "--input {d}/ok.jsonl --output-dir {d}/a_file/sub", "(Not a directory)"),
    (
        TT,
        "--input {d}/mostly_invalid.jsonl --output-dir {d}/o",
        "99 of 100 .jsonl lines are not a JSON object with a string under --json-key 'text' (first: "
        "{d}/mostly_invalid.jsonl:2: not JSON); more than half are invalid, so nothing is trained: check --input "
        "and --json-key",
    ),
    (
        PD,
        "--input {d}/ok.jsonl --output-prefix {d}/a_file/sub/o " + NULL,
        "--output-prefix {d}/a_file/sub/o: {d}/a_file is a file, not a directory; give a prefix in a directory",
    ),
    (
        PD,
        "--input {d}/ok.jsonl --output-prefix /proc/megalite-test/o " + NULL,
        "--output-prefix /proc/megalite-test/o: cannot write in /proc/megalite-test (",
    ),
    (PD, "--input {d}/missing.jsonl --output-prefix {d}/o " + NULL, "--input {d}/missing.jsonl: file not found"),
    (PP, "--timeline {d}/missing.json --out {d}/t.png", "cannot read --timeline {d}/missing"),
    (PP, "--timeline {d}/not_json.json --out {d}/t.png", "is not JSON"),
    (PP, "--timeline {d}/not_timeline.json --out {d}/t.png", "is not a TIMELINE (no schedule"),
    (PP, "--schedule 1f1b --pp 2 --save-json {d}/no_dir/t.json", "cannot write {d}/no_dir/t.json"),
    (PP, "--schedule 1f1b --pp 0 --print", "pipeline sizes must be >= 1"),
]


@pytest.mark.parametrize(
    "tool, args, expected", _BAD_INPUTS, ids=[f"{Path(t).stem}:{e[:30]}" for t, _, e in _BAD_INPUTS]
)
def test_bad_tool_input_is_one_line_and_exit_2(bad_inputs, tool, args, expected):
    out = _run(tool, *args.format(d=bad_inputs).split())
    _assert_one_line_error(out, Path(tool).name, expected.format(d=bad_inputs))


def test_train_tokenizer_says_how_many_invalid_lines_it_skipped(tmp_path):
    lines = [json.dumps({"text": f"the quick brown fox {i}"}) for i in range(9)] + [json.dumps({"body": "x"})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n\n")  # a blank line is not counted
    out = _run(TT, "--input", str(tmp_path / "c.jsonl"), "--vocab-size", "300", "--output-dir", str(tmp_path / "o"))
    assert out.returncode == 0 and (tmp_path / "o" / "vocab.json").is_file(), out.stderr
    assert out.stderr.strip().splitlines() == [
        f"train_tokenizer.py: warning: skipped 1 of 10 .jsonl lines: not a JSON object with a string under "
        f"--json-key 'text' (first: {tmp_path}/c.jsonl:10: no key 'text' (keys: body))"
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_preprocess_into_a_read_only_directory_is_one_line(bad_inputs, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    out = _run(PD, "--input", str(bad_inputs / "ok.jsonl"), "--output-prefix", str(ro / "o"), *NULL.split())
    _assert_one_line_error(
        out,
        "preprocess_data.py",
        f"--output-prefix {ro}/o: cannot write in {ro} (Permission denied); give a prefix in a writable directory",
    )


# -- in one process: the tools' main(), bad flags refused before any work --------------------------------------
def _main_error(main, argv, capsys) -> tuple:
    """(exit code, stderr lines) of a tool's main(), whether it returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("tool", ["generate", "evaluate"])
@pytest.mark.parametrize(
    "device, message",
    [
        (
            "cuda",
            "'cuda' needs CUDA, which this machine lacks (no GPU visible, or torch built without CUDA); use "
            "--device cpu",
        ),
        (
            "cuda:1",
            "'cuda:1' needs CUDA, which this machine lacks (no GPU visible, or torch built without CUDA); use "
            "--device cpu",
        ),
        ("gpu", "unknown device 'gpu'; give cpu, cuda or cuda:N"),
    ],
)
def test_device_the_machine_lacks_is_one_line(tool, device, message, tmp_path, capsys):
    main = importlib.import_module(f"tools.{tool}").main
    code, err = _main_error(main, ["--load", str(tmp_path), "--device", device], capsys)
    assert (code, err) == (2, [f"{tool}.py: error: argument --device: {message}"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--global-batch-size", "0"], "--global-batch-size 0 must be >= 1"),
        (["--micro-batch-size", "-1"], "--micro-batch-size -1 must be >= 1"),
        (
            ["--global-batch-size", "6", "--micro-batch-size", "4"],
            "--global-batch-size 6 is not a multiple of --micro-batch-size 4",
        ),
    ],
)
def test_evaluate_blames_the_batch_flag_not_the_data(flags, message, monkeypatch, capsys):
    from megalite.config import Config, DataConfig
    from tools import evaluate

    stored = Config(data=DataConfig(mock_data=True))  # the run's config, as read_checkpoint returns it
    monkeypatch.setattr(evaluate, "read_checkpoint", lambda load, step: (stored, 1, {}))
    code, err = _main_error(evaluate.main, ["--load", "ckpt", "--device", "cpu", *flags], capsys)
    assert (code, err) == (2, [f"evaluate.py: error: {message}"])


def test_plan_names_the_global_batch_when_no_data_parallel_size_divides_it(capsys):
    from tools import plan

    argv = ["--num-gpus", "5", "--gpu-memory", "80", "--model-size", "gpt3-125m", "--seq-length", "1024"]
    code, err = _main_error(plan.main, argv + ["--global-batch-size", "8"], capsys)
    assert (code, err) == (
        2,
        [
            "tools/plan.py: error: --global-batch-size 8 is not divisible by any data-parallel "
            "size (the data-parallel sizes this model allows on 5 GPUs are 5); use e.g. 10"
        ],
    )
    assert plan.main(argv + ["--global-batch-size", "10"]) == 0  # the suggestion plans


_spec = importlib.util.spec_from_file_location("convert_cli", REPO / "tools" / "checkpoint" / "convert.py")
convert_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_cli)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A GPT-2 style HF folder (its weights never read: the flags are refused first), and a truncated copy."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("hf")
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": 1,
        "n_embd": 16,
        "n_head": 2,
        "n_positions": 16,
        "vocab_size": 64,
        "activation_function": "gelu",
        "tie_word_embeddings": True,
    }
    for name in ("ok", "truncated"):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(config))
        save_file({"wte.weight": torch.zeros(64, 16)}, str(d / name / "model.safetensors"))
    with open(d / "truncated" / "model.safetensors", "r+b") as f:
        f.truncate(1000)  # an interrupted download
    return d


@pytest.mark.parametrize(
    "folder, flags, message",
    [
        (
            "truncated",
            [],
            "{d}/truncated/model.safetensors is not a complete safetensors file (Error while "
            "deserializing header: incomplete metadata, file not fully covered); it may be truncated (an "
            "interrupted download or copy): fetch it again",
        ),
        ("ok", ["--target-tensor-parallel-size", "0"], "--target-tensor-parallel-size must be >= 1, got 0"),
        ("ok", ["--target-pipeline-parallel-size", "0"], "--target-pipeline-parallel-size must be >= 1, got 0"),
        ("ok", ["--target-tensor-parallel-size", "-2"], "--target-tensor-parallel-size must be >= 1, got -2"),
        (
            "ok",
            ["--target-virtual-pipeline-model-parallel-size", "0"],
            "--target-virtual-pipeline-model-parallel-size must be >= 1, got 0",
        ),
        (
            "ok",
            ["--target-decoder-last-pipeline-num-layers", "-1"],
            "--target-decoder-last-pipeline-num-layers must be >= 0, got -1",
        ),
    ],
)
def test_convert_refuses_bad_files_and_sizes_in_one_line(hf_folders, folder, flags, message, tmp_path, capsys):
    # convert.py's exit status for bad input is 1 (tests/unit/test_convert.py)
    code, err = _main_error(
        convert_cli.main,
        [
            "--model-type",
            "GPT",
            "--loader",
            "hf",
            "--saver",
            "megalite",
            "--load-dir",
            str(hf_folders / folder),
            "--save-dir",
            str(tmp_path / "out"),
            *flags,
        ],
        capsys,
    )
    assert (code, err) == (1, [f"convert.py: error: {message.format(d=hf_folders)}"])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp-convert").exists()


_RECORD = {"rank": 0, "world_size": 1, "time": 10.0, "events": [], "open": [], "job": "j", "gen": 0}
# (a flight_recorder_rank_0.json that is valid JSON but not a dump, the words its one-line error must hold)
_NOT_DUMPS = [
    ([1, 2], "not a flight-recorder dump (a JSON list, not an object)"),
    ({"time": 1.0}, "not a flight-recorder dump (no 'rank', 'world_size', 'events', 'open')"),
    ({**_RECORD, "rank": "0"}, "('rank' is a JSON str, not int)"),
    ({**_RECORD, "time": None}, "('time' is a JSON NoneType, not a number)"),
    ({**_RECORD, "events": [3]}, "(an entry of 'events' is not an event with a numeric 'start')"),
    ({**_RECORD, "rank": 4}, "(rank 4 outside world_size 1)"),
    ({**_RECORD, "groups": []}, "('groups' is a JSON list, not dict)"),
]


@pytest.mark.parametrize("record, expected", _NOT_DUMPS, ids=[e[:30] for _, e in _NOT_DUMPS])
def test_diagnose_refuses_a_file_that_is_not_a_recorder_dump(tmp_path, capsys, record, expected):
    """Valid JSON of the wrong shape once ended in a KeyError/TypeError traceback inside the diagnosis."""
    from tools import diagnose

    path = tmp_path / "flight_recorder_rank_0.json"
    path.write_text(json.dumps(record))
    code, err = _main_error(diagnose.main, [str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"diagnose.py: error: {path}: ") and expected in err[0], err[0]
    assert err[0].endswith(
        "give the run's --debug-dir, whose flight_recorder_rank_<N>.json files the job wrote, "
        "or move this file out of it"
    )


def test_diagnose_bad_input_in_a_fresh_process_is_one_line(tmp_path):
    (tmp_path / "flight_recorder_rank_0.json").write_text(json.dumps({"time": 1.0}))
    _assert_one_line_error(_run("tools/diagnose.py", str(tmp_path)), "diagnose.py", "not a flight-recorder dump")
    _assert_one_line_error(_run("tools/diagnose.py", str(tmp_path), "--events", "nan"), "diagnose.py", "--events")
    (tmp_path / "flight_recorder_rank_0.json").write_text(json.dumps(_RECORD))
    assert _run("tools/diagnose.py", str(tmp_path)).returncode == 0  # the smallest dump still diagnoses
