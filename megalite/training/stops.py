"""When a run stops early: a non-finite loss or gradient, a bad token id, --exit-interval, a signal or time limit.

Every rule ends every rank at the same iteration: a problem found on one rank is agreed on
in one all-reduce (``megalite.parallel.agreement``), and exactly one rank reports it.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

from megalite.config import TrainConfig
from megalite.parallel.agreement import flags_on_any_rank, lowest_rank_with
from megalite.parallel.state import ParallelState
from megalite.training.faults import ExitConditions
from megalite.training.state import TrainState


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient, a bad sample); the message says why and what to do.

    ``report`` is true on the one rank that should print it (every rank raises it).
    """

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


def check_tokens(data, batches: List, vocab: int, ps: ParallelState, where: str) -> None:
    """Stop every rank before a step when a sample holds an id outside the tokenizer's vocabulary.

    Checked against the unpadded size, so every tp size (each pads differently) stops the same
    way: unchecked, an id past the padding crashes the lookup at tp=1, and an id inside it trains
    on an infinite loss (padding logits are masked) at tp>1. One all-reduce. ``data`` is the
    MicroBatches that returned ``batches`` (None on ranks that read no data).
    """
    problem = data.bad_token(batches, vocab) if data is not None else None
    reporter = lowest_rank_with(problem is not None, ps)
    if reporter is not None:
        raise TrainingStopped(f"{where}: {problem}", report=reporter == ps.rank)


class StopRules:
    """After each iteration: stop on a non-finite value (raise), or say why the run should end cleanly."""

    def __init__(self, t: TrainConfig, ps: ParallelState, exits: Optional[ExitConditions] = None):
        self.t, self.ps, self.exits = t, ps, exits

    def after_step(self, out: Dict[str, float], state: TrainState) -> Optional[str]:
        """The reason to end the run cleanly after this iteration (None: go on); collective.

        Megatron's --check-for-nan-in-loss-and-grad raises TrainingStopped on every rank at the
        first non-finite loss or norm; an fp16 overflow is not one (the scaler skipped that
        step and its norm is None).
        """
        t = self.t
        bad = t.check_for_nan_in_loss_and_grad and any(
            v is not None and not math.isfinite(v) for v in (out["loss"], out["grad_norm"])
        )
        reason = self.exits.local_reason() if self.exits is not None and self.exits.active else None
        stop_bad, stop_asked = flags_on_any_rank([bad, reason is not None], self.ps)
        if stop_bad:
            raise TrainingStopped(
                f"iteration {state.iteration}: the loss or gradient norm is not finite (lm loss {out['loss']}, "
                f"grad norm {out['grad_norm']} on this rank); stopping, with the weights of iteration "
                f"{state.iteration - 1}. Lower --lr or check the data; --no-check-for-nan-in-loss-and-grad "
                f"counts such steps and skips their updates instead",
                report=self.ps.is_logging_rank,
            )
        if t.exit_interval and state.iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval} reached"
        if stop_asked:
            return reason or "another rank asked to stop"
        return None
