"""Stragglers: a rank slowed 2x is named at the log line with its rank, host and stage; an even run names
no rank. The comparison itself (find_stragglers) is checked on made-up numbers in
tests/unit/test_stragglers.py."""

import logging
import socket
import time
from dataclasses import replace

import pytest

from megalite.data.mock_dataset import MockGPTDataset
from megalite.training import Trainer
from tests.helpers.parity import tiny_config


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
    trainer.train(
        MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, t.seed, t.train_iters * t.global_batch_size), None
    )
    logging.getLogger("megalite").removeHandler(handler)
    return [line for line in handler.lines if line.startswith("straggler:")]


def _config(pp, iters, log_interval, num_layers=2, **model):
    cfg = tiny_config(gbs=16, mbs=2, pp=pp, num_layers=num_layers)
    return cfg.with_(
        model=replace(cfg.model, **model),
        train=replace(cfg.train, train_iters=iters),
        logging=replace(cfg.logging, log_interval=log_interval),
    )


@pytest.mark.slow
def test_a_rank_slowed_2x_is_named_with_its_stage_and_host(run_distributed):
    # pp 2 x dp 2: rank 1 is stage 0 of the second replica
    lines = run_distributed(_train, 4, _config(2, 10, 5), 1, 2.0, pp=2)[-1]
    host = socket.gethostname()
    assert len(lines) == 1, lines  # the second log line names it (slow twice running), and nobody else
    for line in lines:
        assert line.startswith(f"straggler: rank 1 (host {host}, stage 0, dp 1) compute "), line
        ratio = float(line.split(" compute ")[1].split("x")[0])
        assert 1.5 <= ratio <= 4.0, line
        assert "x the median of its stage (" in line and line.endswith(" ms per iteration)")


@pytest.mark.slow
def test_an_even_run_names_no_rank(run_distributed):
    lines = run_distributed(_train, 4, _config(2, 15, 5), -1, 1.0, pp=2)[-1]
    assert lines == []


@pytest.mark.slow
def test_one_replica_per_stage_names_the_slow_stage_and_not_an_even_one(run_distributed):
    # hidden 64, vocabulary 64: the output layer is a small part of the last stage's work (the FLOP count
    # that scales the stages counts it; a tiny CPU model spends time unlike its FLOPs, at scale they agree)
    cfg = _config(2, 10, 5, num_layers=4, hidden_size=64, vocab_size=64)
    lines = run_distributed(_train, 2, cfg, 0, 2.0, pp=2)[-1]
    assert len(lines) == 1 and all(
        line.startswith(f"straggler: rank 0 (host {socket.gethostname()}, stage 0) compute ")
        and "the median of the other stages (per model FLOP)" in line
        for line in lines
    ), lines
    assert run_distributed(_train, 2, cfg, -1, 1.0, pp=2)[-1] == []
