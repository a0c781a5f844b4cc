"""--async-save: the snapshot blocks training, the files are written in the background, ``latest`` moves
only once every rank has written.

* exact resume: saves every iteration in the background (each next save waits for the one in flight,
  the exit at --exit-interval for the last), then resume: losses equal the uninterrupted run's bit for
  bit, in both formats (one process) and at tp 2 x pp 2 x dp 2 with the distributed optimizer; every
  torch-format file has its checksum sidecar;
* a background write that fails on one rank (a full disk inside torch.distributed.checkpoint's write, or
  the torch format's writer raising) stops the run with one CheckpointError line on every rank, and
  ``latest`` stays at the previous checkpoint; the same failure in a synchronous save likewise.
"""
import errno
import glob
import json
import os
import zlib
from dataclasses import replace

import pytest

from megalite.checkpointing import CheckpointError, iteration_dir, read_latest
from megalite.parallel_state import ParallelState
from megalite.testing import run_distributed
from tests.distributed.common import GPT2_STYLE, LLAMA_STYLE, tiny_config, train_losses

STEPS = 4
SAVED = STEPS - 2  # the first run saves every iteration and exits here; the resumed run trains two more


def _cfg(style=GPT2_STYLE, tp=1, pp=1, dp=1, **optim):
    cfg = tiny_config(style, gbs=4, mbs=1 if dp * pp > 1 else 2, num_layers=4, tp=tp, pp=pp)
    return cfg.with_(model=replace(cfg.model, hidden_dropout=0.1, attention_dropout=0.1),
                     optim=replace(cfg.optim, **optim), train=replace(cfg.train, train_iters=STEPS))


def _resume(ps, cfg, root, fmt):
    whole = train_losses(ps, cfg)
    from megalite.checkpointing import async_save
    real, threaded = async_save.SaveJob.run, []

    def run(job, background=False):  # the writes really ran in a thread of their own
        threaded.append(background)
        return real(job, background=background)
    async_save.SaveJob.run = run
    try:
        # async saves at 1 and 2 (the exit); the resumed run's last loss follows an update made with the
        # loaded Adam moments, so wrong optimizer state shows
        first = train_losses(ps, cfg, save=root, fmt=fmt, exit_at=SAVED, save_interval=1, async_save=True)
    finally:
        async_save.SaveJob.run = real
    published = [os.path.isdir(iteration_dir(root, it)) for it in range(1, SAVED + 1)]
    second = train_losses(ps, cfg, load=root)
    return {"whole": whole, "resumed": first + second, "last": ps.is_last_stage, "published": published,
            "latest": read_latest(root), "background": threaded}


def _check_resume(results):
    for r in results:
        assert r["published"] == [True] * SAVED and r["latest"] == SAVED, r
        assert r["background"] == [True] * SAVED, r["background"]
        if r["last"]:
            assert len(r["resumed"]) == STEPS and r["resumed"] == r["whole"], (r["resumed"], r["whole"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "torch"])
def test_async_save_resume_is_exact(tmp_path, fmt):
    _check_resume([_resume(ParallelState.single(), _cfg(), str(tmp_path), fmt)])
    files = glob.glob(str(tmp_path / "iter_*" / "mp_rank_00" / "model_optim_rng.pt"))
    assert len(files) == (SAVED if fmt == "torch" else 0)
    for path in files:  # the torch format's checksum sidecar: the whole file's crc32 and size
        with open(path, "rb") as f:
            data = f.read()
        assert json.load(open(path + ".crc32.json")) == {"crc32": zlib.crc32(data), "bytes": len(data)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_async_save_resume_is_exact_tp2_pp2_dp2_distributed_optimizer(tmp_path):
    cfg = _cfg(LLAMA_STYLE, tp=2, pp=2, dp=2, use_distributed_optimizer=True)
    _check_resume(run_distributed(_resume, 8, cfg, str(tmp_path), "sharded", tp=2, pp=2))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_async_torch_format_gathers_distributed_optimizer_shards_in_the_background(tmp_path):
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

    from megalite.checkpointing import async_save

    calls = [0]

    def disk_full(path):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    if fmt == "torch":
        real = async_save.write_torch_state

        def write_torch_state(tmp, ps_, state):
            disk_full(tmp)
            real(tmp, ps_, state)
        async_save.write_torch_state = write_torch_state
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
        return {"error": str(e), "latest": read_latest(root),
                "second": os.path.isdir(iteration_dir(root, 2))}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt,background", [("sharded", True), ("torch", True), ("sharded", False)],
                         ids=["sharded-async", "torch-async", "sharded-sync"])
def test_failed_write_stops_every_rank_and_keeps_latest(tmp_path, fmt, background):
    root = str(tmp_path / "ckpt")
    res = run_distributed(_failing_run, 2, _cfg(dp=2, use_distributed_optimizer=True), root, fmt, background)
    for rank, r in enumerate(res):
        assert r["error"] is not None, f"rank {rank} trained on after a failed save"
        assert "\n" not in r["error"] and root in r["error"] and "iteration 2" in r["error"], r["error"]
        assert r["latest"] == 1 and not r["second"], r
    assert "No space left on device" in res[1]["error"], res[1]["error"]


_KILLED_MID_WRITE = r'''
import os, signal, sys
import megalite.checkpointing.async_save as a
real = a.write_sharded

def half_then_die(tmp, *args, **kwargs):
    real(tmp, *args, **kwargs)
    if tmp.endswith("iter_0000004.tmp"):  # the files are half-way to published: truncate one, then die
        name = sorted(f for f in os.listdir(tmp) if f.endswith(".distcp"))[0]
        with open(os.path.join(tmp, name), "r+b") as f:
            f.truncate(100)
        os.kill(os.getpid(), signal.SIGKILL)
a.write_sharded = half_then_die
import pretrain_gpt
sys.exit(pretrain_gpt.main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """SIGKILL while the background thread writes iteration 4: ``latest`` still names 2, and the next
    run resumes from it, cleans the half-written directory and finishes."""
    import subprocess
    import sys
    from tests.conftest import REPO, TINY_RUN
    root = str(tmp_path / "ckpt")
    args = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1", "--train-iters", "6", "--save", root,
                       "--load", root, "--save-interval", "2", "--async-save"]
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE] + args, cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert read_latest(root) == 2 and not os.path.exists(iteration_dir(root, 4))
    assert os.path.isdir(iteration_dir(root, 4) + ".tmp")  # the half-written save, never published
    again = subprocess.run([sys.executable, "pretrain_gpt.py"] + args, cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "loaded checkpoint" in again.stdout + again.stderr and "iteration 2" in again.stdout + again.stderr
    assert read_latest(root) == 6
    assert not [d for d in os.listdir(root) if d.endswith((".tmp", ".old"))]
