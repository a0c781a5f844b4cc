"""Causal and packed-document attention of chunk pairs as variable-length kernel calls (kernels.py).

In the CP chunk layout (and in natural order) every (query chunk, key chunk) pair a rank attends is
DIAGONAL (the same global range: a causal square) or PAST (every key before every query). Documents
are contiguous runs of positions, so a DIAGONAL pair under the document mask is one causal square
per document piece, and a PAST pair is one full rectangle per batch row at most: the document that
holds the block's last key and the first query (a prefix of the queries attends a suffix of the keys).
Both are one varlen call with segments from the document boundaries (batch rows fold into the token
dimension); the rows of a PAST pair outside that rectangle are left out of the call (log-sum-exp
-inf, output 0 in the merge). No [s, s] tensor is built.

``plans`` works the segments out once per micro-batch (one host copy of ``segment_ids``) and caches
them on the tensor: every layer, and the backward, reuse them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from megalite.context_parallel.blocks import Run, grouped, merge
from megalite.context_parallel.kernels import scale_of


@dataclass
class Segments:
    """One kernel call: query slice ``qs`` and key slice ``ks`` of the local tensors, the cumulative
    lengths over the call's tokens, and ``rows`` (the [b * len(qs)] query tokens in the call; None: all)."""

    qs: slice
    ks: slice
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    rows: Optional[torch.Tensor]
    k_rows: Optional[torch.Tensor] = None  # the [b * len(ks)] key tokens in the call; None: all


def _doc_starts(segment_ids: Optional[torch.Tensor], b: int) -> Optional[List[np.ndarray]]:
    """Per row, the sorted positions where a document starts (always 0); None when a row's ids are not
    non-decreasing (a document split in pieces: the tiles handle that)."""
    if segment_ids is None:
        return [np.zeros(1, dtype=np.int64)] * b
    ids = segment_ids.detach().cpu().numpy()
    step = np.diff(ids, axis=1)
    if (step < 0).any():
        return None
    return [np.concatenate([[0], np.nonzero(row)[0] + 1]) for row in step]


def _diagonal(starts: List[np.ndarray], g: int, n: int) -> List[np.ndarray]:
    """Segment lengths per row of the causal square [g, g + n): the document pieces in it."""
    lengths = []
    for row in starts:
        inner = row[(row > g) & (row < g + n)]
        cuts = np.concatenate([[g], inner, [g + n]])
        lengths.append(np.diff(cuts))
    return lengths


def _past(starts: List[np.ndarray], s: int, qg: int, qn: int, kg: int, kn: int):
    """Per row (query prefix, key suffix) of the one document crossing from keys [kg, kg+kn) into queries
    [qg, qg+qn) (kg + kn <= qg), or (0, 0)."""
    out = []
    last = kg + kn - 1
    for row in starts:
        st = int(row[row <= last].max())
        later = row[row > last]
        en = int(later.min()) if later.size else s
        out.append((min(en, qg + qn) - qg, kg + kn - max(st, kg)) if en > qg else (0, 0))
    return out


def _cu(lengths: List[int], device) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def _pair(starts, s: int, b: int, q: Run, k: Run, device) -> Optional[Segments]:
    """The call of one DIAGONAL or PAST pair (None: no query attends a key of this pair)."""
    (qo, qg, qn), (ko, kg, kn) = q, k
    qs, ks = slice(qo, qo + qn), slice(ko, ko + kn)
    if (kg, kn) == (qg, qn):
        per_row = _diagonal(starts, qg, qn)
        lengths = np.concatenate(per_row)
        cu = _cu(lengths, device)
        return Segments(qs, ks, cu, cu, int(lengths.max()), int(lengths.max()), True, None)
    keep = [(i, a, c) for i, (a, c) in enumerate(_past(starts, s, qg, qn, kg, kn)) if a > 0]
    if not keep:
        return None
    rows = None
    if any(a < qn for _, a, _ in keep) or len(keep) < b:
        rows = torch.tensor(np.concatenate([np.arange(a) + i * qn for i, a, _ in keep]), device=device)
    ka = [a for _, a, _ in keep]
    kc = [c for _, _, c in keep]
    k_rows = None  # each row's keys: the suffix of its own kn keys
    if any(c < kn for c in kc) or len(keep) < b:
        k_rows = torch.tensor(np.concatenate([np.arange(kn - c, kn) + i * kn for i, _, c in keep]), device=device)
    return Segments(qs, ks, _cu(ka, device), _cu(kc, device), max(ka), max(kc), False, rows, k_rows)


