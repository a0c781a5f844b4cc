"""A Trainer fed with mock data: the few lines every parity test and benchmark needs.

``MockFeed`` reads the same deterministic samples ``--mock-data`` trains on (the same global
batch for a seed and iteration whatever the layout), as this rank's micro-batches; ranks
that hold neither the first nor the last stage read nothing and get ``[None] * m``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megalite.config import Config
from megalite.data.batches import MicroBatches
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel.state import ParallelState
from megalite.training.trainer import Trainer


class MockFeed:
    """Global batches of mock samples for ``trainer``: ``global_batches`` of them from sample ``consumed``."""

    def __init__(
        self, trainer: Trainer, global_batches: int, consumed: int = 0, seed: Optional[int] = None, dataset=None
    ):
        cfg = trainer.cfg
        t = cfg.train
        self.m = trainer.m
        if dataset is None:
            dataset = MockGPTDataset(
                cfg.model.seq_length,
                cfg.model.vocab_size,
                t.seed if seed is None else seed,
                consumed + global_batches * t.global_batch_size,
            )
        self.data = (
            MicroBatches(dataset, consumed, t.micro_batch_size, trainer.m, trainer.ps, sequence=trainer.sequence)
            if trainer.needs_data
            else None
        )

    def next(self) -> List[Optional[Dict[str, torch.Tensor]]]:
        """The next global batch: this rank's m micro-batch dicts (or m Nones where no data is read)."""
        return self.data.next() if self.data is not None else [None] * self.m


def train_mock(cfg: Config, ps: ParallelState, steps: int, dataset=None) -> Tuple[Trainer, List, List]:
    """Build a Trainer and run ``steps`` iterations on mock data (or ``dataset``); returns
    (trainer, losses, grad norms), losses None off the last stage."""
    trainer = Trainer(cfg, ps)
    feed = MockFeed(trainer, steps, dataset=dataset)
    losses, norms = [], []
    for _ in range(steps):
        out = trainer.train_step(feed.next())
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    return trainer, losses, norms
