"""In-job restart under torchrun: a rank that dies makes torchrun start the workers again, and the new round
forms its process group and resumes from --load's latest checkpoint, losing only the iterations since it.

The torchrun job (two rounds, ~30 s on 2 cores) runs while an uninterrupted reference of the same run is
trained on the fork-server harness (same ranks, gloo, one thread: the same bits).
"""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.helpers import REPO, TINY_RUN

RUN = TINY_RUN + [
    "--eval-iters",
    "0",
    "--num-threads",
    "1",
    "--log-interval",
    "1",
    "--tensor-model-parallel-size",
    "2",
    "--train-iters",
    "8",
]
LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


def _logged_run(ps, argv):
    """pretrain_gpt.main on one rank of the harness; its stdout (the log, on the logging rank)."""
    os.environ.update(WORLD_SIZE=str(ps.world_size), RANK=str(ps.rank))  # what torchrun would set
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = pretrain_gpt.main(argv)
    return rc, out.getvalue()


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_resumes_from_latest(tmp_path, run_distributed):
    ckpt = str(tmp_path / "ckpt")
    out, err = tmp_path / "job.out", tmp_path / "job.err"
    with open(out, "w") as o, open(err, "w") as e:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "4",
                "--max-restarts",
                "1",
                "pretrain_gpt.py",
                *RUN,
                "--save",
                ckpt,
                "--load",
                ckpt,
                "--save-interval",
                "4",
                "--distributed-timeout-minutes",
                "1",
                "--inject-fault-at-iteration",
                "6",
                "--inject-fault-rank",
                "1",
                "--inject-fault-kind",
                "kill",
            ],
            cwd=REPO,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    try:
        reference = run_distributed(_logged_run, 4, RUN, tp=2)
        assert job.wait(timeout=240) == 0, err.read_text()
    finally:
        if job.poll() is None:
            job.kill()
    ref = dict(LOSS.findall("".join(text for _, text in reference)))
    assert sorted(map(int, ref)) == list(range(1, 9)) and all(rc == 0 for rc, _ in reference)

    log, errors = out.read_text(), err.read_text()
    assert "pretrain_gpt.py: rank 1: --inject-fault-kind kill at iteration 6: killing this rank (SIGKILL)" in errors
    first, _, second = log.partition(
        f"restart 1 of at most 1 (torchrun --max-restarts): resumed from iteration 4 of {ckpt}\n"
    )
    assert second, log
    before, after = LOSS.findall(first), LOSS.findall(second)
    # Round 0 trained 1..5 (the rank died as 6 began; torchrun may stop the logging rank before it prints 5);
    # round 1 loaded iteration 4 and trained 5..8.
    assert [int(i) for i, _ in before] in ([1, 2, 3, 4], [1, 2, 3, 4, 5]) and [int(i) for i, _ in after] == [5, 6, 7, 8]
    assert all(loss == ref[i] for i, loss in before + after), (before, after, ref)
    assert first.count(f"loaded checkpoint {ckpt}/iter_0000004 (iteration 4") == 1
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert not re.search(r"Traceback", errors), errors