def pair_plans(q_runs: List[Run], k_runs: List[Run], segment_ids, s: int, b: int, device) -> Optional[List[Segments]]:
    """The kernel calls of local queries (``q_runs``) over local keys (``k_runs``); None when a pair
    is neither DIAGONAL nor PAST, or the documents are not contiguous (the tiles run instead)."""
    starts = _starts_of(segment_ids, b)
    if starts is None:
        return None
    plans = []
    for q in q_runs:
        for k in k_runs:
            (_, qg, qn), (_, kg, kn) = q, k
            if kg >= qg + qn:  # wholly in the future
                continue
            if (kg, kn) != (qg, qn) and kg + kn > qg:
                return None
            seg = _pair(starts, s, b, q, k, device)
            if seg is not None:
                plans.append(seg)
    return plans


_cache: Dict[tuple, tuple] = {}
_CACHE_SIZE = 16
_last_starts: list = [None, None, None]  # (weak ref, version, starts) of the last segment_ids read to the host


def _starts_of(segment_ids: Optional[torch.Tensor], b: int) -> Optional[List[np.ndarray]]:
    """``_doc_starts``, remembered for the last tensor (a ring's blocks share one host copy)."""
    if segment_ids is None:
        return _doc_starts(None, b)
    ref, version, starts = _last_starts
    if ref is not None and ref() is segment_ids and version == segment_ids._version:
        return starts
    starts = _doc_starts(segment_ids, b)
    _last_starts[:] = [weakref.ref(segment_ids), segment_ids._version, starts]
    return starts


def plans(q_runs, k_runs, segment_ids: Optional[torch.Tensor], s: int, b: int, device) -> Optional[List[Segments]]:
    """``pair_plans``, cached per ``segment_ids`` tensor (one micro-batch: every layer and the backward)."""
    key = (
        id(segment_ids),
        None if segment_ids is None else segment_ids._version,
        tuple(q_runs),
        tuple(k_runs),
        s,
        b,
        str(device),
    )
    hit = _cache.get(key)
    if hit is not None and (segment_ids is None or hit[0]() is segment_ids):
        return hit[1]
    out = pair_plans(q_runs, k_runs, segment_ids, s, b, device)
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = ((lambda: None) if segment_ids is None else weakref.ref(segment_ids), out)
    return out


