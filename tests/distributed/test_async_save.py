"""--async-save: the snapshot blocks training, the files are written in the background, ``latest`` moves
only once every rank has written.

* exact resume: saves every iteration in the background (each next save waits for the one in flight,
  the exit at --exit-interval for the last), then resume: losses equal the uninterrupted run's bit for
  bit, at tp 2 x pp 2 x dp 2 with the distributed optimizer and at dp 2 in the torch format (in one
  process, both formats and a process killed mid-write: tests/unit/test_async_save.py);
* a background write that fails on one rank (a full disk inside torch.distributed.checkpoint's write, or
  the torch format's writer raising) stops the run with one CheckpointError line on every rank, and
  ``latest`` stays at the previous checkpoint; the same failure in a synchronous save likewise.
"""

import errno
import os

import pytest

from megalite.checkpointing import CheckpointError, iteration_dir, read_latest
from tests.helpers.async_save import _cfg, _check_resume, _resume
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, train_losses


@pytest.mark.slow
def test_async_save_resume_is_exact_tp2_pp2_dp2_distributed_optimizer(tmp_path, run_distributed):
    cfg = _cfg(LLAMA_STYLE, tp=2, pp=2, dp=2, use_distributed_optimizer=True)
    _check_resume(run_distributed(_resume, 8, cfg, str(tmp_path), "sharded", tp=2, pp=2))


@pytest.mark.slow
def test_async_torch_format_gathers_distributed_optimizer_shards_in_the_background(tmp_path, run_distributed):
    """dp 2 with the distributed optimizer, torch format: the snapshot copies each rank's own shards and
    the DP gather runs in the background thread (a gloo copy of the DP group); the resume is exact."""
    cfg = _cfg(GPT2_STYLE, dp=2, use_distributed_optimizer=True)
    _check_resume(run_distributed(_resume, 2, cfg, str(tmp_path), "torch"))


# -- a failed write -------------------------------------------------------------------------------
def _fail_second_save_on_rank_1(ps, fmt):
    """Rank 1's second save fails: inside torch.distributed.checkpoint's write (sharded), or the torch
    format's writer raises."""
    if ps.rank != 1:
        return
    import torch.distributed.checkpoint as dcp

    from megalite.checkpointing import run_formats

    calls = [0]

    def disk_full(path):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    if fmt == "torch":
        real = run_formats.write_torch_state

        def write_torch_state(tmp, ps_, state):
            disk_full(tmp)
            real(tmp, ps_, state)

        run_formats.write_torch_state = write_torch_state
    else:

        class FullDisk(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                disk_full(str(self.path))
                return super().write_data(plan, planner)

        dcp.FileSystemWriter = FullDisk


def _failing_run(ps, cfg, root, fmt, background):
    _fail_second_save_on_rank_1(ps, fmt)
    try:
        train_losses(ps, cfg, save=root, fmt=fmt, save_interval=1, async_save=background)
    except CheckpointError as e:
        return {"error": str(e), "latest": read_latest(root), "second": os.path.isdir(iteration_dir(root, 2))}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt,background",
    [("sharded", True), ("torch", True), ("sharded", False)],
    ids=["sharded-async", "torch-async", "sharded-sync"],
)
def test_failed_write_stops_every_rank_and_keeps_latest(tmp_path, fmt, background, run_distributed):
    root = str(tmp_path / "ckpt")
    res = run_distributed(_failing_run, 2, _cfg(dp=2, use_distributed_optimizer=True), root, fmt, background)
    for rank, r in enumerate(res):
        assert r["error"] is not None, f"rank {rank} trained on after a failed save"
        assert "\n" not in r["error"] and root in r["error"] and "iteration 2" in r["error"], r["error"]
        assert r["latest"] == 1 and not r["second"], r
    assert "No space left on device" in res[1]["error"], res[1]["error"]
