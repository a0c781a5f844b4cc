"""Global gradient norm over the whole model, each parameter counted once.

A model-parallel rank holds a slice of the model: TP shards are summed over
the TP group, pipeline stages over the PP group, so the squared norms are
all-reduced over the model-parallel (tp x pp) group. Replicated parameters
(norms, row-parallel biases) appear on every TP rank and a tied embedding on
two stages; ``is_counted_once`` keeps one of each. Gradients are identical
across DP ranks after reduction, so DP does not take part.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.layers import is_counted_once


def global_grad_norm(params: Iterable[nn.Parameter], ps: ParallelState) -> float:
    """L2 norm of all gradients of the full model (same value on every rank)."""
    grads = [p.grad for p in params if p.grad is not None and is_counted_once(p, ps.tp_rank)]
    device = grads[0].device if grads else ps.device
    if grads:
        sq = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum()
    else:
        sq = torch.zeros((), device=device)
    sq = sq.reshape(1)
    if ps.mp.size > 1:  # recorded as the optimizer's norm is: a rank that never comes is named by the diagnosis
        ps.recorder.call("mp", dist.all_reduce, sq, group=ps.mp.group)
    return float(sq.sqrt())


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, ps: ParallelState) -> float:
    """Scale gradients so the global norm is at most ``max_norm``; return the norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params, ps)
    if max_norm > 0 and norm > max_norm and norm == norm:  # skip the scale on NaN
        coeff = max_norm / (norm + 1e-6)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coeff)
    return norm
