"""Context-parallel attention on one process: causal and packed-document masks against a dense softmax
over an explicit mask, grouped-query attention, half precision, the tiled arithmetic on every rank's
chunk layout (what the all-gather path computes), and the one-line errors."""

import pytest
import torch

from megalite.context_parallel import blocks, context_parallel_attention
from megalite.context_parallel.blocks import (
    CAUSAL,
    DIAGONAL,
    PAST,
    TiledAttention,
    concat_runs,
    layout_runs,
    tile_pairs,
)
from megalite.context_parallel.sequence import cp_token_index
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel import RNGTracker
from tests.helpers.cp_attention import dense_reference, packed_segments

ONE = AxisGroup([0], 0)


@pytest.fixture(params=["fused", "explicit"])
def kernel(request, monkeypatch):
    """Tiles in torch's fused CPU flash kernel (where this torch has it) or in explicit fp32 matmuls (the
    path other devices take)."""
    if request.param == "fused" and not blocks.fused(torch.device("cpu")):
        pytest.skip("this torch has no fused CPU flash-attention kernel with a mask")
    if request.param == "explicit":
        monkeypatch.setattr(blocks, "_FLASH", None)
    return request.param


def _inputs(b=2, nq=4, nkv=2, s=32, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g).to(dtype).requires_grad_() for n in (nq, nkv, nkv)]


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    "comm_type,packed,nkv",
    [("p2p", False, 2), ("p2p", True, 2), ("all_gather", True, 4), ("a2a", True, 1), ("a2a", False, 1)],
)
def test_one_rank_matches_dense_softmax(comm_type, packed, nkv, kernel):
    q, k, v = _inputs(nkv=nkv)
    seg = packed_segments(2, 32) if packed else None
    out = context_parallel_attention(q, k, v, ONE, comm_type, torch.arange(32), seg)
    ref = dense_reference(q, k, v, seg)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert _rel(out, ref) < 1e-6
    for got, want in zip(_grads(out, [q, k, v]), _grads(ref, [q, k, v])):
        assert _rel(got, want) < 1e-6


@pytest.mark.parametrize(
    "cp,packed,tile",
    [(2, False, 1 << 40), (2, True, 4), (4, True, 1 << 40), (4, False, 4)],
    ids=["cp2-causal-chunks", "cp2-packed-tile4", "cp4-packed-chunks", "cp4-causal-tile4"],
)
def test_tiles_on_every_ranks_chunks(cp, packed, tile, kernel):
    """Each CP rank's queries (chunks r and 2CP-1-r) over every rank's keys in rank order, in small tiles
    (fully-past tiles unmasked, future tiles skipped), equal the dense rows of those queries."""
    s, sl = 48, 48 // cp
    q, k, v = _inputs(nq=4, nkv=2, s=s)
    seg = packed_segments(2, s, seed=3) if packed else None
    order = torch.cat([cp_token_index(s, cp, j) for j in range(cp)])
    ref = dense_reference(q, k, v, seg)
    dref = _grads(ref, [q, k, v])
    k_runs = concat_runs([layout_runs(s, cp, j) for j in range(cp)], sl)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    for r in range(cp):
        idx = cp_token_index(s, cp, r)
        pairs = tile_pairs(layout_runs(s, cp, r), k_runs, tile)
        grid = len(tile_pairs(layout_runs(s, cp, r), [(0, -s, s)] * (2 * cp), tile))  # every key in the past
        assert len(pairs) < grid  # future tiles skipped
        seg_q = None if seg is None else seg[:, idx]
        seg_k = None if seg is None else seg[:, order]
        out = TiledAttention.apply(q[:, :, idx], k[:, :, order], v[:, :, order], idx, order, seg_q, seg_k, pairs)
        assert _rel(out, ref[:, :, idx]) < 1e-6
        g = torch.Generator().manual_seed(1)
        dout = torch.randn(ref.shape, generator=g)[:, :, idx].float()
        a, bk, bv = torch.autograd.grad(out, [q, k, v], dout)
        dq, dk, dv = dq + a, dk + bk, dv + bv
    for got, want in zip((dq, dk, dv), dref):
        assert _rel(got, want) < 1e-6


def test_tile_pairs_skip_the_future_and_unmask_the_past():
    # CP 2, s 16: rank 0 holds [0..3] + [12..15]; rank 1's block [4..7] + [8..11]
    pairs = tile_pairs(layout_runs(16, 2, 0), layout_runs(16, 2, 1))
    assert pairs == [(slice(4, 8), slice(0, 4), PAST), (slice(4, 8), slice(4, 8), PAST)]
    pairs = tile_pairs(layout_runs(16, 2, 1), layout_runs(16, 2, 0))
    assert pairs == [(slice(0, 4), slice(0, 4), PAST), (slice(4, 8), slice(0, 4), PAST)]
    diagonal = tile_pairs(layout_runs(16, 2, 1), layout_runs(16, 2, 1))
    assert diagonal == [
        (slice(0, 4), slice(0, 4), DIAGONAL),
        (slice(4, 8), slice(0, 4), PAST),
        (slice(4, 8), slice(4, 8), DIAGONAL),
    ]
    # tiles that straddle the diagonal unevenly need the general causal mask
    assert tile_pairs([(0, 0, 6)], [(0, 0, 6)], tile=4)[-2:] == [
        (slice(4, 6), slice(0, 4), PAST),
        (slice(4, 6), slice(4, 6), DIAGONAL),
    ]
    assert tile_pairs([(0, 2, 4)], [(0, 0, 6)], tile=8) == [(slice(0, 4), slice(0, 6), CAUSAL)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_half_precision_in_its_dtype(dtype, packed, kernel):
    q, k, v = _inputs(s=64, dtype=dtype)
    seg = packed_segments(2, 64) if packed else None
    out = context_parallel_attention(q, k, v, ONE, "p2p", torch.arange(64), seg)
    assert out.dtype == dtype
    assert _rel(out, dense_reference(q, k, v, seg)) < 2e-2
    for got, want in zip(_grads(out, [q, k, v]), _grads(dense_reference(q, k, v, seg), [q, k, v])):
        assert got.dtype == dtype and _rel(got, want) < 3e-2


def test_dropout_draws_from_the_trackers_tp_stream():
    q, k, v = _inputs()
    seg = packed_segments(2, 32)
    outs = []
    for _ in range(2):
        tracker = RNGTracker(5, tp_rank=0, pp_rank=0, device=torch.device("cpu"))
        torch.manual_seed(123)  # the default stream differs from the tracker's; results must not depend on it
        outs.append(context_parallel_attention(q, k, v, ONE, "all_gather", torch.arange(32), seg, 0.5, tracker))
        torch.manual_seed(999)
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], context_parallel_attention(q, k, v, ONE, "all_gather", torch.arange(32), seg))


def test_one_line_errors():
    q, k, v = _inputs(nq=6, nkv=3, s=16)
    two = AxisGroup([0, 1], 0)
    with pytest.raises(ValueError, match="--attention-dropout .*all_gather or a2a"):
        context_parallel_attention(q, k, v, two, "p2p", torch.arange(16), dropout_p=0.1)
    with pytest.raises(ValueError, match="a2a .* 6 heads and 3 query groups must divide by --context-parallel-size 2"):
        context_parallel_attention(q, k, v, two, "a2a", torch.arange(16))
    with pytest.raises(ValueError, match="'ring' is not one of p2p, all_gather, a2a"):
        context_parallel_attention(q, k, v, ONE, "ring", torch.arange(16))
