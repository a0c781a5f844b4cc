"""A hung job names the rank it waits for: a stopped rank, a killed rank, a rank whose schedule skips a send
and a rank in an endless computation, each in the one printed diagnosis and again by tools/diagnose.py from the
files the ranks wrote. SIGUSR1 to every rank of a healthy job prints one diagnosis and the job goes on. Four pp 2
torchrun jobs at once (the killed rank's has dp 2 as well) and a tp 2 x cp 2 one whose rank 1 hangs inside a layer,
named with the tensor- and context-parallel collectives its peers wait in (issue 33),
--distributed-timeout-minutes 0.2 (about 1.5 min on 2 loaded cores).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO

TIMEOUT = ["--distributed-timeout-minutes", "0.2"]  # a slow start on a loaded machine must not time out


def _start(torchrun_job, tmp_path, name, extra=(), nproc=2):
    job = torchrun_job(name, nproc, [*TIMEOUT, "--debug-dir", str(tmp_path / name), *extra])
    job.debug = tmp_path / name
    return job


def _printed(job, healthy=False):
    return [
        line[len("hang diagnosis: ") :]
        for line in job.err.read_text().splitlines()
        if line.startswith("hang diagnosis: ") and line.startswith("hang diagnosis: no hang") == healthy
    ]


def _wait_for_diagnosis(job, timeout=90):
    """Until the job ends (or printed its diagnosis and wrote rank 0's file: a stopped rank keeps torchrun
    waiting 30 s before it kills it, so the test ends the job itself)."""
    deadline = time.time() + timeout
    while job.proc.poll() is None and time.time() < deadline:
        if _printed(job) and (job.debug / "flight_recorder_rank_0.json").exists():
            time.sleep(1)  # the last lines of the survivors
            break
        time.sleep(0.5)
    if job.proc.poll() is None:
        workers = job.workers()  # torchrun starts them in sessions of their own: killpg would miss them
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        _kill(workers)


def _kill(pids):
    """SIGKILL reaches a stopped process too; without it a SIGSTOPped rank outlives the test, stopped forever."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _offline(job):
    out = subprocess.run(
        [sys.executable, "tools/diagnose.py", str(job.debug)], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[0][len("diagnosis: ") :]


@pytest.mark.slow
def test_hung_stopped_killed_and_deadlocked_ranks_are_named(tmp_path, torchrun_job):
    stopped, killed = _start(torchrun_job, tmp_path, "stopped"), _start(torchrun_job, tmp_path, "killed", nproc=4)
    skip = _start(
        torchrun_job,
        tmp_path,
        "skip",
        ["--inject-fault-at-iteration", "3", "--inject-fault-rank", "0", "--inject-fault-kind", "skip-send"],
    )
    hang = _start(
        torchrun_job,
        tmp_path,
        "hang",
        ["--inject-fault-at-iteration", "3", "--inject-fault-rank", "1", "--inject-fault-kind", "hang"],
    )
    # the hang inside a layer at tp 2 x cp 2: its tp peer waits in the layer's all-reduce, its cp peer in the ring
    layer = _start(
        torchrun_job,
        tmp_path,
        "layer",
        ["--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
        + ["--attention-dropout", "0", "--inject-fault-at-iteration", "3", "--inject-fault-rank", "1"]
        + ["--inject-fault-kind", "hang"],
        nproc=4,
    )
    victims = []
    for job, sig in ((stopped, signal.SIGSTOP), (killed, signal.SIGKILL)):
        job.wait_training()
        if job is killed:  # first a look inside the healthy job: every rank asked at once, one answer
            for pid in job.workers():
                os.kill(pid, signal.SIGUSR1)
            deadline = time.time() + 30
            while not (_printed(job, healthy=True) and len(list(job.debug.glob("*.json"))) == 4):
                assert time.time() < deadline, job.err.read_text()
                time.sleep(0.2)
            assert job.proc.poll() is None
        victims.append(sorted(job.workers())[1])  # rank 1 (torchrun starts the ranks in order)
        os.kill(victims[-1], sig)
    try:
        for job in (stopped, killed, skip, hang, layer):
            _wait_for_diagnosis(job)
    finally:
        _kill(victims[:1])  # the stopped rank, whatever happened to its job

    # who waits on what depends on where rank 1 was stopped; with dp 2 every survivor may already be behind it
    waits = (
        r"(; ranks? [\d, ]+ waits? for it in (recv from rank 1 \([FB] micro-batch \d\)|\S+ #\d+ \(\w+ group\))"
        r"|; no rank waits for it yet).*"
    )
    usr1 = _printed(killed, healthy=True)
    assert len(usr1) == 1 and re.fullmatch(
        r"no hang: all 4 ranks answered and none is waiting \(rank 0 .*\)", usr1[0]
    ), killed.err.read_text()
    for job, who, live, offline in (
        (stopped, r"rank 1 \(stage 1, dp 0\)", "its process is stopped", "it left no flight record"),
        (
            killed,
            r"rank 1 \(stage 0, dp 1\)",
            "its process has exited",
            r"its last record, '(SIGUSR1|request \d+)', predates the others",
        ),
    ):  # its file from the SIGUSR1 look
        text = job.err.read_text()
        printed = _printed(job)
        assert len(printed) <= 1, text  # once per job
        # torchrun may SIGTERM rank 0 before it prints (the dead rank's case): then the files still say it
        if printed or job is stopped:
            assert re.fullmatch(rf"{who} stopped progressing: it does not answer \({live}\)" + waits, printed[0]), text
        assert re.fullmatch(rf"{who} stopped progressing: it does not answer \({offline}\)" + waits, _offline(job)), (
            text
        )
        assert job.no_rank_traceback(), text

    deadlock = (
        "rank 0 (stage 0, dp 0) deadlocked the job through its schedule: it has no send of F micro-batch 0 "
        "to rank 1, which rank 1's schedule receives in the same step; rank 0 waits in recv from rank 1 "
        "(B micro-batch 3), rank 1 in recv from rank 0 (F micro-batch 3)"
    )
    assert _printed(skip) == [deadlock], skip.err.read_text()
    assert _offline(skip) == deadlock

    busy = re.compile(
        r"rank 1 \(stage 1, dp 0\) stopped progressing in F micro-batch 0 chunk 0 \(busy in it for \d+ "
        r"s and still answering: a long or endless computation or loop\); rank 0 waits for it in recv "
        r"from rank 1 \(B micro-batch 0\)"
    )
    assert len(_printed(hang)) == 1 and busy.fullmatch(_printed(hang)[0]), hang.err.read_text()
    assert busy.fullmatch(_offline(hang))
    inside = re.compile(
        r"rank 1 \(stage 0, dp 0, tp 1, cp 0\) stopped progressing in F micro-batch 0 chunk 0 \(busy in it for \d+ "
        r"s and still answering: a long or endless computation or loop\); rank 0 waits for it in all_reduce #\d+ "
        r"\(tp group\), rank 3 in ring_exchange #\d+ \(cp group\); behind them rank 2 in all_reduce #\d+ \(tp group\)"
    )
    assert len(_printed(layer)) == 1 and inside.fullmatch(_printed(layer)[0]), layer.err.read_text()
    assert inside.fullmatch(_offline(layer))
    for job in (skip, hang, layer):
        assert job.no_rank_traceback(), job.err.read_text()
