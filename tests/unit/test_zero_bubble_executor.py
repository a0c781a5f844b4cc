"""The executor's B/W split on one process: where the first stage's backward runs.

Nothing waits for the first stage's input gradient (its input is token ids), so
splitting its backward into B and W buys no schedule freedom and only costs the
split's extra passes; its B must compute nothing and its W the whole backward.
"""

import torch

from megalite.parallel.state import ParallelState
from megalite.pipeline.actions import Compute
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.parity import tiny_config


def _grads(trainer: Trainer) -> dict:
    return {n: p.main_grad.clone() for c in trainer.chunks for n, p in c.named_parameters()}


def _trainer_and_batches(schedule: str):
    cfg = tiny_config(gbs=4, mbs=2, schedule=schedule)
    torch.manual_seed(0)
    trainer = Trainer(cfg, ParallelState.single())
    return trainer, MockFeed(trainer, 1).next()


def test_first_stage_backward_runs_whole_in_w_and_matches_a_plain_backward():
    trainer, batches = _trainer_and_batches("zb_h1")
    # Both B's before either W, so the state between them can be observed when F1 asks for its batch.
    actions = [Compute(k, mb, 0) for k, mb in (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1))]
    between = {}

    def get_batch(mb):
        if mb == 1 and not between:
            between.update(_grads(trainer))
        return batches[mb]

    trainer.optimizer.zero_grad(2)
    trainer.executor.run(actions, get_batch, 2)
    assert between and all(float(g.abs().max()) == 0.0 for g in between.values()), (
        "the first stage's B computed gradients: its backward was split although nothing waits for it"
    )
    split = _grads(trainer)

    plain, batches = _trainer_and_batches("1f1b")
    plain.optimizer.zero_grad(2)
    plain.executor.run([Compute(k, mb, 0) for mb in range(2) for k in "FB"], lambda mb: batches[mb], 2)
    expected = _grads(plain)
    assert split.keys() == expected.keys()
    for name, g in expected.items():
        assert float(g.abs().max()) > 0.0, name
        torch.testing.assert_close(split[name], g, rtol=1e-5, atol=1e-7, msg=name)
