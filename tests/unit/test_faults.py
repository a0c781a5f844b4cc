"""Faults in one process: SIGINT to a single pretrain_gpt.py (a real process), --exit-duration-in-mins,
the end-of-training summary, and injected faults (--inject-fault-*) that stop the run with one line.
(Killed, stopped and signalled ranks of torchrun jobs: tests/distributed/test_faults.py.)
"""

import re
import signal
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.helpers import REPO, TINY_RUN
from tests.helpers.faults import FOREVER, RUN


@pytest.mark.slow
def test_sigint_to_a_single_process_is_one_line(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "pretrain_gpt.py"] + FOREVER,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if " iteration " in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert (
        err.strip() == "pretrain_gpt.py: received SIGINT: exiting without saving "
        "(--exit-signal-handler saves a checkpoint first)"
    )


def test_exit_duration_stops_and_saves(tmp_path, capsys):
    rc = pretrain_gpt.main(
        RUN
        + [
            "--train-iters",
            "100000",
            "--exit-duration-in-mins",
            "0.002",
            "--save",
            str(tmp_path / "ckpt"),
            "--log-interval",
            "1000",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    it = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 0 < it < 100000
    assert f"training stopped (--exit-duration-in-mins 0.002 reached): {it} iterations" in out


def test_end_of_training_evaluates_and_summarises(tmp_path, capsys):
    tb = tmp_path / "tb"
    rc = pretrain_gpt.main(
        RUN[: RUN.index("--eval-iters")]
        + [
            "--num-threads",
            "1",
            "--train-iters",
            "5",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--log-interval",
            "1",
            "--tensorboard-dir",
            str(tb),
            "--save",
            str(tmp_path / "ckpt"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert re.findall(r"validation loss at (iteration \d+|the end of training for val data)", out) == [
        "iteration 2",
        "iteration 4",
        "the end of training for val data",
    ]
    assert re.search(
        r"\| elapsed: \d+:\d\d:\d\d \| ETA: \d+:\d\d:\d\d \|$",
        out.splitlines()[[i for i, line in enumerate(out.splitlines()) if " iteration        5/" in line][0]],
    )
    summary = out[out.index("training done: ") :]
    assert re.match(
        r"training done: 5 iterations \(5 in all\), 640 tokens in \d+:\d\d:\d\d; final lm loss "
        r"\d+\.\d{4}, validation lm loss \d+\.\d{4}",
        summary,
    )
    assert f"checkpoint: {tmp_path / 'ckpt'} (iteration 5)" in summary and f"tensorboard: {tb}" in summary
    last_logged = float(re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)[-1])
    assert f"final lm loss {last_logged:.4f}," in summary  # the last log interval's mean (interval 1 here)


def test_summary_loss_is_the_last_logged_one_when_the_window_is_short(capsys):
    assert pretrain_gpt.main(RUN + ["--train-iters", "3", "--log-interval", "2"]) == 0
    out = capsys.readouterr().out
    last_logged = float(re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)[-1])  # iteration 3: a window of one
    assert f"final lm loss {last_logged:.4f}" in out


def test_injected_exception_is_one_line_and_exit_1(capsys):
    rc = pretrain_gpt.main(
        TINY_RUN
        + [
            "--eval-iters",
            "0",
            "--num-threads",
            "1",
            "--train-iters",
            "3",
            "--inject-fault-at-iteration",
            "2",
            "--inject-fault-kind",
            "exception",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert err == (
        "pretrain_gpt.py: error: rank 0: --inject-fault-kind exception at iteration 2: this rank stops with an error\n"
    )


def test_injected_fault_rank_outside_the_world_is_refused(capsys):
    rc = pretrain_gpt.main(
        TINY_RUN + ["--train-iters", "3", "--inject-fault-at-iteration", "2", "--inject-fault-rank", "1"]
    )
    assert rc == 2
    assert capsys.readouterr().err == (
        "pretrain_gpt.py: error: --inject-fault-rank 1 is not a rank of this world of 1; give 0..0\n"
    )
