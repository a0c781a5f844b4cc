"""The run objects a checkpoint saves and loads, in one explicit bundle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

from torch import nn

from megalite.config import Config
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker

if TYPE_CHECKING:  # megalite.training imports this package: type hints only, no runtime import back
    from megalite.optim.lr_scheduler import LRScheduler
    from megalite.optim.optimizer import MegatronOptimizer
    from megalite.training.state import TrainState

__all__ = ["RunParts"]


@dataclass
class RunParts:
    """One rank's part of a run, as a checkpoint sees it: the config and parallel state it was built
    with, the model chunks, the optimizer (fp32 main weights, moments, loss scaler), the LR schedule,
    the TrainState counters and the RNG tracker. Every save and load takes this one object."""

    cfg: Config
    ps: ParallelState
    model_parts: List[nn.Module]
    optimizer: "MegatronOptimizer"
    scheduler: "LRScheduler"
    train_state: "TrainState"
    rng_tracker: RNGTracker
