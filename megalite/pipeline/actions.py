"""The vocabulary of pipeline schedules: compute actions, p2p ops, Comm batches, and their text form.

A schedule is data (README, Architecture: schedules are data): for every
pipeline rank an ordered list of ``Action``s, each either a ``Compute`` (run
one micro-batch through one local chunk) or a ``Comm`` (one batch of p2p ops
posted together). Builders (schedules.py, zero_bubble.py) produce the
computes, communication.py inserts the Comms, registry.py names the
schedules, executor.py runs the lists and megalite.analysis.simulate checks
and times them; all of them speak only these types::

    rank 0: F0.0 [sF0->1] F1.0 [sF1->1 rB0<-1] B0.0 ...
                 ^ Comm: one batch_isend_irecv, all ops waited for together
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union


@dataclass(frozen=True)
class Compute:
    """Run one micro-batch through one local model chunk.

    ``kind`` is "F" (forward), "B" (backward) or "W" (weight gradients). In a
    schedule that has W actions B computes only the input gradient (what the
    previous stage waits for) and W, placed later by the schedule, the weight
    gradients; otherwise B is the whole backward. ``chunk`` is the local
    chunk 0..vp-1; its global stage comes from the StageLayout.
    """

    kind: str
    mb: int
    chunk: int


@dataclass(frozen=True)
class P2POp:
    """One side of a point-to-point transfer.

    ``kind`` "F" is an activation flowing stage s-1 -> s, "B" a gradient
    flowing stage s+1 -> s. ``peer`` is the pipeline rank on the other side.
    """

    op: str
    kind: str
    mb: int
    src_stage: int
    dst_stage: int
    peer: int

    def message(self) -> tuple[str, int, int, int]:
        """Return what both sides of a transfer must agree on."""
        return (self.kind, self.mb, self.src_stage, self.dst_stage)


@dataclass(frozen=True)
class Comm:
    """A batch of p2p ops issued together (one batch_isend_irecv) and waited for together."""

    ops: tuple[P2POp, ...]


Action = Union[Compute, Comm]


def format_action(action: Action) -> str:
    """Render one action: ``F3.1`` (forward mb 3, chunk 1) or ``[sF3->2 rB1<-0]`` (peer ranks)."""
    if isinstance(action, Compute):
        return f"{action.kind}{action.mb}.{action.chunk}"
    parts = [f"s{o.kind}{o.mb}->{o.peer}" if o.op == "send" else f"r{o.kind}{o.mb}<-{o.peer}" for o in action.ops]
    return "[" + " ".join(parts) + "]"


def format_schedule(actions: Sequence) -> str:
    """Compact text rendering for debugging and error messages.

    Accepts one rank's action list (one line) or a per-rank list of lists (one
    ``rank r: ...`` line per rank).
    """
    if actions and all(isinstance(a, (list, tuple)) and not isinstance(a, Comm) for a in actions):
        return "\n".join(f"rank {r}: {format_schedule(a)}" for r, a in enumerate(actions))
    return " ".join(format_action(a) for a in actions)
