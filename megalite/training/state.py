"""The run's counters: what a checkpoint stores besides weights, optimizer, schedule and random states."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TrainState:
    """Iterations done, samples consumed (the data position) and the steps the run skipped.

    ``skipped_iters`` counts updates skipped on an fp16 overflow or a non-finite gradient
    norm; ``nan_iters`` counts iterations whose loss was not finite (Megatron's two counters
    in the log line).
    """

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0

    def advance(self, global_batch_size: int) -> None:
        """One iteration done on ``global_batch_size`` samples."""
        self.iteration += 1
        self.consumed_samples += global_batch_size

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
        self.skipped_iters = int(state.get("skipped_iters", 0))
        self.nan_iters = int(state.get("nan_iters", 0))
