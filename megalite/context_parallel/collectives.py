"""Autograd collectives over the CP group for the all_gather and a2a attention (each the other's adjoint).

    gather_kv        fwd: all-gather K/V along the sequence (rank order)    bwd: reduce-scatter dK/dV
    heads_to_seq     fwd: all-to-all [b, n, s/CP, d] -> [b, n/CP, s, d]     bwd: seq_to_heads
    seq_to_heads     fwd: all-to-all [b, n/CP, s, d] -> [b, n, s/CP, d]     bwd: heads_to_seq

The gathered sequence is in rank order (each rank's two chunks, rank after rank), not the natural
order; callers reorder it when they need to.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.comms import all_gather_first, reduce_scatter_first


class _GatherKV(torch.autograd.Function):
    """kv [2, b, g, s_l, d] -> [2, b, g, CP * s_l, d]."""

    @staticmethod
    def forward(ctx, kv, cp):
        ctx.cp = cp
        return all_gather_first(kv.movedim(3, 0).contiguous(), cp).movedim(0, 3)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first(grad.movedim(3, 0).contiguous(), ctx.cp).movedim(0, 3), None


def gather_kv(kv: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """All-gather the stacked K/V [2, b, g, s_l, d] along the sequence; reduce-scatter its gradient."""
    return _GatherKV.apply(kv, cp)


def _all_to_all(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """x [CP, ...]: part j goes to CP rank j; returns y [CP, ...] with part j from CP rank j."""
    x = x.contiguous()
    y = torch.empty_like(x)
    cp.collective(dist.all_to_all_single, y, x)
    return y


def _heads_to_seq(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    b, n, sl, d = x.shape
    parts = x.reshape(b, cp.size, n // cp.size, sl, d).movedim(1, 0)  # [CP (head group), b, n/CP, s_l, d]
    y = _all_to_all(parts, cp)  # [CP (source rank), b, n/CP, s_l, d]
    return y.movedim(0, 2).reshape(b, n // cp.size, cp.size * sl, d)


def _seq_to_heads(y: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    b, m, s, d = y.shape
    parts = y.reshape(b, m, cp.size, s // cp.size, d).movedim(2, 0)  # [CP (owner of the rows), b, m, s_l, d]
    x = _all_to_all(parts, cp)  # [CP (head group), b, m, s_l, d]
    return x.movedim(0, 1).reshape(b, m * cp.size, s // cp.size, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, to_seq):
        ctx.cp, ctx.to_seq = cp, to_seq
        return _heads_to_seq(x, cp) if to_seq else _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return (_seq_to_heads(grad, ctx.cp) if ctx.to_seq else _heads_to_seq(grad, ctx.cp)), None, None


def heads_to_seq(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, n, s_l, d] (this rank's tokens, all heads) -> [b, n/CP, CP*s_l, d] (every rank's tokens in rank
    order, head group ``cp.rank``)."""
    return _AllToAll.apply(x, cp, True)


def seq_to_heads(y: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """The inverse of heads_to_seq."""
    return _AllToAll.apply(y, cp, False)
