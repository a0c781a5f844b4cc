"""Why a job stopped, said once (megalite.observability.stop_line), in one process: ranks that share a store
(torchrun's, here an in-memory one) write the line once whichever calls first, a rank that only follows
writes nothing, and without a store the chosen rank writes it. The torchrun jobs (a slow rank 0, a damaged
shard read by two replicas): tests/distributed/test_launch.py."""

from datetime import timedelta

import torch.distributed as dist

from megalite.observability.stop_line import SAID, say_stop


def _shared():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    return store


def test_ranks_sharing_a_store_write_the_line_once_whichever_comes_first(capsys):
    store = _shared()
    # rank 1 gets there first; rank 0 (the slow one) and rank 2, which only follows, write nothing
    assert say_stop("job: error: bad flag", store=lambda: store) is True
    assert say_stop("job: error: bad flag", chosen=False, store=lambda: store) is False
    assert say_stop("job: error: bad flag", wait_s=1, store=lambda: store) is False
    assert say_stop("job: error: another rank failed", knows=False, wait_s=1, store=lambda: store) is False
    assert capsys.readouterr().err == "job: error: bad flag\n"
    assert store.get(SAID) == b"1"


def test_a_follower_writes_nothing_and_waits_a_bounded_time_for_the_line(capsys):
    assert say_stop("job: error: x", knows=False, wait_s=0.2, store=_shared) is False
    assert capsys.readouterr().err == ""


def test_without_a_store_the_chosen_rank_writes(capsys):
    assert say_stop("job: error: bad flag", chosen=False, store=lambda: None) is False
    assert say_stop("job: error: bad flag", knows=False, store=lambda: None) is False
    assert say_stop("job: error: bad flag", store=lambda: None) is True
    assert capsys.readouterr().err == "job: error: bad flag\n"


def test_a_failing_store_does_not_silence_the_line(capsys):
    class Broken:
        def add(self, key, value):
            raise RuntimeError("connection reset")

    assert say_stop("job: error: bad flag", store=Broken) is True
    assert capsys.readouterr().err == "job: error: bad flag\n"
