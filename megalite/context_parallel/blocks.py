"""Blockwise attention with a log-sum-exp (the arithmetic the ring and the masked local path share).

Queries and keys are described by *runs*: ``(local offset, global start, length)`` of consecutive
global indices (a CP rank's two chunks are two runs; a natural-order sequence is one). Runs are cut
into tiles; a tile pair entirely in the future is skipped, one entirely in the past needs no causal
mask (and, without documents, no mask at all: the fast path), the rest get a mask built on the fly
from the index and document tensors, so no [s, s] mask ever exists. A tile pair on the diagonal
(same global range) needs only the square causal mask.

Arithmetic in fp32 whatever the inputs' dtype. Queries are grouped by the K/V group they read
(grouped-query attention without copying K/V): q is viewed as [b, g, r, s, d] (g = nkv groups,
r = nq / nkv heads per group). A tile's output is normalised, with its log-sum-exp; ``merge`` folds
it into the running output (online softmax). The backward recomputes each tile's probabilities from
the final log-sum-exp (FlashAttention's recipe), so only q, k, v, the output and the LSE are saved.

On CPU a tile runs in torch's fused flash kernel (the one SDPA uses; it returns the LSE, and its
backward takes the final output and LSE) when this torch has it; elsewhere, explicit fp32 matmuls.
Without documents, tiles are whole chunks (the kernel blocks internally); with a mask, 1024 tokens.
"""

from __future__ import annotations

import math
from typing import Iterator, List, Optional, Tuple

import torch

Run = Tuple[int, int, int]  # (local offset, global start, length)
Pair = Tuple[slice, slice, int]  # (query slice, key slice, PAST | DIAGONAL | CAUSAL)
PAST, DIAGONAL, CAUSAL = 0, 1, 2  # all keys before all queries; the same range (square causal); any other
TILE = 1024  # tokens per tile side where a mask is materialised

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
if (
    _FLASH is None
    or _FLASH_BWD is None
    or not all("attn_mask" in str(op.default._schema) for op in (_FLASH, _FLASH_BWD))
):
    _FLASH = _FLASH_BWD = None


def fused(device: torch.device) -> bool:
    """Whether tiles on ``device`` run in torch's fused CPU flash-attention kernel."""
    return _FLASH is not None and device.type == "cpu"


def tile_size(masked: bool, device: torch.device) -> int:
    """Tile side: whole chunks when the fused kernel runs unmasked tiles, else TILE."""
    return TILE if masked or not fused(device) else 1 << 40


def layout_runs(seq_len: int, cp_size: int, cp_rank: int) -> List[Run]:
    """The runs of CP rank ``cp_rank``'s tokens: chunks r and 2CP-1-r (one run when cp_size is 1)."""
    if cp_size == 1:
        return [(0, 0, seq_len)]
    c = seq_len // (2 * cp_size)
    return [(0, cp_rank * c, c), (c, (2 * cp_size - 1 - cp_rank) * c, c)]


def concat_runs(runs_per_part: List[List[Run]], part_len: int) -> List[Run]:
    """Runs of several parts laid one after the other (an all-gather's output in rank order)."""
    return [(i * part_len + off, start, n) for i, runs in enumerate(runs_per_part) for off, start, n in runs]


def _tiles(runs: List[Run], tile: int) -> Iterator[Run]:
    for off, start, n in runs:
        for t in range(0, n, tile):
            yield off + t, start + t, min(tile, n - t)


def tile_pairs(q_runs: List[Run], k_runs: List[Run], tile: int = TILE) -> List[Pair]:
    """Every (query tile, key tile) that causal attention touches, with the mask it needs (PAST: none)."""
    pairs = []
    for qo, qg, qn in _tiles(q_runs, tile):
        for ko, kg, kn in _tiles(k_runs, tile):
            if kg > qg + qn - 1:  # every key after every query: nothing to attend
                continue
            kind = PAST if kg + kn - 1 <= qg else DIAGONAL if (kg, kn) == (qg, qn) else CAUSAL
            pairs.append((slice(qo, qo + qn), slice(ko, ko + kn), kind))
    return pairs


