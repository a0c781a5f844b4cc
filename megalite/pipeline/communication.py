"""Communication placement: where the point-to-point batches (``Comm``) go in a compute order.

A builder gives every rank its compute actions; ``add_communication`` inserts
the Comms that move activations forward and gradients backward between
stages placed by a ``StageLayout`` (README, Architecture: schedules are data).

The rule is Megatron's send_forward_recv_backward pattern: after each compute
group, one Comm holds that group's sends plus the recvs needed by the next
group on this rank; a Comm with the first group's recvs comes first. By
default every compute is its own group. Interleaved 1F1B deadlocks under the
one-compute rule (two neighbours each block in a steady-state gradient send
whose matching recv the other posts only after its own blocked Comm), so its
registry entry groups each F+B pair into one Comm holding both sends and the
recvs of the next pair, exactly Megatron's
send_forward_backward_recv_forward_backward. ``lookahead`` k (overlapped p2p)
posts each group's receives k groups earlier. megalite.analysis.simulate
proves every registered schedule deadlock-free under this placement
(tests/unit/test_schedules.py).
"""

from __future__ import annotations

from typing import Optional

from megalite.pipeline.actions import Action, Comm, Compute, P2POp
from megalite.pipeline.stage_layout import StageLayout


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


def _split(actions: list[Compute], sizes: list[int]) -> list[list[Compute]]:
    """Cut ``actions`` into consecutive groups of the given sizes."""
    if sum(sizes) != len(actions):
        raise ValueError(f"groups cover {sum(sizes)} of {len(actions)} compute actions")
    parts, start = [], 0
    for size in sizes:
        parts.append(actions[start : start + size])
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
            out += [
                P2POp("recv", s.kind, s.mb, s.src_stage, s.dst_stage, op.peer) for s in self.sent[ch][start : upto + 1]
            ]
            self.posted[ch] = max(start, upto + 1)
        return out


def _with_comms(
    parts: list[list[Compute]], rank: int, layout: StageLayout, order: _ChannelOrder, lookahead: int = 0
) -> list[Action]:
    """One rank's actions with a Comm before the first group and after every group.

    The Comm after group i holds i's sends and the receives of group i+1+lookahead.
    """

    def sends(part: list[Compute]) -> list[P2POp]:
        return [op for a in part for op in _sends(a, rank, layout)]

    def recvs(part: list[Compute]) -> list[P2POp]:
        return order.recvs([op for a in part for op in _recvs(a, rank, layout)], rank)

    out: list[Action] = _comm([op for part in parts[: 1 + lookahead] for op in recvs(part)])
    for i, part in enumerate(parts):
        out += part
        ahead = i + 1 + lookahead
        out += _comm(sends(part) + (recvs(parts[ahead]) if ahead < len(parts) else []))
    return out


def add_communication(
    compute: list[list[Compute]],
    pp: int,
    vp: int,
    groups: Optional[list[list[int]]] = None,
    layout: Optional[StageLayout] = None,
    lookahead: int = 0,
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
