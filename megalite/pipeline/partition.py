"""How many, and which, transformer layers each virtual pipeline stage holds.

Stages hold consecutive runs of layers in stage order; which (pipeline rank,
chunk) runs a stage is ``stage_layout.StageLayout``'s business. Megatron's
split, drawn for 16 layers, pp=4, vp=2 on the interleaved layout (S = pp*vp =
8 virtual stages, stage s = vp_chunk * pp + pp_rank)::

    chunk 0:  rank0 [0,1]   rank1 [2,3]   rank2 [4,5]   rank3 [6,7]
    chunk 1:  rank0 [8,9]   rank1 [10,11] rank2 [12,13] rank3 [14,15]

Uneven split (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-
pipeline-num-layers``) follows Megatron's ``get_transformer_layer_offset``:
the first (last) pipeline rank holds ``first`` (``last``) layers in total,
``first // vp`` per virtual chunk; the remaining "middle" layers are divided
evenly over the other pipeline ranks and their chunks. Every virtual round
(one chunk on every rank) therefore holds the same number of layers.

General split (``--pipeline-stage-layers a,b,...``, or the one
``--pipeline-balance measured`` chooses): one layer count per virtual stage,
in stage order, so pp=2, vp=2 with ``3,1,2,2`` puts layers 0-2 on rank 0
chunk 0, 3 on rank 1 chunk 0, 4-5 on rank 0 chunk 1, 6-7 on rank 1 chunk 1.
Parameter names stay global (``decoder.layers.N``) whatever the split.
"""

from __future__ import annotations

from typing import Optional, Sequence

_STAGES = "--pipeline-stage-layers"
_FIRST = "--decoder-first-pipeline-num-layers"
_LAST = "--decoder-last-pipeline-num-layers"
_VP = (
    "virtual pipeline size (--virtual-pipeline-model-parallel-size, or the layers per stage / "
    "--num-layers-per-virtual-pipeline-stage)"
)


def num_stages(pp: int, vp: int) -> int:
    """Return the number of virtual pipeline stages, ``pp * vp``."""
    return pp * vp


def _check_uneven(num_layers: int, pp: int, vp: int, first: Optional[int], last: Optional[int]) -> None:
    """Validate the uneven (first/last) layout; see ``validate_partition``."""
    if pp == 1:
        raise ValueError(f"{_FIRST}/{_LAST} need --pipeline-model-parallel-size > 1 (got 1)")
    for flag, value in ((_FIRST, first), (_LAST, last)):
        if value is None:
            continue
        if value < 1:
            raise ValueError(f"{flag}={value} leaves a pipeline stage empty; it must be >= 1")
        if value % vp != 0:
            raise ValueError(f"{flag}={value} must be divisible by the {_VP}={vp}")
    uneven_ranks = (first is not None) + (last is not None)
    middle_ranks = pp - uneven_ranks
    middle = num_layers - (first or 0) - (last or 0)
    if middle < 0 or (middle_ranks > 0 and middle < middle_ranks * vp):
        raise ValueError(
            f"{_FIRST}={first} and {_LAST}={last} are too big for --num-layers={num_layers}: "
            f"{middle} layers left for {middle_ranks} middle pipeline ranks x vp={vp}"
        )
    if middle_ranks == 0 and middle != 0:
        raise ValueError(f"{_FIRST}={first} + {_LAST}={last} must equal --num-layers={num_layers} when pp=2")
    if middle_ranks > 0 and middle % (middle_ranks * vp) != 0:
        raise ValueError(
            f"--num-layers={num_layers} minus {_FIRST}/{_LAST} leaves {middle} layers, "
            f"not divisible by {middle_ranks} middle pipeline ranks x vp={vp}"
        )


