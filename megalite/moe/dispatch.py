"""Token dispatch: routed tokens to the ranks holding their experts and back (forward and backward).

Tokens are exchanged within the expert model-parallel group (``ps.expert_mp`` = ETP x EP ranks,
index ``etp_rank + ep_rank * ETP``). Every rank of it routes its own tokens (sequence-parallel
and context-parallel shards, and other data-parallel micro-batches, are all distinct tokens).

allgather (Megatron's default)::

    x [T, h], routing [T, E], probs [T, E] --all-gather over expert_mp--> [G*T, ...]
    each local expert e: its rows of the gathered tokens -> expert -> x probs -> summed per token
    --reduce-scatter over expert_mp--> [T, h] (sums the EP ranks' experts and the ETP partial sums)

alltoall::

    (token, expert) pairs sorted by expert; the pairs of expert e go to every ETP rank of EP rank
    e // (E/EP) (all-to-all over expert_mp, split sizes exchanged first) -> regrouped by local
    expert -> experts -> back by the inverse all-to-all -> x probs, summed per token (index_add:
    the ETP ranks' partial outputs add up there)

Backward mirrors both (the collectives are autograd functions; gather <-> reduce-scatter,
all-to-all <-> the all-to-all with splits swapped). With --moe-pad-expert-input-to-capacity each
expert runs on a fixed number of rows (its capacity x the ranks that send to it).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.moe.experts import LocalExperts
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.comms import (
    all_gather_first,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split ``send`` per rank of ``group``; receives ``recv`` rows from each."""

    @staticmethod
    def forward(ctx, x, group: AxisGroup, send: List[int], recv: List[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def all_to_all(x: torch.Tensor, group: AxisGroup, send: List[int], recv: List[int]) -> torch.Tensor:
    """The plain (non-autograd) exchange of :class:`_AllToAll`."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    group.collective(dist.all_to_all_single, out, x, recv, send)
    return out


class AllGatherDispatcher:
    """Every rank of expert_mp sees every token of the group; the outputs are reduce-scattered back."""

    def __init__(self, group: AxisGroup, experts: LocalExperts):
        self.group, self.experts = group, experts

    def __call__(
        self, x: torch.Tensor, routing: torch.Tensor, probs: torch.Tensor, pad_to: Optional[int] = None
    ) -> torch.Tensor:
        g = self.group
        xs = gather_from_sequence_parallel_region(x, g)
        ps = gather_from_sequence_parallel_region(probs, g)
        rs = all_gather_first(routing, g)
        ex = self.experts
        local = rs[:, ex.first : ex.first + ex.num_local]
        e_idx, t_idx = local.t().nonzero(as_tuple=True)  # sorted by local expert, then token
        counts = torch.bincount(e_idx, minlength=ex.num_local).tolist()
        y = ex(xs.index_select(0, t_idx), counts, None if pad_to is None else pad_to * g.size)
        weight = ps[t_idx, ex.first + e_idx].unsqueeze(-1)
        out = torch.zeros_like(xs).index_add(0, t_idx, (y * weight).to(xs.dtype))
        return reduce_scatter_to_sequence_parallel_region(out, g)


class AllToAllDispatcher:
    """Each (token, expert) pair travels to the ETP ranks of its expert's EP rank only."""

    def __init__(self, group: AxisGroup, experts: LocalExperts, etp: int):
        self.group, self.experts, self.etp = group, experts, etp

    def _plan(self, routing: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, List[int], List[int], torch.Tensor]:
        """(token of each pair, expert of each pair, rows sent per rank, rows received per rank,
        counts received [sources, local experts])."""
        g, ex = self.group, self.experts
        e_idx, t_idx = routing.t().nonzero(as_tuple=True)  # sorted by expert, then token
        per_expert = torch.bincount(e_idx, minlength=routing.shape[1])  # [E]
        ep = g.size // self.etp
        by_ep = per_expert.view(ep, ex.num_local)  # [EP, local experts]
        send_counts = by_ep.repeat_interleave(self.etp, dim=0)  # [G, local]: dest j = etp + ep * ETP
        recv_counts = all_to_all(send_counts.reshape(-1), g, [ex.num_local] * g.size, [ex.num_local] * g.size).view(
            g.size, ex.num_local
        )
        starts = torch.cat([per_expert.new_zeros(1), per_expert.cumsum(0)])
        spans = [(int(starts[e * ex.num_local]), int(starts[(e + 1) * ex.num_local])) for e in range(ep)]
        order = torch.cat([torch.arange(*spans[j // self.etp], device=routing.device) for j in range(g.size)])
        send = send_counts.sum(dim=1).tolist()
        recv = recv_counts.sum(dim=1).tolist()
        return t_idx[order], e_idx[order], send, recv, recv_counts

    def __call__(
        self, x: torch.Tensor, routing: torch.Tensor, probs: torch.Tensor, pad_to: Optional[int] = None
    ) -> torch.Tensor:
        g, ex = self.group, self.experts
        t_send, e_send, send, recv, recv_counts = self._plan(routing)
        tokens = x.index_select(0, t_send)
        received = _AllToAll.apply(tokens, g, send, recv) if g.size > 1 else tokens
        # received: per source rank, its rows for local expert 0, 1, ...: regroup by expert
        key = (
            torch.arange(ex.num_local, device=x.device)[None, :] * g.size
            + torch.arange(g.size, device=x.device)[:, None]
        )  # block (source, expert) -> expert-major order
        regroup = torch.argsort(torch.repeat_interleave(key.reshape(-1), recv_counts.reshape(-1)), stable=True)
        counts = recv_counts.sum(dim=0).tolist()
        y = ex(received.index_select(0, regroup), counts, None if pad_to is None else pad_to * g.size)
        back = y.index_select(0, torch.argsort(regroup))  # back to the order received
        returned = _AllToAll.apply(back, g, recv, send) if g.size > 1 else back
        weight = probs[t_send, e_send].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, t_send, (returned * weight).to(x.dtype))
