"""pretrain_gpt.py end to end in one process: log lines, evaluation, TensorBoard, timeline
(the torchrun TP=2 x DP=2 run is in tests/distributed/test_launch.py)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.pretrain_cli import TINY, _losses


def test_single_process_run_logs_evaluates_and_writes_tensorboard(tmp_path, capsys):
    import pretrain_gpt

    tb, timeline = tmp_path / "tb", tmp_path / "timeline.json"
    rc = pretrain_gpt.main(
        TINY
        + [
            "--train-iters",
            "4",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--tensorboard-dir",
            str(tb),
            "--timeline-out",
            str(timeline),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert len(_losses(out)) == 4
    assert re.search(r" iteration +4/ +4 \| consumed samples: +32 \|", out)
    assert out.count("validation loss at iteration") == 2
    events = json.loads(timeline.read_text())
    assert events["source"] == "measured" and events["m"] == 4
    assert sorted((e["kind"], e["mb"]) for e in events["events"]) == sorted(
        [("F", i) for i in range(4)] + [("B", i) for i in range(4)]
    )
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(tb))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation"} <= set(tags)
    assert [round(e.value, 5) for e in acc.Scalars("lm loss")] == [round(x, 5) for x in _losses(out)]


_EVAL = r"validation loss at (iteration \d+|the end of training for \w+ data) \| lm loss value: ([0-9.E+-]+) \|"


def test_test_split_is_evaluated_at_the_end_and_skip_train_only_evaluates(tmp_path, capsys):
    # A completed run evaluates the validation split once more at the end, then the test split once
    # (Megatron's lines). --skip-train on its checkpoint runs no iteration, saves nothing and logs the
    # same two losses; tools/evaluate.py's test-split loss of the checkpoint is the same number.
    import pretrain_gpt
    from tools import evaluate

    ckpt = tmp_path / "ckpt"
    run = TINY + ["--train-iters", "3", "--eval-interval", "2", "--eval-iters", "2", "--save", str(ckpt)]
    assert pretrain_gpt.main(run) == 0
    out = capsys.readouterr().out
    found = re.findall(_EVAL, out)
    assert [w for w, _ in found] == [
        "iteration 2",
        "the end of training for val data",
        "the end of training for test data",
    ], out
    assert found[1][1] != found[2][1]  # two splits, two losses
    assert f"test lm loss {float(found[2][1]):.4f}" in out
    saved = sorted(p.name for p in ckpt.iterdir())

    assert pretrain_gpt.main(run + ["--load", str(ckpt), "--skip-train"]) == 0
    out = capsys.readouterr().out
    again = re.findall(_EVAL, out)
    assert [w for w, _ in again] == ["the end of training for val data", "the end of training for test data"], out
    for (_, a), (_, b) in zip(found[1:], again):
        assert abs(float(a) - float(b)) <= 1e-6 * abs(float(a)), (found, again)
    assert not re.search(r" iteration +\d+/", out) and "training skipped (--skip-train): 0 iterations" in out
    assert sorted(p.name for p in ckpt.iterdir()) == saved

    (tmp_path / "empty").mkdir()
    assert pretrain_gpt.main(run + ["--load", str(tmp_path / "empty"), "--skip-train"]) == 2
    assert "--skip-train: --load " in capsys.readouterr().err

    assert evaluate.main(["--load", str(ckpt), "--split-name", "test"]) == 0
    tool = re.search(
        r"validation loss at iteration 3 for test data \| lm loss value: ([0-9.E+-]+) \|", capsys.readouterr().out
    )
    assert tool and abs(float(tool.group(1)) - float(found[2][1])) <= 1e-6 * abs(float(found[2][1]))


def test_eval_iters_zero_disables_evaluation(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(TINY + ["--train-iters", "2", "--eval-interval", "1", "--eval-iters", "0"]) == 0
    assert "validation loss" not in capsys.readouterr().out


@pytest.mark.slow
def test_bad_data_is_one_line_error(tmp_path):
    (tmp_path / "x_text_document.idx").write_bytes(b"NOTMMIDIDX" + bytes(40))
    (tmp_path / "x_text_document.bin").write_bytes(bytes(8))
    corpus_args = ["--vocab-size", "100", "--tokenizer-type", "NullTokenizer", "--train-iters", "1"]
    for extra, message in [
        (["--data-path", str(tmp_path / "x_text_document")], "x_text_document.idx"),
        (["--data-path", str(tmp_path / "missing")], "missing"),
    ]:
        proc = subprocess.run(
            [sys.executable, "pretrain_gpt.py"] + corpus_args + extra,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error:") and message in lines[0], lines


def test_save_and_resume_through_the_cli_continues_the_run(tmp_path, capsys):
    import pretrain_gpt

    common = TINY + ["--eval-iters", "0", "--hidden-dropout", "0.1"]
    ck = str(tmp_path / "ck")
    assert pretrain_gpt.main(common + ["--train-iters", "6"]) == 0
    straight = _losses(capsys.readouterr().out)
    assert (
        pretrain_gpt.main(
            common
            + [
                "--train-iters",
                "6",
                "--exit-interval",
                "3",
                "--save",
                ck,
                "--save-interval",
                "2",
                "--ckpt-keep-last",
                "1",
            ]
        )
        == 0
    )
    first = _losses(capsys.readouterr().out)
    assert sorted(p.name for p in pathlib.Path(ck).iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert pretrain_gpt.main(common + ["--train-iters", "6", "--load", ck]) == 0
    out = capsys.readouterr().out
    assert "loaded checkpoint" in out and re.search(r" iteration +4/ +6 \| consumed samples: +32 \|", out)
    assert first + _losses(out) == straight  # dropout on: RNG, data position and optimizer all resumed
    # a checkpoint of another model shape is one line on stderr, exit code 2
    assert pretrain_gpt.main(common + ["--train-iters", "6", "--load", ck, "--hidden-size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hidden_size 32 (checkpoint) vs 64 (run)" in err[0]


def test_zero_train_iters_runs_nothing_and_exits_cleanly(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(TINY + ["--train-iters", "0", "--eval-iters", "0"]) == 0
    assert _losses(capsys.readouterr().out) == []


def test_non_finite_loss_stops_the_run_or_is_counted(capsys):
    import pretrain_gpt

    diverging = TINY + [
        "--train-iters",
        "4",
        "--lr",
        "1e30",
        "--min-lr",
        "0",
        "--lr-warmup-iters",
        "0",
        "--clip-grad",
        "0",
        "--eval-iters",
        "1",
        "--eval-interval",
        "4",
    ]
    assert pretrain_gpt.main(diverging) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and re.search(r"iteration \d: the loss or gradient norm is not finite", err[0]), err
    assert "--no-check-for-nan-in-loss-and-grad" in err[0]
    assert pretrain_gpt.main(diverging + ["--no-check-for-nan-in-loss-and-grad"]) == 0
    out = capsys.readouterr().out
    nans = [int(x) for x in re.findall(r"number of nan iterations: +(\d+)", out)]
    assert nans[-1] >= 1
    assert "lm loss PPL: NAN |" in out  # not exp(20) (Megatron's {:.6E} format of nan)
