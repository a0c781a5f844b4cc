"""Stragglers in one process: find_stragglers on made-up numbers (the slow replica of a stage, stages compared
per unit of work, a stall on the last stage named there and not on the first stage that waits for it, noise
and "2x of almost nothing" silent), the monitor's split of an iteration into own time and waits, and the
monitor naming a rank over the line at two log lines running. (Real ranks slowed 2x or stopped in cycles:
tests/distributed/test_stragglers.py.)"""

import logging

import pytest

from megalite.observability import stragglers
from megalite.observability.stragglers import RankRow, StragglerMonitor, find_stragglers
from megalite.parallel.state import ParallelState


def _rows(own, pp=1, works=None, waits=None):
    """RankRows of a tp 1 grid (rank = dp + pp_rank * dp_size) with own time per iteration ``own`` (s); by
    default a rank waits for the slowest one in the list (every rank's iteration takes the same time)."""
    dp = len(own) // pp
    waits = waits or [max(own) - v for v in own]
    return [
        RankRow(r, r // dp, 0, r % dp, 0, v, waits[r], works[r // dp] if works else 1.0, 5) for r, v in enumerate(own)
    ]


def _named(rows, threshold=1.5):
    return [s.row.rank for s in find_stragglers(rows, threshold)]


def test_the_slow_replica_of_a_stage_is_named_and_noise_is_not():
    (s,) = find_stragglers(_rows([0.010, 0.011, 0.021, 0.0105]), 1.5)
    assert s.row.rank == 2 and s.basis == "its stage" and s.ratio == pytest.approx(0.021 / 0.0105)
    assert s.held == pytest.approx(0.0105)  # the median of its peers' waits: 11, 10 and 10.5 ms
    assert _named(_rows([0.010, 0.013, 0.009, 0.0115])) == []  # 30% spread: nobody
    # two replicas compare with each other (a median of two would hide a 2x rank)
    assert _named(_rows([0.010, 0.020])) == [1]
    # stages are compared within themselves: stage 1 is slower than stage 0 by design, not named
    assert _named(_rows([0.010, 0.010, 0.030, 0.061], pp=2)) == [3]


def test_one_replica_per_stage_compares_stages_as_they_are_and_per_unit_of_work():
    # stage 1 holds twice the work: 20 ms there is on time, 40 ms is 2x
    assert _named(_rows([0.010, 0.020, 0.010], pp=3, works=[1.0, 2.0, 1.0])) == []
    (s,) = find_stragglers(_rows([0.010, 0.040, 0.010], pp=3, works=[1.0, 2.0, 1.0]), 1.5)
    assert (s.row.rank, s.basis, s.ratio) == (1, "the other stages (per model FLOP)", pytest.approx(2.0))
    # stage 0 holds half the work of stage 1 (FLOPs say) but takes as long: 2x per FLOP, yet no longer than
    # the stage after it, as a small model's cheap layers do (the outside probe's healthy pp 2 run)
    assert _named(_rows([0.020, 0.020], pp=2, works=[1.0, 2.0], waits=[0.010, 0.012])) == []
    # taking 2x as long as the others and 4x per FLOP: 2x, against the others as they are
    (s,) = find_stragglers(_rows([0.040, 0.020], pp=2, works=[1.0, 2.0]), 1.5)
    assert (s.row.rank, s.basis, s.ratio) == (0, "the other stages", pytest.approx(2.0))


def test_a_rank_is_named_only_when_its_peers_wait_on_it_a_real_share_of_the_step():
    # rank 2's own time is 2x, but it waits as long as its peers: they do not wait on it
    assert _named(_rows([0.010, 0.010, 0.020, 0.010], waits=[0.030] * 4)) == []
    # 2x of almost nothing: 1 ms against 0.5 ms of a 30 ms iteration that is mostly waiting on other stages
    assert _named(_rows([0.0005, 0.0005, 0.001, 0.0005], waits=[0.0295, 0.0295, 0.029, 0.0295])) == []
    # a stalled rank: own time 2.5x, the others wait for it
    (s,) = find_stragglers(_rows([0.100, 0.100, 0.250, 0.100]), 1.5)
    assert (s.row.rank, s.held) == (2, pytest.approx(0.150))


def test_a_stage_slow_per_model_flop_that_waits_on_the_others_is_not_named():
    # the outside probe's healthy pp 2 run: stage 0 looks 2.3x per model FLOP (a tiny model's time is not its
    # FLOPs) but it waits for stage 1 more than stage 1 waits for it: it makes nobody wait
    assert _named(_rows([0.023, 0.010], pp=2, waits=[0.030, 0.043])) == [0]
    assert _named(_rows([0.023, 0.010], pp=2, waits=[0.030, 0.005])) == []


def test_a_stall_on_the_last_stage_names_that_stage_and_not_the_first_stage_waiting_for_it():
    # pp 2 x dp 2 (rank = dp + 2 * pp): rank 3, the last stage of the second replica, is stopped 60 ms per
    # iteration; rank 1, the first stage of its pipeline, spends the stall waiting for its gradients (late to
    # the collectives it shares with rank 0 as much as rank 3 is to rank 2's, but not on its own time)
    rows = _rows([0.030, 0.030, 0.030, 0.090], pp=2, waits=[0.080, 0.080, 0.080, 0.020])
    rows[1].wait = 0.080 + 0.060  # the victim's extra wait
    rows[0].wait = rows[2].wait = 0.080 + 0.060  # its replicas wait in the gradient reduction
    assert _named(rows) == [3]


def test_a_slow_tensor_parallel_group_is_named_against_the_other_stages_and_a_lone_stage_by_its_tp_peers():
    # pp 2 x tp 2, one replica (rank = tp + 2 * pp): stage 1's whole tp group is on a slow node, 2x; each of
    # its ranks is compared with the same tp rank of stage 0, not with its tp peer (as slow as itself)
    rows = [RankRow(r, r // 2, r % 2, 0, 0, 0.020 if r >= 2 else 0.010, 0.0, 1.0, 5) for r in range(4)]
    for r in rows:
        r.wait = 0.020 - r.own
    assert sorted(_named(rows)) == [2, 3]
    # one stage, tp 2: the shards do the same work, the slow one is named against its peer
    rows = [RankRow(r, 0, r, 0, 0, own, wait, 1.0, 5) for r, own, wait in ((0, 0.010, 0.011), (1, 0.021, 0.0))]
    assert _named(rows) == [1]


def test_the_monitor_splits_each_iteration_into_own_time_and_waits(monkeypatch):
    ps = ParallelState.single()
    monitor = StragglerMonitor(1.5, ps, 1.0, 5, 100)
    monitor.enabled = True  # one process: the split is the same as on any rank
    clock = iter([0.0, 1.0, 1.5, 2.5])  # pause(), then the end of iterations 1, 2 and 3
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: next(clock))
    monitor.pause()
    monitor.record([], 1)  # the first iteration (warm-up) is not counted
    ps.recorder.waited += 0.2
    monitor.record([], 2)
    monitor.record([], 3)
    assert (monitor.n, monitor.own, monitor.wait) == (2, pytest.approx(0.3 + 1.0), pytest.approx(0.2))


def test_a_verdict_waits_for_enough_iterations(monkeypatch):
    # --log-interval 1: a log line after each iteration, each one noisy alone; the interval goes on until it
    # holds _MIN_ITERATIONS iterations on every rank
    ps = ParallelState.single()
    monitor = StragglerMonitor(1.5, ps, 1.0, 1, 100)
    monitor.enabled = True

    def all_gather(parts, mine, group=None):  # one rank: its own row
        parts[0].copy_(mine)

    monkeypatch.setattr(stragglers.dist, "all_gather", all_gather)
    verdicts = []
    for iteration in range(1, 12):
        monitor.record([], iteration)
        verdicts.append(monitor.check())
    assert [v is not None for v in verdicts] == [False] * 5 + [True] + [False] * 4 + [True]
    assert verdicts[5][0].n == stragglers._MIN_ITERATIONS  # iterations 2 to 6 (the first is warm-up)


def test_the_recorder_counts_the_seconds_spent_in_ended_waits():
    ps = ParallelState.single()
    before = ps.recorder.waited
    e = ps.recorder.record("wait", on="coll", group="dp", seq=1)
    busy = ps.recorder.record("F", mb=0, chunk=0, run=1)
    ps.recorder.done(busy)  # not a wait: not counted
    ps.recorder.done(e)
    (ev,) = [x for x in ps.recorder.events() if x["id"] == e]
    assert ps.recorder.waited - before == pytest.approx(ev["end"] - ev["start"])


def test_a_rank_is_named_when_slow_at_two_log_lines_running(caplog):
    monitor = StragglerMonitor(1.5, ParallelState.single(), 1.0, 5, 100)
    slow, even = _rows([0.010, 0.010, 0.021, 0.0105]), _rows([0.010, 0.010, 0.0105, 0.0105])
    with caplog.at_level(logging.WARNING, logger="megalite"):
        for rows in (slow, even, slow, slow, slow):
            monitor.report(rows)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("straggler: rank 2 (host ") for line in lines)
    assert (
        "makes the others wait: 2.1x the median of its stage (own time 21.0 ms vs 10.0 ms per iteration; " in lines[0]
    )
    spread = monitor.report(slow)
    assert spread["straggler/compute-max"] == pytest.approx(21.0)
    assert spread["straggler/compute-median"] == pytest.approx(10.25)
    assert spread["straggler/max-slowdown"] == pytest.approx(2.1)  # 21 ms against its peers' median, 10 ms
