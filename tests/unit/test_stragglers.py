"""Stragglers in one process: find_stragglers on made-up numbers (the slow replica of a stage, stages
compared per unit of work) and the monitor naming a rank slow at two log lines running. (Real ranks slowed
2x: tests/distributed/test_stragglers.py.)"""

import logging

import pytest

from megalite.observability.stragglers import RankRow, find_stragglers


def _rows(values, pp=1, works=None):
    """RankRows of a tp 1 grid (rank = dp + pp_rank * dp_size) with per-iteration compute ``values`` (s)."""
    dp = len(values) // pp
    return [
        RankRow(r, r // dp, 0, r % dp, 0, v, works[r // dp] if works else 1.0, (v, 0.0, 0.0), 5)
        for r, v in enumerate(values)
    ]


def test_the_slow_replica_of_a_stage_is_named_and_noise_is_not():
    (s,) = find_stragglers(_rows([0.010, 0.011, 0.021, 0.0105]), 1.5)
    assert s.row.rank == 2 and s.basis == "its stage" and s.ratio == pytest.approx(0.021 / 0.0105)
    assert find_stragglers(_rows([0.010, 0.013, 0.009, 0.0115]), 1.5) == []  # 30% spread: nobody
    # two replicas compare with each other (a median of two would hide a 2x rank)
    assert [s.row.rank for s in find_stragglers(_rows([0.010, 0.020]), 1.5)] == [1]
    # stages are compared within themselves: stage 1 is slower than stage 0 by design, not named
    assert [s.row.rank for s in find_stragglers(_rows([0.010, 0.010, 0.030, 0.061], pp=2), 1.5)] == [3]


def test_one_replica_per_stage_compares_stages_per_unit_of_work():
    # stage 1 holds twice the work: 20 ms there is on time, 40 ms is 2x
    assert find_stragglers(_rows([0.010, 0.020, 0.010], pp=3, works=[1.0, 2.0, 1.0]), 1.5) == []
    (s,) = find_stragglers(_rows([0.010, 0.040, 0.010], pp=3, works=[1.0, 2.0, 1.0]), 1.5)
    assert (s.row.rank, s.basis) == (1, "the other stages (per model FLOP)")
    assert s.ratio == pytest.approx(2.0)


def test_a_rank_is_named_when_slow_at_two_log_lines_running(caplog):
    from megalite.observability.stragglers import StragglerMonitor
    from megalite.parallel.state import ParallelState

    monitor = StragglerMonitor(1.5, ParallelState.single(), 1.0, 5, 100)
    slow, even = _rows([0.010, 0.010, 0.021, 0.0105]), _rows([0.010, 0.010, 0.0105, 0.0105])
    with caplog.at_level(logging.WARNING, logger="megalite"):
        for rows in (slow, even, slow, slow, slow):
            monitor.report(rows)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("straggler: rank 2 (host ") for line in lines)
    spread = monitor.report(slow)
    assert spread["straggler/compute-max"] == pytest.approx(21.0)
    assert spread["straggler/compute-median"] == pytest.approx(10.25)
    assert spread["straggler/max-slowdown"] == pytest.approx(2.1)  # 21 ms against 10 ms
