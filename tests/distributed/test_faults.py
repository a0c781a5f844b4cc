"""Faults end the job fast and cleanly: a killed rank, a stopped (hung) rank, signals, a dead launcher,
a time limit. Real torchrun jobs; the slow one (a stopped rank waits out a one-minute timeout) runs
while the others are tried, so the file costs about two minutes.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from tests.conftest import REPO, TINY_RUN

RUN = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1"]
FOREVER = RUN + ["--train-iters", "1000000", "--log-interval", "20"]


class Job:
    """A torchrun job of ``nproc`` ranks (pp=2) whose output goes to files, started in the background."""

    def __init__(self, tmp, name, nproc, extra=(), launcher=()):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                 *launcher, "pretrain_gpt.py", "--pipeline-model-parallel-size", "2"] + FOREVER + list(extra),
                cwd=REPO, stdout=out, stderr=err, start_new_session=True)

    def wait_training(self, timeout=240):
        deadline = time.time() + timeout
        while " iteration " not in self.out.read_text():
            assert self.proc.poll() is None and time.time() < deadline, self.err.read_text()
            time.sleep(0.5)

    def workers(self):
        """pids of the ranks: torchrun's children."""
        text = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True,
                              text=True).stdout
        return [int(p) for p in text.split()]

    def wait(self, timeout):
        t0 = time.time()
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return time.time() - t0

    def our_lines(self):
        return [line for line in self.err.read_text().splitlines() if line.startswith("pretrain_gpt.py")]

    def no_rank_traceback(self):
        return not re.search(r"\[rank\d+\]: Traceback", self.err.read_text())


