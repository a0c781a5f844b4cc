"""Checkpoints a run can trust, across ranks (issue 21, item 6).

* nodes that do not share ``--save``: rank 1 is given another directory than rank 0 (as a second node
  with a local disk would see it); the first save is refused on every rank, in one line where it is
  printed, and neither directory gets a checkpoint or ``latest``;
* a second run saving into a directory another run holds is refused on every rank (rank 0 says who
  holds it, the others follow quietly); a stale lock is taken over.
The one-process cases (damaged files, full disk, the lock's rules, learning-rate settings) are in
tests/unit/test_ckpt_trust.py.
"""

import os
import socket
from dataclasses import replace

import pytest

from megalite.checkpointing import CheckpointError
from megalite.checkpointing.protocol import MARKER
from megalite.checkpointing.save_lock import LOCK_FILE, acquire_save_lock, release_save_locks
from megalite.config import CheckpointConfig
from megalite.data.mock_dataset import MockGPTDataset
from megalite.training import Trainer
from tests.helpers.parity import tiny_config


def _trainer(ps, save, load=None):
    cfg = tiny_config(gbs=4, mbs=2)
    cfg = cfg.with_(
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=1), train=replace(cfg.train, train_iters=2)
    )
    return Trainer(cfg, ps), cfg


def _save_into(ps, roots):
    """Train with --save roots[rank]: returns (this rank's error line and whether it prints it) or None."""
    trainer, cfg = _trainer(ps, roots[ps.rank])
    ds = MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed, 8)
    try:
        trainer.train(ds, None)
    except CheckpointError as e:
        return str(e), e.report
    return None


@pytest.mark.slow
def test_nodes_that_do_not_share_save_are_refused_at_the_first_save(tmp_path, run_distributed):
    a, b = str(tmp_path / "node0"), str(tmp_path / "node1")
    errors = run_distributed(_save_into, 2, [a, b])
    host = socket.gethostname()
    assert errors == [
        (
            f"rank 1 does not see the files rank 0 wrote into {a}/iter_0000001.tmp: --save {a} must be one directory "
            f"shared by every node (a shared file system); nothing was saved",
            True,
        ),
        (
            f"rank 1 ({host}) does not see the files rank 0 wrote into {b}/iter_0000001.tmp: --save {b} must be one "
            f"directory shared by every node (a shared file system); nothing was saved",
            True,
        ),
    ]
    for root in (a, b):
        assert (
            not any(name.startswith("iter_0000001") and not name.endswith(".tmp") for name in os.listdir(root))
            if os.path.isdir(root)
            else True
        )
        assert not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))
    # one shared directory: the same run saves (and the check costs nothing visible)
    assert run_distributed(_save_into, 2, [a, a]) == [None, None]
    assert open(os.path.join(a, "latest_checkpointed_iteration.txt")).read() == "2"
    saved = os.listdir(os.path.join(a, "iter_0000002"))
    assert "meta.json" in saved and MARKER not in saved  # rank 0's marker is gone from the checkpoint


def _load_refused(ps, root):
    trainer, _ = _trainer(ps, root, load=root)
    try:
        trainer.checkpointer.load()
    except CheckpointError as e:
        return str(e), e.report
    return None


@pytest.mark.slow
def test_a_second_run_is_refused_on_every_rank_and_a_stale_lock_taken_over(tmp_path, run_distributed):
    root = str(tmp_path / "ck")
    acquire_save_lock(root)  # this process is the first run
    try:
        (r0, report0), (r1, report1) = run_distributed(_load_refused, 2, root)
    finally:
        release_save_locks()
    assert report0 and r0.startswith(
        f"--save {root} is in use by another run (host {socket.gethostname()}, pid {os.getpid()}, started "
    )
    assert not report1 and r1 == f"rank 0 could not lock --save {root} (its error is printed above)"
    # the ranks of that run are gone (their lock file stays): the next run takes it over
    assert run_distributed(_save_into, 2, [root, root]) == [None, None]
    assert os.path.exists(os.path.join(root, LOCK_FILE))
