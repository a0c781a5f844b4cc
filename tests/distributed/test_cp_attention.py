"""Context-parallel attention on 2 and 4 gloo ranks against one process: for every comm type, with and
without packed documents, grouped-query attention, in tiles and in variable-length kernel calls (the
reference kernel), each rank's output and dq/dk/dv equal the rows of a full-sequence attention
(float64, explicit mask) that belong to its chunks r and 2CP-1-r."""

import pytest
import torch

from megalite.context_parallel import blocks, context_parallel_attention, ring
from megalite.context_parallel.sequence import cp_token_index
from megalite.tensor_parallel import RNGTracker
from tests.helpers.cp_attention import dense_reference, packed_segments

S, B, D = 64, 2, 8


def _case_errors(ps, comm_type, packed, nq, nkv, dtype, explicit=False, backend="auto"):
    """Max error relative to the largest entry of out, dq, dk, dv; ``explicit``: tiles in explicit fp32
    matmuls instead of the fused CPU kernel (the path other devices take); ``backend`` "reference": the
    blocks as variable-length kernel calls (the plumbing CUDA's FlashAttention-2 path takes)."""
    cp = ps.cp
    fused_kernel = blocks._FLASH
    if explicit:
        blocks._FLASH = None
    g = torch.Generator().manual_seed(nq * 10 + nkv + packed)  # the same full tensors on every rank
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (nq, nkv, nkv))
    dout = torch.randn(B, nq, S, D, generator=g)
    seg = packed_segments(B, S, seed=nq) if packed else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_reference(*full, seg)
    ref_grads = torch.autograd.grad(ref, full, dout.double())
    idx = cp_token_index(S, cp.size, cp.rank)
    local = [t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, comm_type, idx, seg, backend=backend)
    grads = torch.autograd.grad(out, local, dout[:, :, idx].to(dtype))
    blocks._FLASH = fused_kernel
    assert out.dtype == dtype and all(gr.dtype == dtype for gr in grads)
    errs = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        want = want.detach()[:, :, idx]
        errs[name] = float((got.detach().double() - want).abs().max() / want.abs().max())
    return errs


def _dropout_runs(ps, comm_type):
    """all_gather and a2a take attention dropout from the tracker's "tp" stream: the same tracker state
    gives the same output, the gradients are finite, and dropout changes the output."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, 4, S // ps.cp.size, D, generator=g).requires_grad_() for _ in range(3))
    idx = cp_token_index(S, ps.cp.size, ps.cp.rank)
    seg = packed_segments(B, S)
    outs = [
        context_parallel_attention(q, k, v, ps.cp, comm_type, idx, seg, 0.3, RNGTracker(7, 0, 0, q.device))
        for _ in range(2)
    ]
    grads = torch.autograd.grad(outs[0].sum(), [q, k, v])
    plain = context_parallel_attention(q, k, v, ps.cp, comm_type, idx, seg)
    return (
        torch.equal(outs[0], outs[1])
        and all(bool(gr.isfinite().all()) for gr in grads)
        and not torch.allclose(outs[0], plain)
    )


def _all_cases(ps, cases):
    timing = ring.timing = ring.RingTiming()
    errors = {case: _case_errors(ps, *case) for case in cases}
    ring.timing = None
    dropout_ok = [_dropout_runs(ps, c) for c in ("all_gather", "a2a")]
    return errors, timing.steps, dropout_ok


def _cases(cp):
    nq, nkv = (4, 2) if cp == 2 else (8, 4)
    out = [(c, packed, nq, nkv, torch.float32) for c in ("p2p", "all_gather", "a2a") for packed in (False, True)]
    out.append(("p2p", True, 4, 1, torch.float32))  # multi-query: one K/V group travels
    out.append(("p2p", True, nq, nkv, torch.bfloat16))
    out.append(("all_gather", True, nq, nkv, torch.bfloat16))
    out += [("p2p", packed, nq, nkv, torch.float32, True) for packed in (False, True)]
    out += [(c, True, nq, nkv, torch.float32, False, "reference") for c in ("p2p", "all_gather", "a2a")]
    out.append(("p2p", False, nq, nkv, torch.float32, False, "reference"))
    out.append(("p2p", True, 4, 1, torch.float32, False, "reference"))
    out.append(("p2p", True, nq, nkv, torch.bfloat16, False, "reference"))
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_every_comm_type_matches_one_process(cp, run_distributed):
    cases = _cases(cp)
    results = run_distributed(_all_cases, cp, cases, cp=cp)
    for rank, (errors, ring_steps, dropout_ok) in enumerate(results):
        assert dropout_ok == [True, True]
        assert ring_steps == 2 * cp * sum(c[0] == "p2p" for c in cases)  # forward and backward: CP steps each
        for case, errs in errors.items():
            tol = 1e-5 if case[4] == torch.float32 else 3e-2
            bad = {k: e for k, e in errs.items() if not e < tol}
            assert not bad, f"cp {cp} rank {rank} {case}: {bad}"