def _alive(pids):
    return [p for p in pids if os.path.exists(f"/proc/{p}") and
            "pretrain_gpt" in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_stopped_and_signalled_ranks_end_the_job(tmp_path):
    # A stopped rank: the other waits out --distributed-timeout-minutes 1, then the job ends (torchrun
    # needs up to 30 s more to SIGKILL the stopped one, which cannot act on SIGTERM).
    stopped = Job(tmp_path, "stopped", 2, ["--distributed-timeout-minutes", "1"])
    stopped.wait_training()
    os.kill(stopped.workers()[-1], signal.SIGSTOP)
    t_stop = time.time()

    # A killed rank out of 4 ends the job within seconds, and the job says why. Who speaks first is a
    # race: a survivor that meets the dead peer in a transfer prints "lost contact", but torchrun notices
    # the death itself within a fraction of a second and may SIGTERM the survivors first (each then says
    # it exits on SIGTERM), its report naming the killed rank as the root cause. Either way: one line
    # per rank, no rank traceback. (The "lost contact" line itself is tried in the stopped-rank case.)
    killed = Job(tmp_path, "killed", 4)
    killed.wait_training()
    os.kill(killed.workers()[1], signal.SIGKILL)
    assert killed.wait(timeout=30) < 30
    assert killed.proc.returncode != 0
    text = killed.err.read_text()
    lines = [line for line in killed.our_lines() if line.startswith("pretrain_gpt.py:")]  # not torchrun's report
    said = [line for line in lines if "lost contact with another rank" in line]
    termed = [line for line in lines if line.startswith("pretrain_gpt.py: received SIGTERM")]
    assert len(said) + len(termed) == len(lines), text  # nothing else: no other error, no traceback
    assert said or re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 .*\(SIGKILL\)", text), text
    assert killed.no_rank_traceback(), killed.err.read_text()

    # SIGTERM to the launcher: every rank exits at once, one line for the job, nothing left running.
    termed = Job(tmp_path, "termed", 2)
    termed.wait_training()
    ranks = termed.workers()
    termed.proc.send_signal(signal.SIGTERM)
    assert termed.wait(timeout=30) < 30
    time.sleep(1)
    assert _alive(ranks) == []
    assert termed.our_lines() == ["pretrain_gpt.py: received SIGTERM: exiting without saving "
                                  "(--exit-signal-handler saves a checkpoint first)"]
    assert termed.no_rank_traceback(), termed.err.read_text()

    # With --exit-signal-handler the ranks agree on an iteration, save it and exit 0.
    saver = Job(tmp_path, "saver", 2, ["--exit-signal-handler", "--save", str(tmp_path / "ckpt")])
    saver.wait_training()
    saver.proc.send_signal(signal.SIGTERM)
    saver.wait(timeout=60)
    latest = (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(latest) > 0
    assert f"training stopped (received SIGTERM): {latest} iterations" in saver.out.read_text()
    assert saver.no_rank_traceback(), saver.err.read_text()

    # A launcher killed outright (no chance to stop its workers): the ranks notice and exit.
    orphaned = Job(tmp_path, "orphaned", 2)
    orphaned.wait_training()
    ranks = orphaned.workers()
    orphaned.proc.kill()
    orphaned.proc.wait()
    deadline = time.time() + 10
    while _alive(ranks) and time.time() < deadline:
        time.sleep(0.2)
    assert _alive(ranks) == []
    assert "its launcher (pid" in orphaned.err.read_text()

    stopped.wait(timeout=max(1.0, 120 - (time.time() - t_stop)))
    assert time.time() - t_stop < 120
    assert stopped.proc.returncode != 0
    lines = stopped.our_lines()
    assert any("rank 0: lost contact with another rank (Timed out waiting 60000ms" in line for line in lines), \
        stopped.err.read_text()


@pytest.mark.slow
def test_sigint_to_a_single_process_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "pretrain_gpt.py"] + FOREVER, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if " iteration " in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert err.strip() == "pretrain_gpt.py: received SIGINT: exiting without saving " \
                          "(--exit-signal-handler saves a checkpoint first)"


def test_exit_duration_stops_and_saves(tmp_path, capsys):
    rc = pretrain_gpt.main(RUN + ["--train-iters", "100000", "--exit-duration-in-mins", "0.002",
                                  "--save", str(tmp_path / "ckpt"), "--log-interval", "1000"])
    out = capsys.readouterr().out
    assert rc == 0
    it = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 0 < it < 100000
    assert f"training stopped (--exit-duration-in-mins 0.002 reached): {it} iterations" in out


def test_end_of_training_evaluates_and_summarises(tmp_path, capsys):
    tb = tmp_path / "tb"
    rc = pretrain_gpt.main(RUN[:RUN.index("--eval-iters")] + [
        "--num-threads", "1", "--train-iters", "5", "--eval-interval", "2", "--eval-iters", "1",
        "--log-interval", "1", "--tensorboard-dir", str(tb), "--save", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.findall(r"validation loss at (iteration \d+|the end of training for val data)", out) == \
        ["iteration 2", "iteration 4", "the end of training for val data"]
    assert re.search(r"\| elapsed: \d+:\d\d:\d\d \| ETA: \d+:\d\d:\d\d \|$", out.splitlines()[
        [i for i, line in enumerate(out.splitlines()) if " iteration        5/" in line][0]])
    summary = out[out.index("training done: "):]
    assert re.match(r"training done: 5 iterations \(5 in all\), 640 tokens in \d+:\d\d:\d\d; final lm loss "
                    r"\d+\.\d{4}, validation lm loss \d+\.\d{4}", summary)
    assert f"checkpoint: {tmp_path / 'ckpt'} (iteration 5)" in summary and f"tensorboard: {tb}" in summary
    last_logged = float(re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)[-1])
    assert f"final lm loss {last_logged:.4f}," in summary  # the last log interval's mean (interval 1 here)


def test_summary_loss_is_the_last_logged_one_when_the_window_is_short(capsys):
    assert pretrain_gpt.main(RUN + ["--train-iters", "3", "--log-interval", "2"]) == 0
    out = capsys.readouterr().out
    last_logged = float(re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)[-1])  # iteration 3: a window of one
    assert f"final lm loss {last_logged:.4f}" in out
