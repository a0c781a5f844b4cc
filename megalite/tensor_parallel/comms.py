"""Autograd-aware collectives over the tensor-parallel group.

The four Megatron primitives, each the other's adjoint::

    copy_to_tp_region      fwd: identity            bwd: all-reduce
    reduce_from_tp_region  fwd: all-reduce          bwd: identity
    scatter_to_tp_region   fwd: keep my slice (-1)  bwd: all-gather (-1)
    gather_from_tp_region  fwd: all-gather (-1)     bwd: keep my slice (-1)

A ColumnParallelLinear enters the region with ``copy_to``; a RowParallelLinear
leaves it with ``reduce_from``. Under sequence parallelism activations outside
the region are split along the sequence (dim 0) and the pair becomes::

    gather_from_sequence_parallel_region      fwd: all-gather (0)     bwd: reduce-scatter (0)
    reduce_scatter_to_sequence_parallel_region fwd: reduce-scatter (0) bwd: all-gather (0)
With a group of size 1 every function is the identity, so the single-process model runs the same
code. Every collective goes through its AxisGroup (``g.collective``): the flight recorder sees it.
Inside a compiled layer (--compile) each of the six region functions is one clean graph break
(``_region``, parallel/eager.py): the collective and its autograd node run eagerly between two graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.eager import eager
from megalite.parallel.state import AxisGroup

# Flat-tensor collectives: newer torch names them *_single and deprecates the *_tensor names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    x = x.contiguous()
    g.collective(dist.all_reduce, x)
    return x


def _split_last(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    return x.chunk(g.size, dim=-1)[g.rank].contiguous()


def _gather_last(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(g.size)]
    g.collective(dist.all_gather, parts, x)
    return torch.cat(parts, dim=-1)


def all_gather_first(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (the sequence)."""
    if g.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * g.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    g.collective(all_gather_flat, out, x)
    return out


def reduce_scatter_first(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Sum over ranks, each keeping its 1/size slice of dim 0."""
    if g.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // g.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    g.collective(reduce_scatter_flat, out, x)
    return out


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return all_gather_first(x, g)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first(grad, ctx.g), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return reduce_scatter_first(x, g)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first(grad, ctx.g), None


@eager
def _region(fn: type, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``fn.apply(x, g)`` (one of the autograd functions here), run eagerly when dynamo traces the caller."""
    return fn.apply(x, g)


def gather_from_sequence_parallel_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """All-gather along the sequence (dim 0) forward; reduce-scatter of the gradient backward."""
    return x if g.size == 1 else _region(_GatherFromSequence, x, g)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Reduce-scatter along the sequence (dim 0) forward; all-gather of the gradient backward."""
    return x if g.size == 1 else _region(_ReduceScatterToSequence, x, g)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.g), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        # clone: all_reduce works in place and x may be needed by autograd elsewhere.
        return _all_reduce(x.clone(), g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split_last(x, g)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.g), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _gather_last(x, g)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.g), None


def copy_to_tp_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return x if g.size == 1 else _region(_CopyToRegion, x, g)


def reduce_from_tp_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return x if g.size == 1 else _region(_ReduceFromRegion, x, g)


def scatter_to_tp_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather backward."""
    return x if g.size == 1 else _region(_ScatterToRegion, x, g)


def gather_from_tp_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice backward."""
    return x if g.size == 1 else _region(_GatherFromRegion, x, g)
