"""Training: the Trainer (build a run from a Config and a ParallelState, then sequence its steps),
its counters (TrainState), evaluation, the log line and summary, and a mock-data helper."""

from megalite.training.state import TrainState
from megalite.training.trainer import Trainer, TrainingStopped, build_model_chunks

__all__ = ["Trainer", "TrainingStopped", "TrainState", "build_model_chunks"]
