"""Ring attention (``--cp-comm-type p2p``): K/V blocks travel around the CP ring.

Step t on CP rank r holds the K/V of rank (r - t) mod CP. Before attending to it, the rank starts
sending it on to rank r+1 and receiving the next one from rank r-1 (isend/irecv in one
batch_isend_irecv), so the transfer runs behind the block's attention. Partial outputs merge with
their log-sum-exp (blocks.py). Only the nkv K/V groups travel, never copies for the nq heads.

With the 2 x CP chunk layout every step costs the same: the own block is the causal diagonal; a block
from an earlier rank j < r is attended by all local queries but only through its first chunk (its
second lies in every local query's future); a block from a later rank is attended in full, but only
by the second local chunk. Without documents those two are unmasked (no mask is built).

The backward runs the ring again: K/V travel as in the forward, and next to them an fp32 dK/dV
accumulator for that block; each rank adds its contribution and passes it on, one hop behind the
K/V (so its transfer overlaps the next block's compute). After CP steps and one last hop every
accumulator is back with its block's owner, holding every rank's contribution.

With a kernel (kernels.py; FlashAttention-2 varlen on CUDA in fp16/bf16) each block is one or two
varlen calls (varlen.py: the causal diagonal, the past chunk), each returning its log-sum-exp for
the merge; the backward calls the kernel's backward with the rows' final output and log-sum-exp.
Without one, the tiles of blocks.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megalite.context_parallel.blocks import (
    fused,
    grouped,
    layout_runs,
    merge,
    tile_backward,
    tile_forward,
    tile_mask,
    tile_pairs,
    tile_size,
)
from megalite.context_parallel.sequence import cp_token_index
from megalite.context_parallel.varlen import block_backward, block_forward, plans
from megalite.parallel.state import AxisGroup

_KV_TAG, _DKV_TAG = 7, 8


@dataclass
class RingTiming:
    """Seconds the ring spent waiting for transfers, and in total (benchmarks set ``ring.timing``)."""

    wait_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0


timing: Optional[RingTiming] = None  # off unless a benchmark sets it


def exchange(cp: AxisGroup, send: torch.Tensor, recv: torch.Tensor, tag: int):
    """Start sending ``send`` to the next CP rank and receiving ``recv`` from the previous one; the handle
    waits for both. Recorded as a collective of the CP group (every member exchanges in the same order),
    so a rank stuck in the ring names the rank it waits for."""
    nxt, prv = cp.ranks[(cp.rank + 1) % cp.size], cp.ranks[(cp.rank - 1) % cp.size]
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, nxt, cp.group, tag), dist.P2POp(dist.irecv, recv, prv, cp.group, tag)]
    )
    return cp.started("ring_exchange", works)


def _wait(works) -> None:
    t0 = time.perf_counter()
    works.wait()
    if timing is not None:
        timing.wait_s += time.perf_counter() - t0


class _Plan:
    """What each ring step attends: the tile pairs, indices and documents of the K/V block of each rank."""

    def __init__(
        self, cp: AxisGroup, seq_len: int, q_index: torch.Tensor, segment_ids: Optional[torch.Tensor], b: int, kernel
    ):
        self.q_idx = q_index
        q_runs = layout_runs(seq_len, cp.size, cp.rank)
        self.kernel, self.calls = kernel, None
        if kernel is not None:  # the kernel calls of each source rank's block (None: documents in pieces)
            self.calls = [
                plans(q_runs, layout_runs(seq_len, cp.size, j), segment_ids, seq_len, b, q_index.device)
                for j in range(cp.size)
            ]
            if any(c is None for c in self.calls):
                self.calls = None
        if self.calls is not None:
            return
        self.k_idx = [cp_token_index(seq_len, cp.size, j, q_index.device) for j in range(cp.size)]
        tile = tile_size(segment_ids is not None, q_index.device)
        self.pairs = [tile_pairs(q_runs, layout_runs(seq_len, cp.size, j), tile) for j in range(cp.size)]
        self.seg_q = None if segment_ids is None else segment_ids.index_select(1, q_index)
        self.seg_k = [None if segment_ids is None else segment_ids.index_select(1, i) for i in self.k_idx]

    def mask(self, src: int, pair):
        return tile_mask(pair, self.q_idx, self.k_idx[src], self.seg_q, self.seg_k[src])


class RingAttention(torch.autograd.Function):
    """forward(q [b,nq,s_l,d], k/v [b,nkv,s_l,d], cp, q_index [s_l], segment_ids [b, s] | None, kernel
    (kernels.py; None: tiles))."""

    @staticmethod
    def forward(ctx, q, k, v, cp, q_index, segment_ids, kernel=None):
        t0 = time.perf_counter()
        b, nq, sl, d = q.shape
        g, scale = k.shape[1], 1.0 / math.sqrt(d)
        q = q.contiguous()  # saved on its own: a view would keep the whole fused qkv projection alive
        plan = _Plan(cp, sl * cp.size, q_index, segment_ids, b, kernel)
        q32 = grouped(q, g) if plan.calls is None else q.view(b, g, nq // g, sl, d)  # fp32 copy for tiles only
        out = torch.zeros(q32.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q32.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = own = torch.stack([k, v])  # the travelling block, in the input dtype; saved instead of k and v
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            if step + 1 < cp.size:
                nxt = torch.empty_like(kv)
                works = exchange(cp, kv, nxt, _KV_TAG)
            if plan.calls is not None:
                _kernel_block(plan, plan.calls[src], q, kv, out, lse)
            else:
                k32, v32 = kv[0].float(), kv[1].float()
                for pair in plan.pairs[src]:
                    qs, ks, _ = pair
                    o, l = tile_forward(q32[..., qs, :], k32[..., ks, :], v32[..., ks, :], *plan.mask(src, pair), scale)
                    merge(out, lse, qs, o, l)
            if step + 1 < cp.size:
                _wait(works)
                kv = nxt
        out = out.view(b, nq, sl, d).to(q.dtype)
        ctx.save_for_backward(q, own, out, lse)
        ctx.cp, ctx.plan = cp, plan
        if timing is not None:
            timing.total_s += time.perf_counter() - t0
            timing.steps += cp.size
        return out

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        q, kv, out, lse = ctx.saved_tensors
        cp, plan = ctx.cp, ctx.plan
        g, dtype = kv.shape[2], kv.dtype
        grads = _Grads(plan, q, grad, out, lse, g)
        dq = torch.zeros((*lse.shape, q.shape[-1]), dtype=torch.float32, device=q.device)  # [b, g, r, s_l, d]
        dkv_works, dkv_in, dkv_out = None, None, None
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            if step + 1 < cp.size:
                nxt = torch.empty_like(kv)
                works = exchange(cp, kv, nxt, _KV_TAG)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            grads.block(src, kv, dq, dkv)
            if dkv_works is not None:  # the other ranks' contributions to this block, one hop behind
                _wait(dkv_works)
                dkv += dkv_in
            dkv_out, dkv_in = dkv, torch.empty_like(dkv)
            dkv_works = exchange(cp, dkv_out, dkv_in, _DKV_TAG)
            if step + 1 < cp.size:
                _wait(works)
                kv = nxt
        _wait(dkv_works)  # the last hop brings this rank's own block's dK/dV home
        if timing is not None:
            timing.total_s += time.perf_counter() - t0
            timing.steps += cp.size
        return (dq.view(q.shape).to(q.dtype), dkv_in[0].to(dtype), dkv_in[1].to(dtype), None, None, None, None)


def _kernel_block(plan: _Plan, calls, q, kv, out, lse) -> None:
    """Forward of one K/V block in kernel calls, merged into the running fp32 (out, lse) [b,g,r,s_l,...]."""
    for seg in calls:
        qs, ks = seg.qs, seg.ks
        o, l = block_forward(plan.kernel, q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], seg)
        merge(out, lse, qs, o.float().reshape(out[..., qs, :].shape), l.reshape(lse[..., qs].shape))


class _Grads:
    """One K/V block's contribution to dq (fp32 [b,g,r,s_l,d]) and to its own dK/dV (fp32 [2,b,nkv,s_l,d])."""

    def __init__(self, plan: _Plan, q, grad, out, lse, g: int):
        self.plan, self.q, self.grad, self.out = plan, q, grad, out
        self.lse = lse.reshape(q.shape[:-1])  # [b, nq, s_l]
        self.lse_g = lse
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.delta = None
        if plan.calls is None:  # the tiles' fp32 operands
            self.q32, self.do, self.out32 = grouped(q, g), grouped(grad, g), grouped(out, g)
            self.delta = None if fused(q.device) else (self.do * self.out32).sum(-1)

    def block(self, src: int, kv, dq, dkv) -> None:
        plan = self.plan
        if plan.calls is not None:
            for seg in plan.calls[src]:
                qs, ks = seg.qs, seg.ks
                a, bk, bv = block_backward(
                    plan.kernel,
                    self.q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    self.grad[:, :, qs],
                    self.out[:, :, qs],
                    self.lse[:, :, qs],
                    seg,
                )
                dq[..., qs, :] += a.float().reshape(dq[..., qs, :].shape)
                dkv[0][..., ks, :] += bk
                dkv[1][..., ks, :] += bv
            return
        k32, v32 = kv[0].float(), kv[1].float()
        for pair in plan.pairs[src]:
            qs, ks, _ = pair
            a, bk, bv = tile_backward(
                self.q32[..., qs, :],
                k32[..., ks, :],
                v32[..., ks, :],
                self.do[..., qs, :],
                self.out32[..., qs, :],
                self.lse_g[..., qs],
                None if self.delta is None else self.delta[..., qs],
                *plan.mask(src, pair),
                self.scale,
            )
            dq[..., qs, :] += a
            dkv[0][..., ks, :] += bk
            dkv[1][..., ks, :] += bv
