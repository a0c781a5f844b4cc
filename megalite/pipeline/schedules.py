"""Pipeline schedules as data (DESIGN principle 5).

A builder returns, for every pipeline rank, the ordered list of compute
actions it runs; ``add_communication`` then inserts the point-to-point batches
(``Comm``) that move activations forward and gradients backward between
virtual stages. One executor runs any such list; ``simulate.py`` proves it
deadlock-free and measures bubble and memory. Stage numbering follows
``partition.py``: global virtual stage ``s = chunk * pp + rank``, S = pp*vp::

    rank 0: F0.0 [sF0->1] F1.0 [sF1->1 rB0<-1] B0.0 ...
                 ^ Comm: one batch_isend_irecv, all ops waited for together

Supported micro-batch counts m: every schedule needs m >= 1;
``interleaved_1f1b`` additionally needs m % pp == 0 (Megatron's classic
interleaved schedule). m < pp is legal for ``gpipe`` and ``1f1b`` (a large
bubble, but correct).

Communication placement (Megatron's send_forward_recv_backward pattern):
after each compute action, one Comm holds that action's sends plus the recvs
needed by the next compute action on this rank; a Comm with the first
action's recvs comes first. Interleaved 1F1B deadlocks under that rule (two
neighbours each block in a steady-state gradient send whose matching recv the
other posts only after its own blocked Comm), so there each F+B pair shares one
Comm holding both sends and the recvs of the next pair, exactly Megatron's
send_forward_backward_recv_forward_backward. The simulator proves every
schedule deadlock-free under conservative rendezvous semantics (a Comm
completes only when every peer has posted its matching op) for pp 1..8,
vp 1..4, m up to 4*pp; see tests/unit/test_schedules.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from megalite.pipeline.stage_layout import V_SCHEDULES, StageLayout, layout_for

SCHEDULES = ("no_pipelining", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zb_h1", "zbv", "dualpipev")  # schedules whose B computes input gradients only (W: weights)


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


def _check_sizes(pp: int, vp: int, m: int) -> None:
    """Reject non-positive sizes with a one-line message."""
    if pp < 1 or vp < 1 or m < 1:
        raise ValueError(f"pipeline sizes must be >= 1 (got pp={pp}, vp={vp}, num-microbatches={m})")


def build_no_pipelining(m: int) -> list[list[Compute]]:
    """Gradient accumulation on one rank: F0 B0 F1 B1 ... (pp must be 1)."""
    _check_sizes(1, 1, m)
    return [[Compute(kind, mb, 0) for mb in range(m) for kind in ("F", "B")]]


def build_gpipe(pp: int, vp: int, m: int) -> list[list[Compute]]:
    """GPipe: every rank runs all forwards, then all backwards.

    With vp > 1 the forwards go in Megatron's interleaved order (groups of pp
    micro-batches per chunk, see ``_grouped_order``) so that no rank waits on
    a chunk boundary; every rank then holds all m*vp chunk activations.
    """
    _check_sizes(pp, vp, m)
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
    _check_sizes(pp, 1, m)
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
    _check_sizes(pp, vp, m)
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


def _neighbour(action: Compute, rank: int, layout: StageLayout, direction: str) -> Optional[tuple[int, int, int]]:
    """(this stage, neighbour stage, its rank) that ``action`` sends to ("send") or reads from.

    None when there is none (first/last stage, W) or it runs on this rank: a V's turn
    (stage pp-1 -> pp) is handed over in memory, not sent.
    """
    s, last = layout.stage(rank, action.chunk), layout.num_stages - 1
    if action.kind == "W":
        return None
    step = 1 if (action.kind == "F") == (direction == "send") else -1
    other = s + step
    if not 0 <= other <= last or layout.rank_of(other) == rank:
        return None
    return s, other, layout.rank_of(other)


def _sends(action: Compute, rank: int, layout: StageLayout) -> list[P2POp]:
    """The sends ``action`` produces: F output to s+1, B input-gradient to s-1."""
    n = _neighbour(action, rank, layout, "send")
    return [P2POp("send", action.kind, action.mb, n[0], n[1], n[2])] if n else []


def _recvs(action: Compute, rank: int, layout: StageLayout) -> list[P2POp]:
    """The recvs ``action`` needs: F input from s-1, B output-gradient from s+1."""
    n = _neighbour(action, rank, layout, "recv")
    return [P2POp("recv", action.kind, action.mb, n[1], n[0], n[2])] if n else []


def _comm(ops: list[P2POp]) -> list[Comm]:
    """Wrap ops into a Comm (sends first, then recvs, each in given order); drop empties."""
    ordered = [o for o in ops if o.op == "send"] + [o for o in ops if o.op == "recv"]
    return [Comm(tuple(ordered))] if ordered else []


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


def _split(actions: list[Compute], sizes: list[int]) -> list[list[Compute]]:
    """Cut ``actions`` into consecutive groups of the given sizes."""
    if sum(sizes) != len(actions):
        raise ValueError(f"groups cover {sum(sizes)} of {len(actions)} compute actions")
    parts, start = [], 0
    for size in sizes:
        parts.append(actions[start:start + size])
        start += size
    return parts


class _ChannelOrder:
    """Receives posted in the order their sends are posted on each directed channel.

    Both gloo and NCCL match the k-th send on a channel (src rank -> dst rank) with
    the k-th receive. When a channel carries two streams whose order differs
    between the two ends (a V's channel r -> r+1 carries activations of the first
    arm and gradients of the second), a receive needed now also posts the earlier
    messages of its channel: they are then waiting, buffered, when their sends come.
    """

    def __init__(self, compute: list[list[Compute]], layout: StageLayout):
        self.sent: dict[tuple[int, int], list[P2POp]] = {}
        for rank, actions in enumerate(compute):
            for a in actions:
                for op in _sends(a, rank, layout):
                    self.sent.setdefault((rank, op.peer), []).append(op)
        self.index = {(ch, op.message()): i for ch, ops in self.sent.items() for i, op in enumerate(ops)}
        self.posted: dict[tuple[int, int], int] = {}

    def recvs(self, needed: list[P2POp], rank: int) -> list[P2POp]:
        """``needed`` plus every earlier message of their channels not yet posted, in channel order."""
        out = []
        for op in needed:
            ch = (op.peer, rank)
            upto = self.index[(ch, op.message())]
            start = self.posted.get(ch, 0)
            out += [P2POp("recv", s.kind, s.mb, s.src_stage, s.dst_stage, op.peer)
                    for s in self.sent[ch][start:upto + 1]]
            self.posted[ch] = max(start, upto + 1)
        return out


def _with_comms(parts: list[list[Compute]], rank: int, layout: StageLayout, order: _ChannelOrder,
                lookahead: int = 0) -> list[Action]:
    """One rank's actions with a Comm before the first group and after every group.

    The Comm after group i holds i's sends and the receives of group i+1+lookahead.
    """

    def sends(part: list[Compute]) -> list[P2POp]:
        return [op for a in part for op in _sends(a, rank, layout)]

    def recvs(part: list[Compute]) -> list[P2POp]:
        return order.recvs([op for a in part for op in _recvs(a, rank, layout)], rank)

    out: list[Action] = _comm([op for part in parts[:1 + lookahead] for op in recvs(part)])
    for i, part in enumerate(parts):
        out += part
        ahead = i + 1 + lookahead
        out += _comm(sends(part) + (recvs(parts[ahead]) if ahead < len(parts) else []))
    return out


def add_communication(
    compute: list[list[Compute]], pp: int, vp: int, groups: Optional[list[list[int]]] = None,
    layout: Optional[StageLayout] = None, lookahead: int = 0,
) -> list[list[Action]]:
    """Insert Comm batches into per-rank compute lists.

    ``groups[rank]`` cuts the rank's compute list into consecutive groups
    (default: every action alone). Before the first group: a Comm with its
    recvs. After each group: one Comm with the group's sends plus the recvs
    needed by the next group (Megatron's send_forward_recv_backward pattern;
    F+B pairs give its send_forward_backward_recv_forward_backward). The last
    group's Comm holds only its sends. Empty Comms are dropped. Within a Comm
    sends come first, then recvs; receives follow each channel's send order
    (``_ChannelOrder``), so both ends list a channel's messages alike.
    ``layout`` places stages on ranks (default: interleaved). ``lookahead`` k
    posts each group's receives k groups earlier (overlapped p2p: the transfer
    runs while the groups in between compute).
    """
    if len(compute) != pp:
        raise ValueError(f"expected compute lists for {pp} pipeline ranks, got {len(compute)}")
    if groups is None:
        groups = [[1] * len(actions) for actions in compute]
    layout = layout or StageLayout(pp, vp)
    order = _ChannelOrder(compute, layout)
    return [
        _with_comms(_split(actions, groups[rank]), rank, layout, order, lookahead)
        for rank, actions in enumerate(compute)
    ]


def validate_schedule(name: str, pp: int, vp: int, m: int) -> None:
    """Raise ValueError (one line naming the flags) unless schedule ``name`` supports (pp, vp, m).

    no_pipelining: pp == vp == 1. gpipe: any pp, vp, m >= 1 (vp > 1 needs
    pp > 1). 1f1b: vp == 1, any m >= 1 (m < pp is legal, with a large bubble).
    interleaved_1f1b: pp > 1, vp > 1, m % pp == 0. zb_h1: vp == 1, any m.
    zbv: pp > 1, vp == 2 (the two arms of the V), any m. dualpipev: as zbv,
    and m >= 2pp.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    _check_sizes(pp, vp, m)
    if name in V_SCHEDULES:
        if pp < 2:
            raise ValueError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2 "
                             "(on one rank use no_pipelining)")
        if vp != 2:
            raise ValueError(f"--pipeline-schedule {name} runs two chunks per rank in a V: it needs "
                             f"--virtual-pipeline-model-parallel-size 2 (got vp={vp})")
        if name == "dualpipev" and m < 2 * pp:
            raise ValueError(f"--pipeline-schedule dualpipev needs at least 2 x pp = {2 * pp} micro-batches per "
                             f"step (got {m}); raise --global-batch-size or use zbv")
        return
    if vp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline (vp={vp}) needs --pipeline-model-parallel-size > 1")
    if name == "no_pipelining" and pp != 1:
        raise ValueError(f"schedule no_pipelining needs pp=1 (got pp={pp}); use 1f1b or gpipe")
    if name in ("1f1b", "zb_h1") and vp != 1:
        raise ValueError(f"--pipeline-schedule {name} needs one chunk per rank (got "
                         f"--virtual-pipeline-model-parallel-size {vp}); use interleaved_1f1b or zbv (vp=2)")
    if name == "interleaved_1f1b":
        if vp < 2:
            raise ValueError(f"schedule interleaved_1f1b needs vp > 1 (got vp={vp}); use 1f1b")
        if m % pp != 0:
            raise ValueError(_interleaved_m_error(pp, m))


