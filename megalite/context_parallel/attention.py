"""Causal self-attention over a sequence split across the CP group (and packed-document masks).

``context_parallel_attention`` is the one entry point (the model's Attention calls it whenever the
sequence is split or documents are packed). The mask: query at global index i may attend key at
global index j iff j <= i and (no ``segment_ids`` or seg[j] == seg[i]). Three ways to move K/V:

    p2p         ring.py: K/V blocks passed around the ring, overlapped with the block in hand
    all_gather  all-gather K/V (reduce-scatter dK/dV), attend the local queries to all of it
    a2a         DeepSpeed-Ulysses: all-to-all to [full sequence, heads/CP], attend, all-to-all back

Where a mask is needed and dropout is off, attention runs in a variable-length kernel where one
applies (kernels.py, chosen by ``backend``: FlashAttention-2 on CUDA in fp16/bf16; the chunk pairs
become kernel calls in varlen.py), else tile by tile in fp32 (blocks.py); either way no [s, s] mask
or probability tensor is built. A causal mask in natural order without documents uses torch's SDPA
(is_causal). Attention dropout (all_gather, a2a, or one CP rank) draws
from the tracker's "tp" stream, like the model's attention; with a mask it builds the dense mask.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F

from megalite.context_parallel.blocks import Run, TiledAttention, concat_runs, layout_runs, tile_pairs, tile_size
from megalite.context_parallel.collectives import gather_kv, heads_to_seq, seq_to_heads
from megalite.context_parallel.kernels import kernel_for
from megalite.context_parallel.ring import RingAttention
from megalite.context_parallel.sequence import cp_token_index
from megalite.context_parallel.varlen import VarlenAttention, plans
from megalite.parallel.eager import eager
from megalite.parallel.state import AxisGroup

COMM_TYPES = ("p2p", "all_gather", "a2a")
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


@eager  # a ring of p2p exchanges: eager inside a compiled layer (one graph break)
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: AxisGroup,
    comm_type: str,
    q_index: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    tracker=None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal (and, with ``segment_ids``, per-document) attention of this CP rank's queries over the
    whole sequence's keys.

    q [b, nq, s_l, d]; k, v [b, nkv, s_l, d] (nkv divides nq); ``q_index`` [s_l] the global index of
    each local token, i.e. ``cp_token_index(s, cp.size, cp.rank)`` (chunks r and 2CP-1-r; every rank's
    K/V are laid out the same way); ``segment_ids`` [b, s] the FULL sequence's document ids. Returns
    [b, nq, s_l, d] in q's dtype; the softmax is accumulated in fp32. ``backend`` is
    --attention-backend (kernels.kernel_for): the kernel masked blocks run in; dropout always tiles
    or builds the dense mask (no varlen kernel here applies dropout).
    """
    _check(q, k, cp, comm_type, dropout_p)
    plain = cp.size == 1 and segment_ids is None  # SDPA's causal path: no kernel to choose
    kernel = kernel_for(backend, q) if dropout_p == 0 and not plain else None
    if cp.size == 1:
        s = q.shape[2]
        runs = [(0, 0, s)]
        seg = None if segment_ids is None else segment_ids.index_select(1, q_index)
        return _local(q, k, v, q_index, q_index, runs, runs, seg, seg, dropout_p, tracker, kernel, segment_ids)
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, cp, q_index, segment_ids, kernel)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, cp, q_index, segment_ids, dropout_p, tracker, kernel)
    return _a2a_attention(q, k, v, cp, segment_ids, dropout_p, tracker, kernel)


def _check(q: torch.Tensor, k: torch.Tensor, cp: AxisGroup, comm_type: str, dropout_p: float) -> None:
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    nq, nkv = q.shape[1], k.shape[1]
    if nq % nkv:
        raise ValueError(f"{nq} attention heads do not divide into {nkv} query groups")
    if cp.size == 1:
        return
    if q.shape[2] % 2:
        raise ValueError(
            f"a context-parallel rank holds two equal chunks of the sequence; its {q.shape[2]} "
            f"tokens do not split in two (--seq-length must divide by 2 x --context-parallel-size)"
        )
    if comm_type == "p2p" and dropout_p > 0:
        raise ValueError(
            f"--cp-comm-type p2p (ring attention) does not support attention dropout "
            f"(--attention-dropout {dropout_p}); set --attention-dropout 0 or use --cp-comm-type "
            f"all_gather or a2a"
        )
    if comm_type == "a2a" and (nq % cp.size or nkv % cp.size):
        raise ValueError(
            f"--cp-comm-type a2a splits the attention heads over the context-parallel group: "
            f"this rank's {nq} heads and {nkv} query groups must divide by --context-parallel-size "
            f"{cp.size}; use --cp-comm-type p2p or all_gather"
        )


