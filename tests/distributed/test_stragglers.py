"""Stragglers: a rank slowed 2x is named at the log line with its rank, host and stage; an even run names
no rank. The comparison itself (find_stragglers) is checked on made-up numbers first."""
import logging
import socket
import time
from dataclasses import replace

import pytest

from megalite.data.mock_dataset import MockGPTDataset
from megalite.stragglers import RankRow, find_stragglers
from megalite.testing.multiprocess import run_distributed
from megalite.training import Trainer
from tests.distributed.common import tiny_config


def _rows(values, pp=1, works=None):
    """RankRows of a tp 1 grid (rank = dp + pp_rank * dp_size) with per-iteration compute ``values`` (s)."""
    dp = len(values) // pp
    return [RankRow(r, r // dp, 0, r % dp, 0, v, works[r // dp] if works else 1.0, (v, 0.0, 0.0), 5)
            for r, v in enumerate(values)]


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
    from megalite.parallel_state import ParallelState
    from megalite.stragglers import StragglerMonitor

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


def _slow_forward(chunk, factor: float) -> None:
    """Make this rank's compute about ``factor`` x: after each chunk forward, sleep in proportion to it
    (forward is about a third of forward + backward; sleeping leaves the shared CPU to the other ranks)."""
    forward = chunk.forward

    def slowed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        time.sleep(3 * (factor - 1) * (time.perf_counter() - t0))
        return out

    chunk.forward = slowed


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(ps, cfg, slow_rank, factor):
    """Trainer.train on mock data with rank ``slow_rank`` slowed ``factor`` x; the logging rank's lines."""
    handler = _Lines()
    logging.getLogger("megalite").addHandler(handler)
    trainer = Trainer(cfg, ps)
    if ps.rank == slow_rank:
        for chunk in trainer.chunks:
            _slow_forward(chunk, factor)
    t = cfg.train
    trainer.train(MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, t.seed,
                                 t.train_iters * t.global_batch_size), None)
    logging.getLogger("megalite").removeHandler(handler)
    return [line for line in handler.lines if line.startswith("straggler:")]


def _config(pp, iters, log_interval, num_layers=2, **model):
    cfg = tiny_config(gbs=16, mbs=2, pp=pp, num_layers=num_layers)
    return cfg.with_(model=replace(cfg.model, **model), train=replace(cfg.train, train_iters=iters),
                     logging=replace(cfg.logging, log_interval=log_interval))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_slowed_2x_is_named_with_its_stage_and_host():
    # pp 2 x dp 2: rank 1 is stage 0 of the second replica
    lines = run_distributed(_train, 4, _config(2, 10, 5), 1, 2.0, pp=2)[-1]
    host = socket.gethostname()
    assert len(lines) == 1, lines  # the second log line names it (slow twice running), and nobody else
    for line in lines:
        assert line.startswith(f"straggler: rank 1 (host {host}, stage 0, dp 1) compute "), line
        ratio = float(line.split(" compute ")[1].split("x")[0])
        assert 1.5 <= ratio <= 4.0, line
        assert "x the median of its stage (" in line and line.endswith(" ms per iteration)")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_even_run_names_no_rank():
    lines = run_distributed(_train, 4, _config(2, 15, 5), -1, 1.0, pp=2)[-1]
    assert lines == []


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_replica_per_stage_names_the_slow_stage_and_not_an_even_one():
    # hidden 64, vocabulary 64: the output layer is a small part of the last stage's work (the FLOP count
    # that scales the stages counts it; a tiny CPU model spends time unlike its FLOPs, at scale they agree)
    cfg = _config(2, 10, 5, num_layers=4, hidden_size=64, vocab_size=64)
    lines = run_distributed(_train, 2, cfg, 0, 2.0, pp=2)[-1]
    assert len(lines) == 1 and all(line.startswith(f"straggler: rank 0 (host {socket.gethostname()}, stage 0) compute ")
                                   and "the median of the other stages (per model FLOP)" in line
                                   for line in lines), lines
    assert run_distributed(_train, 2, cfg, -1, 1.0, pp=2)[-1] == []