def _check_stage_layers(
    num_layers: int, pp: int, vp: int, first: Optional[int], last: Optional[int], stage_layers: Sequence[int]
) -> None:
    """Validate a general per-virtual-stage split; see ``validate_partition``."""
    if first is not None or last is not None:
        raise ValueError(f"{_STAGES} and {_FIRST}/{_LAST} are exclusive; give one")
    if pp == 1:
        raise ValueError(f"{_STAGES} needs --pipeline-model-parallel-size > 1 (got 1)")
    if len(stage_layers) != pp * vp:
        raise ValueError(
            f"{_STAGES} has {len(stage_layers)} entries; it needs one per virtual pipeline stage "
            f"(pp x vp = {pp} x {vp} = {pp * vp}), in stage order"
        )
    for s, n in enumerate(stage_layers):
        if n < 1:
            raise ValueError(f"{_STAGES} gives stage {s} {n} layers; every stage needs >= 1")
    if sum(stage_layers) != num_layers:
        raise ValueError(f"{_STAGES} sums to {sum(stage_layers)} layers, not --num-layers={num_layers}")


def validate_partition(
    num_layers: int,
    pp: int,
    vp: int,
    first: Optional[int] = None,
    last: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
) -> None:
    """Raise ValueError (one line naming the flags) unless the layout is legal.

    Legal means: positive sizes; vp > 1 only with pp > 1; in the even case
    ``num_layers`` divisible by ``pp * vp``; in the uneven case ``first`` and
    ``last`` (when given) are >= 1 and divisible by vp, and the remaining
    layers split evenly and non-emptily over the other ranks and their chunks;
    ``stage_layers`` (exclusive with them) gives pp*vp counts >= 1 summing to
    ``num_layers``.
    """
    if num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1 (got {num_layers})")
    if pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1 (got {pp})")
    if vp < 1:
        raise ValueError(f"the {_VP} must be >= 1 (got {vp})")
    if vp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline (vp={vp}) needs --pipeline-model-parallel-size > 1")
    if stage_layers is not None:
        _check_stage_layers(num_layers, pp, vp, first, last, stage_layers)
        return
    if first is not None or last is not None:
        _check_uneven(num_layers, pp, vp, first, last)
        return
    if num_layers % (pp * vp) != 0:
        raise ValueError(
            f"--num-layers={num_layers} must be divisible by --pipeline-model-parallel-size={pp} "
            f"x vp={vp} (or use {_FIRST}/{_LAST})"
        )


def _layers_per_chunk(
    num_layers: int, pp: int, vp: int, pp_rank: int, first: Optional[int], last: Optional[int]
) -> int:
    """Number of layers one virtual chunk on ``pp_rank`` holds (layout already valid)."""
    if first is None and last is None:
        return num_layers // (pp * vp)
    if pp_rank == 0 and first is not None:
        return first // vp
    if pp_rank == pp - 1 and last is not None:
        return last // vp
    middle_ranks = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    return middle // (middle_ranks * vp)


def stage_layer_counts(
    num_layers: int,
    pp: int,
    vp: int,
    first: Optional[int] = None,
    last: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
) -> list[int]:
    """Return the number of layers of every virtual stage, in stage order (validated)."""
    validate_partition(num_layers, pp, vp, first, last, stage_layers)
    if stage_layers is not None:
        return list(stage_layers)
    per_rank = [_layers_per_chunk(num_layers, pp, vp, r, first, last) for r in range(pp)]
    return per_rank * vp  # stages chunk-major: every virtual round holds the same layers


def layers_of_stage(
    num_layers: int,
    pp: int,
    vp: int,
    stage: int,
    first: Optional[int] = None,
    last: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
) -> range:
    """Return the global layer indices held by virtual ``stage`` (0 .. pp*vp-1).

    Stages hold consecutive runs of layers in stage order, as many as
    ``stage_layer_counts`` gives each (see the module docstring). Which
    (rank, chunk) runs a stage is ``StageLayout``'s business (its ``layers``
    method is the usual entry). Raises ValueError for an illegal layout or an
    out-of-range stage.
    """
    counts = stage_layer_counts(num_layers, pp, vp, first, last, stage_layers)
    if not 0 <= stage < pp * vp:
        raise ValueError(f"stage {stage} out of range for pp={pp}, vp={vp} ({pp * vp} virtual stages)")
    start = sum(counts[:stage])
    return range(start, start + counts[stage])
