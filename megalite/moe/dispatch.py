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
    expert -> experts -> back by the inverse all-to-all -> x probs, summed per token (the ETP
    ranks' partial outputs add up there)

Backward mirrors both (the collectives are autograd functions; gather <-> reduce-scatter,
all-to-all <-> the all-to-all with splits swapped). Sorting, regrouping and the weighted sum back
run on the device (permute.py); the host reads the sizes once per dispatch, after the all-to-all
of the counts (the split sizes need them there), and never waits for the device otherwise. With --moe-pad-expert-input-to-capacity each
expert runs on a fixed number of rows (its capacity x the ranks that send to it).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.moe.experts import LocalExperts
from megalite.moe.permute import host_sizes, regroup_index, sort_by_expert, unpermute
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
        per_expert = local.sum(dim=0)
        counts = host_sizes(per_expert)  # the dispatch's one sync
        t_idx, e_idx = sort_by_expert(local, sum(counts))
        y = ex(xs.index_select(0, t_idx), counts, None if pad_to is None else pad_to * g.size, per_expert)
        out = unpermute(y, ps[t_idx, ex.first + e_idx], t_idx, xs)
        return reduce_scatter_to_sequence_parallel_region(out, g)


class _Plan(NamedTuple):
    """The sizes of one all-to-all dispatch, read from the device at once."""

    pairs: int  # (token, expert) pairs this rank routed
    per_expert: List[int]  # [E]: this rank's pairs per expert
    send: List[int]  # rows sent to each rank of the group
    recv: List[int]  # rows received from each
    counts: List[int]  # rows each local expert computes (all sources)
    recv_counts: torch.Tensor  # [sources, local experts], on the device


class AllToAllDispatcher:
    """Each (token, expert) pair travels to the ETP ranks of its expert's EP rank only."""

    def __init__(self, group: AxisGroup, experts: LocalExperts, etp: int):
        self.group, self.experts, self.etp = group, experts, etp

    def _plan(self, routing: torch.Tensor) -> _Plan:
        """Exchange the counts (on the device), then read every size the dispatch needs in one sync."""
        g, L = self.group, self.experts.num_local
        per_expert = routing.sum(dim=0)  # [E]
        # [G, L]: destination j = etp + ep * ETP gets the counts of EP rank ep's experts
        send_counts = per_expert.view(g.size // self.etp, L).repeat_interleave(self.etp, dim=0)
        recv_counts = all_to_all(send_counts.reshape(-1), g, [L] * g.size, [L] * g.size).view(g.size, L)
        sizes = host_sizes(torch.cat([per_expert, recv_counts.reshape(-1)]))
        per_e, recv_rows = sizes[: per_expert.numel()], sizes[per_expert.numel() :]
        by_source = [recv_rows[j * L : (j + 1) * L] for j in range(g.size)]
        send = [sum(per_e[(j // self.etp) * L : (j // self.etp + 1) * L]) for j in range(g.size)]
        counts = [sum(row[e] for row in by_source) for e in range(L)]
        return _Plan(sum(per_e), per_e, send, [sum(row) for row in by_source], counts, recv_counts)

    def _send_order(self, t_idx: torch.Tensor, e_idx: torch.Tensor, plan: _Plan) -> Tuple[torch.Tensor, torch.Tensor]:
        """The pairs in the order sent: EP rank ep's block (its experts' pairs) once per ETP rank."""
        if self.etp == 1:
            return t_idx, e_idx
        L, starts = self.experts.num_local, [0]
        for n in plan.per_expert:
            starts.append(starts[-1] + n)
        spans = [(starts[(j // self.etp) * L], starts[(j // self.etp + 1) * L]) for j in range(self.group.size)]
        return torch.cat([t_idx[a:b] for a, b in spans]), torch.cat([e_idx[a:b] for a, b in spans])

    def __call__(
        self, x: torch.Tensor, routing: torch.Tensor, probs: torch.Tensor, pad_to: Optional[int] = None
    ) -> torch.Tensor:
        g, ex = self.group, self.experts
        plan = self._plan(routing)
        t_send, e_send = self._send_order(*sort_by_expert(routing, plan.pairs), plan)
        tokens = x.index_select(0, t_send)
        received = _AllToAll.apply(tokens, g, plan.send, plan.recv) if g.size > 1 else tokens
        # received: per source rank, its rows for local expert 0, 1, ...: the experts want them expert-major
        regroup = g.size > 1 and ex.num_local > 1
        if regroup:
            dest = regroup_index(plan.recv_counts, sum(plan.recv))
            received = received.new_empty(received.shape).index_copy(0, dest, received)
        pad = None if pad_to is None else pad_to * g.size
        y = ex(received, plan.counts, pad, plan.recv_counts.sum(dim=0))
        back = y.index_select(0, dest) if regroup else y  # back to the order received
        returned = _AllToAll.apply(back, g, plan.recv, plan.send) if g.size > 1 else back
        return unpermute(returned, probs[t_send, e_send], t_send, x)