def _tokens(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """[b, n, L, d] -> [b * L, n, d] (contiguous), only ``rows`` of them when given."""
    b, n, L, d = x.shape
    t = x.transpose(1, 2).reshape(b * L, n, d)
    return t if rows is None else t.index_select(0, rows)


def _lse_tokens(lse: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """[b, n, L] -> [n, b * L] (contiguous), only ``rows`` when given."""
    b, n, L = lse.shape
    t = lse.permute(1, 0, 2).reshape(n, b * L)
    return (t if rows is None else t.index_select(1, rows)).contiguous()


def _untoken(t: torch.Tensor, b: int, L: int, rows: Optional[torch.Tensor], fill: float) -> torch.Tensor:
    """[T, n, ...] tokens of a call -> [b, n, L, ...], rows outside the call ``fill``."""
    if rows is not None:
        full = torch.full((b * L, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        t = full.index_copy_(0, rows, t)
    return t.view(b, L, *t.shape[1:]).transpose(1, 2)


def block_forward(kernel, q, k, v, seg: Segments) -> Tuple[torch.Tensor, torch.Tensor]:
    """One call: q [b, nq, Lq, d], k/v [b, nkv, Lk, d] (the pair's slices) -> (out [b, nq, Lq, d] in
    q's dtype, lse [b, nq, Lq] fp32; rows outside the call 0 and -inf)."""
    b, _, lq, _ = q.shape
    kt, vt = _tokens(k, seg.k_rows), _tokens(v, seg.k_rows)
    o, lse = kernel.forward(
        _tokens(q, seg.rows), kt, vt, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, seg.causal, scale_of(q)
    )
    lse = _untoken(lse.t(), b, lq, seg.rows, float("-inf"))  # [b, nq, Lq]
    return _untoken(o, b, lq, seg.rows, 0.0), lse


def block_backward(kernel, q, k, v, do, out, lse, seg: Segments):
    """dq [b, nq, Lq, d], dk and dv [b, nkv, Lk, d] of one call, from the rows' FINAL out and lse."""
    b, _, lq, _ = q.shape
    lk = k.shape[2]
    dq, dk, dv = kernel.backward(
        _tokens(do, seg.rows),
        _tokens(q, seg.rows),
        _tokens(k, seg.k_rows),
        _tokens(v, seg.k_rows),
        _tokens(out, seg.rows),
        _lse_tokens(lse, seg.rows),
        seg.cu_q,
        seg.cu_k,
        seg.max_q,
        seg.max_k,
        seg.causal,
        scale_of(q),
    )
    return (
        _untoken(dq, b, lq, seg.rows, 0.0),
        _untoken(dk, b, lk, seg.k_rows, 0.0),
        _untoken(dv, b, lk, seg.k_rows, 0.0),
    )


def forward_all(kernel, q, k, v, segs: List[Segments]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every call of ``segs`` merged: (out [b, nq, sq, d] in q's dtype, lse [b, nq, sq] fp32)."""
    if len(segs) == 1 and segs[0].rows is None and segs[0].qs == slice(0, q.shape[2]):
        s0 = segs[0]
        return block_forward(kernel, q, k[:, :, s0.ks], v[:, :, s0.ks], s0)
    g = k.shape[1]
    out = torch.zeros(grouped(q, g).shape, dtype=torch.float32, device=q.device)
    lse = torch.full(out.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for seg in segs:
        o, l = block_forward(kernel, q[:, :, seg.qs], k[:, :, seg.ks], v[:, :, seg.ks], seg)
        merge(out, lse, seg.qs, grouped(o, g), l.reshape(out.shape[:-2] + l.shape[-1:]))
    return out.view(q.shape).to(q.dtype), lse.view(q.shape[:-1])


class VarlenAttention(torch.autograd.Function):
    """forward(q [b,nq,sq,d], k/v [b,nkv,sk,d], kernel, segs) -> out [b,nq,sq,d]: local queries over
    local keys in kernel calls (the one-rank packed path, all_gather and a2a under CP)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, segs):
        out, lse = forward_all(kernel, q, k, v, segs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.segs = kernel, segs
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        whole = (slice(0, q.shape[2]), slice(0, k.shape[2]))
        if len(ctx.segs) == 1 and (ctx.segs[0].qs, ctx.segs[0].ks) == whole:  # one call over everything
            return (*block_backward(ctx.kernel, q, k, v, grad, out, lse, ctx.segs[0]), None, None)
        parts = []
        for seg in ctx.segs:
            qs, ks = seg.qs, seg.ks
            grads = block_backward(
                ctx.kernel, q[:, :, qs], k[:, :, ks], v[:, :, ks], grad[:, :, qs], out[:, :, qs], lse[:, :, qs], seg
            )
            parts.append((seg, *grads))
        return (*_place(q, k, v, parts), None, None)


def _place(q, k, v, parts):
    """Sum the calls' gradients into fp32 tensors of the inputs' shapes, then cast to their dtypes."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for seg, a, bk, bv in parts:
        dq[:, :, seg.qs] += a
        dk[:, :, seg.ks] += bk
        dv[:, :, seg.ks] += bv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
