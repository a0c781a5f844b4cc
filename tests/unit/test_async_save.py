"""--async-save in one process: the exact resume in both formats (every torch-format file with its checksum
sidecar), and a process killed while the background thread writes resumes from the previous checkpoint.
(On gloo ranks, and failed writes: tests/distributed/test_async_save.py.)
"""

import glob
import json
import os
import zlib

import pytest

from megalite.checkpointing import iteration_dir, read_latest
from megalite.parallel.state import ParallelState
from tests.helpers.async_save import SAVED, _cfg, _check_resume, _resume


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


_KILLED_MID_WRITE = r"""
import os, signal, sys
import megalite.checkpointing.run_formats as a
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
"""


@pytest.mark.slow
def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """SIGKILL while the background thread writes iteration 4: ``latest`` still names 2, and the next
    run resumes from it, cleans the half-written directory and finishes."""
    import subprocess
    import sys

    from tests.helpers import REPO, TINY_RUN

    root = str(tmp_path / "ckpt")
    args = TINY_RUN + [
        "--eval-iters",
        "0",
        "--num-threads",
        "1",
        "--train-iters",
        "6",
        "--save",
        root,
        "--load",
        root,
        "--save-interval",
        "2",
        "--async-save",
    ]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_WRITE] + args, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert read_latest(root) == 2 and not os.path.exists(iteration_dir(root, 4))
    assert os.path.isdir(iteration_dir(root, 4) + ".tmp")  # the half-written save, never published
    again = subprocess.run(
        [sys.executable, "pretrain_gpt.py"] + args, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "loaded checkpoint" in again.stdout + again.stderr and "iteration 2" in again.stdout + again.stderr
    assert read_latest(root) == 6
    assert not [d for d in os.listdir(root) if d.endswith((".tmp", ".old"))]