def build_compute(name: str, pp: int, vp: int, m: int) -> list[list[Compute]]:
    """Return the compute-only order per rank of schedule ``name`` (validated)."""
    validate_schedule(name, pp, vp, m)
    if name in SPLIT_BACKWARD:
        from megalite.pipeline import zero_bubble  # it builds on this module's actions
        build = {"zb_h1": zero_bubble.build_zb_h1, "zbv": zero_bubble.build_zbv,
                 "dualpipev": zero_bubble.build_dualpipev}[name]
        return build(pp, m)
    if name == "no_pipelining":
        return build_no_pipelining(m)
    if name == "gpipe":
        return build_gpipe(pp, vp, m)
    if name == "1f1b":
        return build_1f1b(pp, m)
    return build_interleaved_1f1b(pp, vp, m)


def build_forward_only(pp: int, vp: int, m: int, layout: Optional[StageLayout] = None) -> list[list[Compute]]:
    """Forwards only (evaluation): every rank runs all forwards in Megatron's grouped order.

    In a V every rank runs its first arm for all micro-batches, then its second.
    """
    _check_sizes(pp, vp, m)
    if layout is not None and layout.v_shape:
        return [[Compute("F", mb, c) for c in range(2) for mb in range(m)] for _ in range(pp)]
    if vp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline (vp={vp}) needs --pipeline-model-parallel-size > 1")
    return [_grouped_order(pp, vp, m, "F") for _ in range(pp)]