def _fork(tracker, dropout_p: float):
    return tracker.fork("tp") if tracker is not None and dropout_p > 0 else contextlib.nullcontext()


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout_p: float, tracker
) -> torch.Tensor:
    """torch's SDPA: causal (natural order) when ``mask`` is None, else the boolean ``allowed`` mask."""
    kw = dict(attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p)
    rep = q.shape[1] // k.shape[1]
    with _fork(tracker, dropout_p):
        if rep == 1:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), **kw)


def _local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    q_runs: List[Run],
    k_runs: List[Run],
    seg_q: Optional[torch.Tensor],
    seg_k: Optional[torch.Tensor],
    dropout_p: float,
    tracker,
    kernel=None,
    segment_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of local queries over local keys, both described by runs of global indices;
    ``segment_ids`` the whole sequence's documents in natural order (for the kernel's segments)."""
    natural = q_runs == k_runs == [(0, 0, q.shape[2])]
    if seg_q is None and natural:
        return _sdpa(q, k, v, None, dropout_p, tracker)
    if kernel is not None:
        s = sum(n for _, _, n in k_runs)
        segs = plans(q_runs, k_runs, segment_ids, s, q.shape[0], q.device)
        if segs is not None:
            return VarlenAttention.apply(q, k, v, kernel, segs)
    if dropout_p > 0:  # dropout needs SDPA, hence a dense [b, 1, s_q, s_k] mask
        mask = (q_idx[:, None] >= k_idx[None, :])[None]
        if seg_q is not None:
            mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])
        return _sdpa(q, k, v, mask[:, None], dropout_p, tracker)
    pairs = tile_pairs(q_runs, k_runs, tile_size(seg_q is not None, q.device))
    return TiledAttention.apply(q, k, v, q_idx, k_idx, seg_q, seg_k, pairs)


def _rank_order_index(seq_len: int, cp: AxisGroup, device) -> torch.Tensor:
    """Global index of each position of a sequence gathered in rank order (each rank's two chunks)."""
    return torch.cat([cp_token_index(seq_len, cp.size, j, device) for j in range(cp.size)])


def _all_gather_attention(q, k, v, cp: AxisGroup, q_index, segment_ids, dropout_p, tracker, kernel) -> torch.Tensor:
    sl = q.shape[2]
    s = sl * cp.size
    kv = gather_kv(torch.stack([k, v]), cp)  # [2, b, nkv, s, d], rank order
    k_idx = _rank_order_index(s, cp, q.device)
    k_runs = concat_runs([layout_runs(s, cp.size, j) for j in range(cp.size)], sl)
    seg_q = seg_k = None
    if segment_ids is not None:
        seg_q, seg_k = segment_ids.index_select(1, q_index), segment_ids.index_select(1, k_idx)
    q_runs = layout_runs(s, cp.size, cp.rank)
    return _local(
        q, kv[0], kv[1], q_index, k_idx, q_runs, k_runs, seg_q, seg_k, dropout_p, tracker, kernel, segment_ids
    )


def _a2a_attention(q, k, v, cp: AxisGroup, segment_ids, dropout_p, tracker, kernel) -> torch.Tensor:
    b, nq, sl, d = q.shape
    s, n = sl * cp.size, cp.size
    heads = [nq // n, k.shape[1] // n, v.shape[1] // n]
    # one all-to-all for q, k and v: each destination's head group of all three, side by side
    packed = torch.cat([t.reshape(b, n, t.shape[1] // n, sl, d) for t in (q, k, v)], dim=2)
    full = heads_to_seq(packed.reshape(b, n * sum(heads), sl, d), cp)  # [b, sum(heads), s, d], rank order
    order = _rank_order_index(s, cp, q.device)
    qn, kn, vn = full.index_select(2, torch.argsort(order)).split(heads, dim=1)  # natural order
    index = torch.arange(s, device=q.device)
    runs = [(0, 0, s)]
    out = _local(
        qn, kn, vn, index, index, runs, runs, segment_ids, segment_ids, dropout_p, tracker, kernel, segment_ids
    )
    return seq_to_heads(out.index_select(2, order), cp)  # back to rank order, then to this rank's tokens
