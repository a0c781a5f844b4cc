"""Builders of the classic schedules: no pipelining, GPipe, 1F1B and Megatron's interleaved 1F1B.

A builder returns, for every pipeline rank, the ordered list of compute
actions it runs (README, Architecture: schedules are data); registry.py names
each builder with its stage layout and constraints, and communication.py
inserts the Comms. Stage numbering follows the interleaved ``StageLayout``:
global virtual stage ``s = chunk * pp + rank``, S = pp*vp.

Supported micro-batch counts m: every schedule needs m >= 1;
``interleaved_1f1b`` additionally needs m % pp == 0 (Megatron's classic
interleaved schedule), and groups each steady-state F+B pair into one Comm
(``interleaved_groups``). m < pp is legal for ``gpipe`` and ``1f1b`` (a large
bubble, but correct). Each ``check_*`` function raises a one-line ValueError
naming the flags for a (pp, vp, m) its schedule cannot run.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megalite.pipeline.actions import Compute
from megalite.pipeline.stage_layout import StageLayout


def check_sizes(pp: int, vp: int, m: int) -> None:
    """Reject non-positive sizes with a one-line message."""
    if pp < 1 or vp < 1 or m < 1:
        raise ValueError(f"pipeline sizes must be >= 1 (got pp={pp}, vp={vp}, num-microbatches={m})")


def _check_interleaved_sizes(pp: int, vp: int, m: int) -> None:
    """Sizes >= 1, and virtual stages only with more than one pipeline rank."""
    check_sizes(pp, vp, m)
    if vp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline (vp={vp}) needs --pipeline-model-parallel-size > 1")


def check_no_pipelining(pp: int, vp: int, m: int) -> None:
    """no_pipelining runs on one rank with one chunk: pp == vp == 1."""
    _check_interleaved_sizes(pp, vp, m)
    if pp != 1:
        raise ValueError(f"schedule no_pipelining needs pp=1 (got pp={pp}); use 1f1b or gpipe")


def check_gpipe(pp: int, vp: int, m: int) -> None:
    """gpipe runs any pp, vp, m >= 1 (vp > 1 needs pp > 1)."""
    _check_interleaved_sizes(pp, vp, m)


def check_one_chunk(name: str, pp: int, vp: int, m: int) -> None:
    """1f1b and zb_h1 run one chunk per rank (vp == 1), any m >= 1 (m < pp: a large bubble)."""
    _check_interleaved_sizes(pp, vp, m)
    if vp != 1:
        raise ValueError(
            f"--pipeline-schedule {name} needs one chunk per rank (got "
            f"--virtual-pipeline-model-parallel-size {vp}); use interleaved_1f1b or zbv (vp=2)"
        )


def check_interleaved_1f1b(pp: int, vp: int, m: int) -> None:
    """interleaved_1f1b needs pp > 1, vp > 1 and m % pp == 0."""
    _check_interleaved_sizes(pp, vp, m)
    if vp < 2:
        raise ValueError(f"schedule interleaved_1f1b needs vp > 1 (got vp={vp}); use 1f1b")
    if m % pp != 0:
        raise ValueError(_interleaved_m_error(pp, m))


def build_no_pipelining(m: int) -> list[list[Compute]]:
    """Gradient accumulation on one rank: F0 B0 F1 B1 ... (pp must be 1)."""
    check_sizes(1, 1, m)
    return [[Compute(kind, mb, 0) for mb in range(m) for kind in ("F", "B")]]


def build_gpipe(pp: int, vp: int, m: int) -> list[list[Compute]]:
    """GPipe: every rank runs all forwards, then all backwards.

    With vp > 1 the forwards go in Megatron's interleaved order (groups of pp
    micro-batches per chunk, see ``_grouped_order``) so that no rank waits on
    a chunk boundary; every rank then holds all m*vp chunk activations.
    """
    check_sizes(pp, vp, m)
    fwd = _grouped_order(pp, vp, m, "F")
    bwd = _grouped_order(pp, vp, m, "B")
    return [fwd + bwd for _ in range(pp)]


def _one_f_one_b(fwd: Sequence[Compute], bwd: Sequence[Compute], warmup: int) -> list[Compute]:
    """Interleave ``warmup`` forwards, then F/B pairs, then the remaining backwards."""
    order = list(fwd[:warmup])
    steady = len(fwd) - warmup
    for i in range(steady):
        order += [fwd[warmup + i], bwd[i]]
    order += list(bwd[steady:])
    return order


def build_1f1b(pp: int, m: int) -> list[list[Compute]]:
    """PipeDream-Flush 1F1B: min(pp - rank - 1, m) warmup forwards, steady 1F1B, cooldown."""
    check_sizes(pp, 1, m)
    schedule = []
    for rank in range(pp):
        fwd = [Compute("F", mb, 0) for mb in range(m)]
        bwd = [Compute("B", mb, 0) for mb in range(m)]
        schedule.append(_one_f_one_b(fwd, bwd, min(pp - rank - 1, m)))
    return schedule


def _grouped_order(pp: int, vp: int, m: int, kind: str) -> list[Compute]:
    """Megatron's order of forwards (backwards) on every rank: groups of pp per chunk.

    Micro-batches are cut into groups of pp (the last may be smaller); each
    group visits chunk 0, 1, ..., vp-1 (backward: vp-1, ..., 0). For m % pp
    == 0 this is Megatron's k -> (chunk (k % (pp*vp)) // pp, micro-batch
    (k // (pp*vp)) * pp + k % pp).
    """
    order = []
    for group in range(0, m, pp):
        for c in range(vp):
            chunk = c if kind == "F" else vp - 1 - c
            order += [Compute(kind, mb, chunk) for mb in range(group, min(group + pp, m))]
    return order


def interleaved_warmup(pp: int, vp: int, m: int, rank: int) -> int:
    """Number of warmup forwards of interleaved 1F1B on ``rank``.

    Megatron's ``(pp - rank - 1) * 2 + (vp - 1) * pp``, capped at m*vp. The
    factor 2 lets each steady-state F+B pair exchange all four tensors in one
    Comm that meets the neighbours' pair Comms one iteration apart.
    """
    return min((pp - rank - 1) * 2 + (vp - 1) * pp, m * vp)


def build_interleaved_1f1b(pp: int, vp: int, m: int) -> list[list[Compute]]:
    """Megatron's interleaved 1F1B (needs m % pp == 0).

    Rank r warms up with ``(pp - r - 1) * 2 + (vp - 1) * pp`` forwards (capped
    at m*vp), then alternates one forward and one backward, then drains.
    """
    check_sizes(pp, vp, m)
    if m % pp != 0:
        raise ValueError(_interleaved_m_error(pp, m))
    fwd = _grouped_order(pp, vp, m, "F")
    bwd = _grouped_order(pp, vp, m, "B")
    return [_one_f_one_b(fwd, bwd, interleaved_warmup(pp, vp, m, rank)) for rank in range(pp)]


def _interleaved_m_error(pp: int, m: int) -> str:
    return (
        f"interleaved_1f1b needs the number of micro-batches per step (m = --global-batch-size / "
        f"(--micro-batch-size x data-parallel size) = {m}) to be a multiple of "
        f"--pipeline-model-parallel-size ({pp}); change --global-batch-size or --micro-batch-size"
    )


def interleaved_groups(pp: int, vp: int, m: int) -> list[list[int]]:
    """Compute groups of interleaved 1F1B per rank: warmup singles, steady F+B pairs, cooldown singles.

    Megatron exchanges all four tensors of a steady-state iteration (send F
    output, send B grad, recv next F input, recv next B grad) in one batch;
    one Comm per F+B pair reproduces that and is what makes it deadlock-free.
    """
    groups = []
    for rank in range(pp):
        warmup = interleaved_warmup(pp, vp, m, rank)
        # warmup forwards alone, F+B pairs, then as many backwards alone as warmup forwards
        groups.append([1] * warmup + [2] * (m * vp - warmup) + [1] * warmup)
    return groups


def build_forward_only(pp: int, vp: int, m: int, layout: Optional[StageLayout] = None) -> list[list[Compute]]:
    """Forwards only (evaluation): every rank runs all forwards in Megatron's grouped order.

    In a V every rank runs its first arm for all micro-batches, then its second.
    """
    check_sizes(pp, vp, m)
    if layout is not None and layout.v_shape:
        return [[Compute("F", mb, c) for c in range(2) for mb in range(m)] for _ in range(pp)]
    if vp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline (vp={vp}) needs --pipeline-model-parallel-size > 1")
    return [_grouped_order(pp, vp, m, "F") for _ in range(pp)]
