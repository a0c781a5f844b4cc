"""Faults end the job fast and cleanly: a killed rank, a stopped (hung) rank, signals, a dead launcher,
a time limit. Real torchrun jobs; the slow one (a stopped rank waits out a 15-second timeout, then
torchrun's grace period) runs while the others are tried, so the file costs about a minute. (The
one-process cases, a time limit among them: tests/unit/test_faults.py.)
"""

import os
import re
import signal
import time

import pytest


def _alive(pids):
    return [
        p
        for p in pids
        if os.path.exists(f"/proc/{p}")
        and "pretrain_gpt" in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
    ]


@pytest.mark.slow
def test_killed_stopped_and_signalled_ranks_end_the_job(tmp_path, torchrun_job):
    # A stopped rank: the other waits out --distributed-timeout-minutes 0.25, then the job ends (torchrun
    # needs up to 30 s more to SIGKILL the stopped one, which cannot act on SIGTERM).
    stopped = torchrun_job("stopped", 2, ["--distributed-timeout-minutes", "0.25"])
    stopped.wait_training()
    os.kill(stopped.workers()[-1], signal.SIGSTOP)
    t_stop = time.time()

    # A killed rank out of 4 ends the job within seconds, and the job says why, once. Who speaks first is
    # a race: the first survivor that meets the dead peer in a transfer says "lost contact" (the others
    # wait for its line and stay silent), but torchrun notices the death itself within a fraction of a
    # second and may SIGTERM the survivors first (rank 0 then says it exits on SIGTERM, unless the lost
    # contact was said already), its report naming the killed rank as the root cause. At most one line of
    # each kind (both only when the SIGTERM lands while the line is being written), no rank traceback.
    # (The "lost contact" line itself is tried in the stopped-rank case.)
    killed = torchrun_job("killed", 4)
    killed.wait_training()
    os.kill(killed.workers()[1], signal.SIGKILL)
    assert killed.wait(timeout=30) < 30
    assert killed.proc.returncode != 0
    text = killed.err.read_text()
    lines = [line for line in killed.our_lines() if line.startswith("pretrain_gpt.py:")]  # not torchrun's report
    said = [line for line in lines if "lost contact with another rank" in line]
    termed = [line for line in lines if line.startswith("pretrain_gpt.py: received SIGTERM")]
    assert len(said) + len(termed) == len(lines), text  # nothing else: no other error, no traceback
    assert len(said) <= 1 and len(termed) <= 1, text  # said once for the job, not once per rank
    assert said or re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 .*\(SIGKILL\)", text), text
    assert killed.no_rank_traceback(), killed.err.read_text()

    # SIGTERM to the launcher: every rank exits at once, one line for the job, nothing left running.
    termed = torchrun_job("termed", 2)
    termed.wait_training()
    ranks = termed.workers()
    termed.proc.send_signal(signal.SIGTERM)
    assert termed.wait(timeout=30) < 30
    time.sleep(1)
    assert _alive(ranks) == []
    assert termed.our_lines() == [
        "pretrain_gpt.py: received SIGTERM: exiting without saving (--exit-signal-handler saves a checkpoint first)"
    ]
    assert termed.no_rank_traceback(), termed.err.read_text()

    # With --exit-signal-handler the ranks agree on an iteration, save it and exit 0.
    saver = torchrun_job("saver", 2, ["--exit-signal-handler", "--save", str(tmp_path / "ckpt")])
    saver.wait_training()
    saver.proc.send_signal(signal.SIGTERM)
    saver.wait(timeout=60)
    latest = (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(latest) > 0
    assert f"training stopped (received SIGTERM): {latest} iterations" in saver.out.read_text()
    assert saver.no_rank_traceback(), saver.err.read_text()

    # A launcher killed outright (no chance to stop its workers): the ranks notice and exit.
    orphaned = torchrun_job("orphaned", 2)
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
    assert any("rank 0: lost contact with another rank (Timed out waiting 15000ms" in line for line in lines), (
        stopped.err.read_text()
    )
