"""Evaluation during and after training, as Megatron does it.

Every ``--eval-interval`` iterations the run reads the next ``--eval-iters`` global batches of
the validation split (each evaluation goes on where the last stopped; a resumed run skips what
the evaluations before its checkpoint read); a completed run evaluates once more at the end
when its last iteration was off the interval, then once on the test split, from its start.
The forward-only schedule runs on the training executor, so every layout evaluates alike.
"""

from __future__ import annotations

import logging
from typing import Callable, List, NamedTuple, Optional

import torch

from megalite.config import Config
from megalite.data.batches import MicroBatches, sequence_options
from megalite.data.loading import validation_start
from megalite.parallel.state import ParallelState
from megalite.training.stops import check_tokens

logger = logging.getLogger("megalite")


class EvalResult(NamedTuple):
    split: str  # "validation" or "test"
    loss: Optional[float]  # mean lm loss (None off the logging stage)
    at_end: bool  # the end-of-training evaluation


class Evaluator:
    """Knows when to evaluate and runs the forward-only schedule over the split's next batches.

    ``run_forward(batches) -> losses`` runs one global batch forward only and returns this
    rank's micro-batch losses; ``reduce(losses)`` turns them into the logged loss.
    """

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        chunks: List[torch.nn.Module],
        m: int,
        needs_data: bool,
        run_forward: Callable[[list], list],
        reduce: Callable[[list], Optional[float]],
    ):
        self.cfg, self.ps, self.chunks, self.m, self.needs_data = cfg, ps, chunks, m, needs_data
        self.run_forward, self.reduce = run_forward, reduce
        t = cfg.train
        self.enabled = t.eval_iters > 0 and t.eval_interval > 0
        self.evaluated_at: Optional[int] = None
        self.sequence = sequence_options(cfg, ps)  # packed documents / CP chunks, as in training

    def due(self, iteration: int) -> bool:
        """An evaluation follows this iteration (every --eval-interval)."""
        return self.enabled and iteration % self.cfg.train.eval_interval == 0

    def warn_if_missing(self, valid_ds) -> None:
        if valid_ds is None and self.enabled and self.ps.is_logging_rank:
            logger.warning("no validation samples (see --split / --valid-data-path): validation is skipped")

    @torch.no_grad()
    def evaluate(self, data: Optional[MicroBatches], iteration: int) -> Optional[float]:
        """Mean loss over ``eval_iters`` global batches read from ``data`` (None where no data is read)."""
        for c in self.chunks:
            c.eval()
        losses = []
        for _ in range(self.cfg.train.eval_iters):
            batches = data.next() if data is not None else [None] * self.m
            where = (
                f"iteration {iteration + 1}"
                if data is not None and data.name == "train"
                else f"evaluation at iteration {iteration}"
            )  # tools/evaluate.py --split-name train reads training batches
            check_tokens(data, batches, self.cfg.model.vocab_size, self.ps, where)
            losses += self.run_forward(batches)
        return self.reduce(losses)

    def validate(self, ds, iteration: int, at_end: bool = False) -> Optional[EvalResult]:
        """Evaluate the validation split where the evaluation logged at ``iteration`` reads it."""
        self.evaluated_at = iteration
        if ds is None:  # the same on every rank: no such split, nothing to run
            return None
        start = validation_start(iteration, self.cfg.train, len(ds))
        return EvalResult("validation", self.evaluate(self._batches(ds, start, "validation"), iteration), at_end)

    def test(self, ds, iteration: int) -> Optional[EvalResult]:
        """Evaluate the test split once, from its start (the end of training)."""
        if ds is None:
            return None
        return EvalResult("test", self.evaluate(self._batches(ds, 0, "test"), iteration), True)

    def _batches(self, ds, start: int, name: str) -> Optional[MicroBatches]:
        t = self.cfg.train
        return (
            MicroBatches(
                ds,
                start,
                t.micro_batch_size,
                self.m,
                self.ps,
                self.cfg.data.num_workers,
                name=name,
                sequence=self.sequence,
            )
            if self.needs_data
            else None
        )