def tile_mask(
    pair: Pair, q_idx: torch.Tensor, k_idx: torch.Tensor, seg_q: Optional[torch.Tensor], seg_k: Optional[torch.Tensor]
) -> Tuple[Optional[torch.Tensor], bool]:
    """(allowed, causal) of one tile pair: ``allowed`` a boolean [b or 1, 1, 1, sq, sk] mask or None;
    ``causal`` True for a diagonal tile without documents (the square causal mask, left implicit)."""
    qs, ks, kind = pair
    if seg_q is None:
        if kind == CAUSAL:
            return (q_idx[qs, None] >= k_idx[None, ks])[None, None, None], False
        return None, kind == DIAGONAL
    allowed = seg_q[:, qs, None] == seg_k[:, None, ks]
    if kind != PAST:
        allowed = allowed & (q_idx[qs, None] >= k_idx[None, ks])[None]
    return allowed[:, None, None], False


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """LSE with -inf (a row that attends nothing in this tile) replaced by 0, so exp(-inf - 0) = 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _scores(
    q: torch.Tensor, k: torch.Tensor, allowed: Optional[torch.Tensor], causal: bool, scale: float
) -> torch.Tensor:
    """q [b, g, r, sq, d], k [b, g, sk, d] -> masked scaled scores [b, g, r, sq, sk] (fp32)."""
    b, g, r, sq, d = q.shape
    s = torch.matmul(q.reshape(b, g, r * sq, d), k.transpose(-1, -2)).mul_(scale).view(b, g, r, sq, -1)
    if causal:
        allowed = torch.ones(sq, s.shape[-1], dtype=torch.bool, device=q.device).tril_()
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


def _fused_args(q, k, v, allowed, causal, *rows):
    """The flash kernel's [batch, heads, rows, d] operands: a causal tile repeats K/V per query head (its
    mask is per head row); any other tile folds the r heads of a group into the rows (one K/V per group)."""
    b, g, r, sq, d = q.shape
    if causal and r > 1:
        k, v = (t.unsqueeze(2).expand(b, g, r, *t.shape[2:]).reshape(b, g * r, -1, d) for t in (k, v))
        shape = (b, g * r, sq)
    else:
        shape = (b, g, r * sq)
    mask = None
    if allowed is not None:  # additive float mask, rows repeated for the folded heads
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        mask = mask.expand(mask.shape[0], 1, r, sq, mask.shape[-1]).reshape(mask.shape[0], 1, r * sq, -1)
    rows = [x.reshape(*shape, *x.shape[4:]) for x in (q, *rows)]
    return rows, k, v, mask


def tile_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], causal: bool, scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Normalised output [b, g, r, sq, d] and log-sum-exp [b, g, r, sq] of one tile."""
    b, g, r, sq, d = q.shape
    if fused(q.device):
        (qf,), kf, vf, mask = _fused_args(q, k, v, allowed, causal)
        o, lse = _FLASH(qf, kf, vf, 0.0, causal, attn_mask=mask, scale=scale)
        lse = lse.reshape(b, g, r, sq)
        if allowed is not None:  # the kernel gives rows that attend nothing lse 0; the merge needs -inf
            lse = lse.masked_fill(~allowed.any(-1), float("-inf"))
        return o.reshape(b, g, r, sq, d), lse
    s = _scores(q, k, allowed, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp_(s.sub_(_finite(lse).unsqueeze(-1)))
    return torch.matmul(p.view(b, g, r * sq, -1), v).view(b, g, r, sq, d), lse


def merge(out: torch.Tensor, lse: torch.Tensor, qs: slice, o: torch.Tensor, l: torch.Tensor) -> None:
    """Fold a tile's (o, l) into rows ``qs`` of the running (out, lse), in place (online softmax)."""
    old = lse[..., qs]
    new = torch.logaddexp(old, l)
    safe = _finite(new)
    out[..., qs, :] = out[..., qs, :] * torch.exp(old - safe).unsqueeze(-1) + o * torch.exp(l - safe).unsqueeze(-1)
    lse[..., qs] = new


def tile_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: Optional[torch.Tensor],
    allowed: Optional[torch.Tensor],
    causal: bool,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [b,g,r,sq,d], dk [b,g,sk,d], dv [b,g,sk,d]) of one tile; ``out``, ``lse`` and ``delta``
    (sum(dout * out); None on the fused path, whose kernel works it out) are the rows' final values, not
    the tile's."""
    b, g, r, sq, d = q.shape
    if fused(q.device):
        (qf, dof, of, lsef), kf, vf, mask = _fused_args(q, k, v, allowed, causal, do, out, lse)
        dq, dk, dv = _FLASH_BWD(dof, qf, kf, vf, of, lsef, 0.0, causal, attn_mask=mask, scale=scale)
        if dk.shape[1] != g:  # K/V were repeated per head: sum the heads of each group
            dk, dv = (x.reshape(b, g, r, -1, d).sum(2) for x in (dk, dv))
        return dq.reshape(b, g, r, sq, d), dk, dv
    p = torch.exp_(_scores(q, k, allowed, causal, scale).sub_(_finite(lse).unsqueeze(-1)))
    do2 = do.reshape(b, g, r * sq, d)
    p2 = p.view(b, g, r * sq, -1)
    dv = torch.matmul(p2.transpose(-1, -2), do2)
    dp = torch.matmul(do2, v.transpose(-1, -2)).view(b, g, r, sq, -1)
    ds = p.mul_(dp.sub_(delta.unsqueeze(-1))).view(b, g, r * sq, -1)  # softmax backward, reusing p
    dk = torch.matmul(ds.transpose(-1, -2), q.reshape(b, g, r * sq, d)).mul_(scale)
    dq = torch.matmul(ds, k).mul_(scale).view(b, g, r, sq, d)
    return dq, dk, dv


def grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, nq, s, d] -> fp32 [b, g, nq/g, s, d] (a view when already fp32 and contiguous)."""
    b, n, s, d = x.shape
    return x.float().reshape(b, groups, n // groups, s, d)


class TiledAttention(torch.autograd.Function):
    """Masked causal attention of local queries over local keys, tile by tile (no [s, s] tensor kept).

    forward(q [b,nq,sq,d], k/v [b,nkv,sk,d], q_idx [sq], k_idx [sk], seg_q [b,sq] | None,
    seg_k [b,sk] | None, pairs) -> out [b,nq,sq,d] in q's dtype. Every query must attend at least
    one key (itself, in causal self-attention).
    """

    @staticmethod
    def forward(ctx, q, k, v, q_idx, k_idx, seg_q, seg_k, pairs):
        b, nq, sq, d = q.shape
        g = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        q = q.contiguous()  # saved on its own: a view would keep the whole fused qkv projection alive
        q32, k32, v32 = grouped(q, g), k.float(), v.float()
        out = torch.zeros_like(q32)
        lse = torch.full(q32.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for pair in pairs:
            o, l = tile_forward(
                q32[..., pair[0], :],
                k32[..., pair[1], :],
                v32[..., pair[1], :],
                *tile_mask(pair, q_idx, k_idx, seg_q, seg_k),
                scale,
            )
            merge(out, lse, pair[0], o, l)
        out = out.view(b, nq, sq, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_idx, k_idx, seg_q, seg_k)
        ctx.pairs = pairs
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, q_idx, k_idx, seg_q, seg_k = ctx.saved_tensors
        g = k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        q32, k32, v32, do, out32 = grouped(q, g), k.float(), v.float(), grouped(grad, g), grouped(out, g)
        delta = None if fused(q.device) else (do * out32).sum(-1)
        dq, dk, dv = torch.zeros_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
        for pair in ctx.pairs:
            qs, ks, _ = pair
            a, bk, bv = tile_backward(
                q32[..., qs, :],
                k32[..., ks, :],
                v32[..., ks, :],
                do[..., qs, :],
                out32[..., qs, :],
                lse[..., qs],
                None if delta is None else delta[..., qs],
                *tile_mask(pair, q_idx, k_idx, seg_q, seg_k),
                scale,
            )
            dq[..., qs, :] += a
            dk[..., ks, :] += bk
            dv[..., ks, :] += bv
        return (dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None)
