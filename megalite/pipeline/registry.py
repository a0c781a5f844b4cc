"""The one registry of pipeline schedules: every schedule described once, read by everyone.

Each ``ScheduleSpec`` names a schedule's builder, its stage layout (a V or
interleaved), whether its backward is split into B and W, the (pp, vp, m) it
can run and a one-line description. The CLI (choices, validation), the
executor (layout, split backward), megalite.analysis (simulator, balancing,
planner) and tools/plot_pipeline.py all read this table; nothing else lists
schedule names (README, Architecture: schedules are data). Adding a schedule
is one entry here plus its builder::

    "1f1b": ScheduleSpec("1f1b", build=lambda pp, vp, m: build_1f1b(pp, m),
                         check=partial(check_one_chunk, "1f1b"), description="...")

``build_schedule`` turns an entry into per-rank action lists: the builder's
compute order, then communication.add_communication with the entry's layout
(and its Comm grouping, ``comm_groups``, unless p2p is overlapped).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

from megalite.pipeline.actions import Action, Compute
from megalite.pipeline.communication import add_communication
from megalite.pipeline.schedules import (
    build_1f1b,
    build_forward_only,
    build_gpipe,
    build_interleaved_1f1b,
    build_no_pipelining,
    check_gpipe,
    check_interleaved_1f1b,
    check_no_pipelining,
    check_one_chunk,
    interleaved_groups,
)
from megalite.pipeline.stage_layout import StageLayout
from megalite.pipeline.zero_bubble import (
    build_dualpipev,
    build_zb_h1,
    build_zbv,
    check_dualpipev,
    check_zb_h1,
    check_zbv,
)

Builder = Callable[[int, int, int], list[list[Compute]]]


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule, described once.

    ``build(pp, vp, m)`` returns the compute order per rank; ``check(pp, vp, m)``
    raises a one-line ValueError naming the flags when the schedule cannot run
    that shape. ``v_shape``: the stages sit in a V (two chunks per rank, first and
    last stage on rank 0). ``split_backward``: B computes input gradients only and
    W the weight gradients. ``comm_groups(pp, vp, m)``, when given, cuts each rank's
    compute order into groups that share one Comm (see communication.py);
    overlapped p2p ignores it.
    """

    name: str
    build: Builder
    check: Callable[[int, int, int], None]
    description: str
    v_shape: bool = False
    split_backward: bool = False
    comm_groups: Optional[Callable[[int, int, int], list[list[int]]]] = None


def _specs(*specs: ScheduleSpec) -> dict[str, ScheduleSpec]:
    return {s.name: s for s in specs}


SCHEDULES: dict[str, ScheduleSpec] = _specs(  # insertion order: the order --help lists them
    ScheduleSpec(
        "no_pipelining",
        lambda pp, vp, m: build_no_pipelining(m),
        check_no_pipelining,
        "gradient accumulation on one rank: F0 B0 F1 B1 ... (pp = 1)",
    ),
    ScheduleSpec(
        "gpipe",
        build_gpipe,
        check_gpipe,
        "all forwards, then all backwards (any pp, vp, m; holds every micro-batch's activations)",
    ),
    ScheduleSpec(
        "1f1b",
        lambda pp, vp, m: build_1f1b(pp, m),
        partial(check_one_chunk, "1f1b"),
        "PipeDream-Flush 1F1B: warmup forwards, one forward one backward, cooldown (vp = 1)",
    ),
    ScheduleSpec(
        "interleaved_1f1b",
        build_interleaved_1f1b,
        check_interleaved_1f1b,
        "Megatron's interleaved 1F1B over vp chunks per rank (vp > 1, m a multiple of pp)",
        comm_groups=interleaved_groups,
    ),
    ScheduleSpec(
        "zb_h1",
        lambda pp, vp, m: build_zb_h1(pp, m),
        check_zb_h1,
        "zero-bubble ZB-H1: 1F1B with split backward, W's held back to fill the bubble (vp = 1)",
        split_backward=True,
    ),
    ScheduleSpec(
        "zbv",
        lambda pp, vp, m: build_zbv(pp, m),
        check_zbv,
        "zero-bubble ZB-V: two chunks per rank in a V, split backward (pp >= 2, vp = 2)",
        v_shape=True,
        split_backward=True,
    ),
    ScheduleSpec(
        "dualpipev",
        lambda pp, vp, m: build_dualpipev(pp, m),
        check_dualpipev,
        "DeepSeek's DualPipeV: ZB-V's layout with paired forward/backward (vp = 2, m >= 2pp)",
        v_shape=True,
        split_backward=True,
    ),
)


def get_schedule(name: str) -> ScheduleSpec:
    """The registry entry of schedule ``name``; ValueError (listing the valid names) for an unknown one."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}") from None


def default_schedule_name(pp: int, vp: int) -> str:
    """Megatron's choice: no pipelining for pp=1, interleaved for vp>1, else 1F1B."""
    if pp == 1:
        return "no_pipelining"
    return "interleaved_1f1b" if vp > 1 else "1f1b"


def validate_schedule(name: str, pp: int, vp: int, m: int) -> None:
    """Raise ValueError (one line naming the flags) unless schedule ``name`` supports (pp, vp, m)."""
    get_schedule(name).check(pp, vp, m)


def layout_for(name: str, pp: int, vp: int) -> StageLayout:
    """The stage layout schedule ``name`` runs on (a V or interleaved)."""
    return StageLayout(pp, vp, v_shape=get_schedule(name).v_shape)


def build_compute(name: str, pp: int, vp: int, m: int) -> list[list[Compute]]:
    """Return the compute-only order per rank of schedule ``name`` (validated)."""
    spec = get_schedule(name)
    spec.check(pp, vp, m)
    return spec.build(pp, vp, m)


def build_schedule(
    name: str, pp: int, vp: int, m: int, forward_only: bool = False, overlap_p2p: bool = False
) -> list[list[Action]]:
    """Return the full action list per rank (compute plus Comm) of schedule ``name``.

    With ``forward_only`` (evaluation) every schedule degenerates to the same
    forwards-only list on its layout, and any m >= 1 is accepted; ``name`` is
    still checked.

    ``overlap_p2p`` (Megatron's --overlap-p2p-communication) places each
    compute's sends right after it, alone (interleaved 1F1B no longer holds a
    forward's output back until the paired backward is done), and posts every
    receive one compute ahead of the compute that reads it, so the transfer
    overlaps the compute in between. That placement relies on the executor's
    semantics (a posted Comm never blocks the rank; only a compute waits, for
    the receive it reads) and is proven deadlock-free in that simulator mode.
    """
    spec = get_schedule(name)
    layout = layout_for(name, pp, vp)
    lookahead = int(overlap_p2p)
    if forward_only:
        return add_communication(build_forward_only(pp, vp, m, layout), pp, vp, layout=layout, lookahead=lookahead)
    groups = spec.comm_groups(pp, vp, m) if spec.comm_groups is not None and not overlap_p2p else None
    return add_communication(build_compute(name, pp, vp, m), pp, vp, groups, layout, lookahead)