def build_schedule(name: str, pp: int, vp: int, m: int, forward_only: bool = False,
                   overlap_p2p: bool = False) -> list[list[Action]]:
    """Return the full action list per rank (compute plus Comm) of schedule ``name``.

    With ``forward_only`` (evaluation) every schedule degenerates to the same
    forwards-only list, and any m >= 1 is accepted; ``name`` is still checked.

    ``overlap_p2p`` (Megatron's --overlap-p2p-communication) places each
    compute's sends right after it, alone (interleaved 1F1B no longer holds a
    forward's output back until the paired backward is done), and posts every
    receive one compute ahead of the compute that reads it, so the transfer
    overlaps the compute in between. That placement relies on the executor's
    semantics (a posted Comm never blocks the rank; only a compute waits, for
    the receive it reads) and is proven deadlock-free in that simulator mode.
    """
    layout = layout_for(name, pp, vp)
    if forward_only:
        if name not in SCHEDULES:
            validate_schedule(name, pp, vp, m)
        return add_communication(build_forward_only(pp, vp, m, layout), pp, vp, layout=layout,
                                 lookahead=int(overlap_p2p))
    groups = interleaved_groups(pp, vp, m) if name == "interleaved_1f1b" and not overlap_p2p else None
    return add_communication(build_compute(name, pp, vp, m), pp, vp, groups, layout, lookahead=int(overlap_p2p))


def default_schedule_name(pp: int, vp: int) -> str:
    """Megatron's choice: no pipelining for pp=1, interleaved for vp>1, else 1F1B."""
    if pp == 1:
        return "no_pipelining"
    return "interleaved_1f1b" if vp > 1 else "1f1b"


def format_action(action: Action) -> str:
    """Render one action: ``F3.1`` (forward mb 3, chunk 1) or ``[sF3->2 rB1<-0]`` (peer ranks)."""
    if isinstance(action, Compute):
        return f"{action.kind}{action.mb}.{action.chunk}"
    parts = [
        f"s{o.kind}{o.mb}->{o.peer}" if o.op == "send" else f"r{o.kind}{o.mb}<-{o.peer}"
        for o in action.ops
    ]
    return "[" + " ".join(parts) + "]"


def format_schedule(actions: Sequence) -> str:
    """Compact text rendering for debugging and error messages.

    Accepts one rank's action list (one line) or a per-rank list of lists (one
    ``rank r: ...`` line per rank).
    """
    if actions and all(isinstance(a, (list, tuple)) and not isinstance(a, Comm) for a in actions):
        return "\n".join(f"rank {r}: {format_schedule(a)}" for r, a in enumerate(actions))
    return " ".join(format_action(a) for a in actions)
