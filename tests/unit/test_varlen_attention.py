"""Packed-document and context-parallel attention as variable-length kernel calls (varlen.py,
kernels.py): the segments of every chunk pair, and the whole plumbing (segments per block, token
layout, rows left out of a call, the log-sum-exp merge, grouped-query attention, the backward from the
final output and log-sum-exp) against a dense float64 softmax. On CPU the calls go to the reference
kernel; the ``gpu`` tests run FlashAttention-2's varlen kernels."""

import warnings

import pytest
import torch

from megalite.context_parallel import context_parallel_attention, kernels, varlen
from megalite.context_parallel.blocks import concat_runs, layout_runs
from megalite.context_parallel.sequence import cp_token_index
from megalite.parallel.state import AxisGroup
from tests.helpers.cp_attention import EDGE_DOCUMENTS, dense_reference, documents, packed_segments

ONE = AxisGroup([0], 0)
S = 48


def _inputs(nq, nkv, dtype, device="cpu", b=3, s=S, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g).to(device, dtype).requires_grad_() for n in (nq, nkv, nkv)]


def _errors(out, grads, q, k, v, seg, rows=None, dout=None):
    """Max error of out, dq, dk, dv relative to the largest entry of the dense float64 result."""
    ref = dense_reference(*(t.cpu() for t in (q, k, v)), None if seg is None else seg.cpu())
    if dout is None:
        dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).double()
    want = torch.autograd.grad(ref, [q, k, v], dout)
    ref = ref if rows is None else ref[:, :, rows]
    return [
        float((a.detach().cpu().double() - b.detach()).abs().max() / b.detach().abs().max())
        for a, b in zip((out, *grads), (ref, *want))
    ]


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nq,nkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_one_rank_packed_documents_match_dense(nq, nkv, dtype):
    """Documents of length 1, a row that is one document: one kernel call per layer, segments = documents."""
    q, k, v = _inputs(nq, nkv, dtype)
    seg = documents(*EDGE_DOCUMENTS)
    out = context_parallel_attention(q, k, v, ONE, "p2p", torch.arange(S), seg, backend="reference")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).double()
    grads = torch.autograd.grad(out, [q, k, v], dout.to(dtype))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert max(_errors(out, grads, q, k, v, seg, dout=dout)) < TOL[dtype]


def _rank_by_rank(cp, q, k, v, seg, backend):
    """Each CP rank's queries over every rank's keys (rank order, as all_gather lays them out), through
    the chunk pairs' kernel calls; the ranks' outputs in natural order and their summed gradients."""
    s, sl = q.shape[2], q.shape[2] // cp
    order = torch.cat([cp_token_index(s, cp, j) for j in range(cp)])
    k_runs = concat_runs([layout_runs(s, cp, j) for j in range(cp)], sl)
    kernel = kernels.kernel_for(backend, q)
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).double()
    for r in range(cp):
        idx = cp_token_index(s, cp, r)
        segs = varlen.plans(layout_runs(s, cp, r), k_runs, seg, s, q.shape[0], q.device)
        part = varlen.VarlenAttention.apply(q[:, :, idx], k[:, :, order], v[:, :, order], kernel, segs)
        out[:, :, idx] = part.detach()
        for acc, g in zip(grads, torch.autograd.grad(part, [q, k, v], dout[:, :, idx].to(q.dtype).to(q.device))):
            acc += g
    return out, grads, dout


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("docs", ["edge", "random", "causal"])
def test_every_ranks_chunk_pairs_match_dense(cp, docs):
    """Documents crossing chunk boundaries, of length 1, one-document rows, plain causal: the diagonal and
    past pairs of every rank, rows without keys in a past chunk left out, merged by log-sum-exp."""
    q, k, v = _inputs(4, 2, torch.float32)
    seg = {"edge": documents(*EDGE_DOCUMENTS), "random": packed_segments(3, S, seed=4), "causal": None}[docs]
    out, grads, dout = _rank_by_rank(cp, q, k, v, seg, "reference")
    assert max(_errors(out, grads, q, k, v, seg, dout=dout)) < 1e-5


def test_segments_of_diagonal_and_past_pairs():
    # one row, s 16, CP 2 (chunks of 4): documents [0..2] [3..9] [10..15]
    seg = documents([3, 7, 6])
    own = varlen.pair_plans(layout_runs(16, 2, 1), layout_runs(16, 2, 1), seg, 16, 1, "cpu")  # [4..7] + [8..11]
    diag = [p for p in own if p.causal]
    assert [p.cu_q.tolist() for p in diag] == [[0, 4], [0, 2, 4]]  # [4..7] one piece; [8..11]: [8, 9] [10, 11]
    past = [p for p in own if not p.causal]  # queries [8..11] over keys [4..7]: document 1's [8, 9] over all 4
    assert len(past) == 1 and past[0].rows.tolist() == [0, 1] and past[0].cu_k.tolist() == [0, 4]
    other = varlen.pair_plans(layout_runs(16, 2, 0), layout_runs(16, 2, 1), seg, 16, 1, "cpu")
    # rank 0's queries [12..15] (document 2) over rank 1's keys [4..7] and [8..11]: only [10, 11] of it
    assert [(p.qs, p.ks, p.cu_k.tolist()) for p in other] == [(slice(4, 8), slice(4, 8), [0, 2])]
    assert other[0].k_rows.tolist() == [2, 3] and other[0].rows is None  # within the key slice
    # no document crosses into rank 0's first chunk from anywhere: nothing to call
    assert varlen.pair_plans([(0, 4, 4)], [(0, 0, 4)], documents([4, 12]), 16, 1, "cpu") == []
    # ids that are not runs (a document in two pieces), or chunks that are not aligned: the tiles run
    assert varlen.pair_plans([(0, 0, 4)], [(0, 0, 4)], torch.tensor([[0, 1, 0, 0]]), 4, 1, "cpu") is None
    assert varlen.pair_plans([(0, 2, 4)], [(0, 0, 4)], None, 6, 1, "cpu") is None


def test_segments_are_cached_per_micro_batch():
    seg = packed_segments(2, 32)
    first = varlen.plans([(0, 0, 32)], [(0, 0, 32)], seg, 32, 2, "cpu")
    assert varlen.plans([(0, 0, 32)], [(0, 0, 32)], seg, 32, 2, "cpu") is first  # every layer, the backward
    other = varlen.plans([(0, 0, 32)], [(0, 0, 32)], seg.clone(), 32, 2, "cpu")
    assert other is not first and [p.cu_q.tolist() for p in other] == [p.cu_q.tolist() for p in first]
    seg[0, -1] += 1  # changed in place: worked out again
    assert varlen.plans([(0, 0, 32)], [(0, 0, 32)], seg, 32, 2, "cpu")[0].cu_q.tolist() != first[0].cu_q.tolist()


def test_kernel_choice_and_one_fallback_warning(monkeypatch):
    cpu = torch.zeros(1, 1, 1, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.kernel_for("auto", cpu) is None  # CPU: the tiles, as before, without a warning
    assert kernels.kernel_for("unfused", cpu) is None and kernels.kernel_for("reference", cpu) is kernels.REFERENCE
    line = kernels.describe("auto", torch.device("cpu"), torch.bfloat16, 64)
    assert "causal: torch SDPA" in line and "packed documents / CP blocks: fp32 tiles" in line
    assert "explicit softmax" in kernels.describe("local", torch.device("cpu"), torch.float32, 64)
    monkeypatch.setattr(kernels, "_warned", set())
    cuda = torch.device("cuda")  # fp32 is refused before the device is touched
    with pytest.warns(UserWarning, match=r"not used: it takes fp16/bf16, not float32; fp32 tiles .* run instead"):
        assert kernels.choose("flash", cuda, torch.float32, 64) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.choose("auto", cuda, torch.float32, 64) is None  # said once
    assert "not used: it takes head dims" in kernels.describe("auto", cuda, torch.bfloat16, 12)


class _AsSchema:
    """Stands in for one of torch's FlashAttention ops on CPU: binds the call's arguments by the REAL op's
    schema (so FlashKernel's argument order is checked against this torch) and computes with ``math``."""

    def __init__(self, op, math):
        self.default, self.math, self.calls = op.default, math, 0

    def __call__(self, *args, **kwargs):
        arguments = self.default._schema.arguments
        positional = [a.name for a in arguments if not a.kwarg_only]
        assert len(args) <= len(positional) and set(kwargs) <= {a.name for a in arguments}
        self.calls += 1
        return self.math({**dict(zip(positional, args)), **kwargs})


def _fake_forward(a):
    assert a["dropout_p"] == 0.0 and a["return_debug_mask"] is False
    names = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "is_causal", "scale")
    out, lse = kernels.REFERENCE.forward(*(a[n] for n in names))
    return out, lse, torch.zeros(2), torch.empty(0), torch.empty(0)


def _fake_backward(a):
    assert a["dropout_p"] == 0.0
    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k")
    return kernels.REFERENCE.backward(*(a[n] for n in names), a["is_causal"], a["scale"])


@pytest.mark.skipif(not kernels._schema_ok(), reason="this torch has no FlashAttention varlen ops")
def test_flash_kernel_calls_the_ops_by_their_schema(monkeypatch):
    """FlashKernel's calls bound by the real ops' argument names (the CUDA kernels replaced by the reference
    math), through every rank's chunk pairs; and the probe that admits the kernel on a GPU."""
    fwd, bwd = _AsSchema(kernels._FWD, _fake_forward), _AsSchema(kernels._BWD, _fake_backward)
    monkeypatch.setattr(kernels, "_FWD", fwd)
    monkeypatch.setattr(kernels, "_BWD", bwd)
    monkeypatch.setattr(kernels, "flash_unavailable", lambda *a: "")
    q, k, v = _inputs(4, 2, torch.float32)
    seg = documents(*EDGE_DOCUMENTS)
    out, grads, dout = _rank_by_rank(2, q, k, v, seg, "flash")
    assert fwd.calls > 2 and bwd.calls == fwd.calls
    assert max(_errors(out, grads, q, k, v, seg, dout=dout)) < 1e-5
    assert kernels._probe_once(torch.device("cpu")) == ""
    padded = _AsSchema(kernels._FWD, lambda a: (lambda r: (r[0], r[1].view(2, 4, 12)) + r[2:])(_fake_forward(a)))
    monkeypatch.setattr(kernels, "_FWD", padded)
    assert kernels._probe_once(torch.device("cpu")) == "its log-sum-exp has shape (2, 4, 12), not [heads, tokens]"
    wrong = _AsSchema(kernels._BWD, lambda a: [2 * g for g in _fake_backward(a)])
    monkeypatch.setattr(kernels, "_FWD", fwd)
    monkeypatch.setattr(kernels, "_BWD", wrong)
    assert kernels._probe_once(torch.device("cpu")) == "its gradients differ from the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("nq,nkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_flash_varlen_one_rank_matches_dense(nq, nkv):
    assert kernels.flash_unavailable(torch.device("cuda"), torch.bfloat16, 64) == ""
    q, k, v = _inputs(nq, nkv, torch.bfloat16, "cuda", d=64)
    seg = documents(*EDGE_DOCUMENTS).cuda()
    out = context_parallel_attention(q, k, v, ONE, "p2p", torch.arange(S, device="cuda"), seg, backend="flash")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).double()
    grads = torch.autograd.grad(out, [q, k, v], dout.to(q.device, q.dtype))
    assert max(_errors(out, grads, q, k, v, seg, dout=dout.to("cpu"))) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("docs", ["edge", "causal"])
def test_flash_varlen_chunk_pairs_match_dense(cp, docs):
    assert kernels.flash_unavailable(torch.device("cuda"), torch.bfloat16, 64) == ""  # not the tiles' fallback
    q, k, v = _inputs(4, 2, torch.bfloat16, "cuda", d=64)
    seg = documents(*EDGE_DOCUMENTS).cuda() if docs == "edge" else None
    out, grads, dout = _rank_by_rank(cp, q, k, v, seg, "flash")
    assert max(_errors(out, grads, q, k, v, seg, dout=dout)) < 2e-2


@pytest.mark.gpu
def test_flash_varlen_in_the_model_matches_the_tiles():
    """A packed bf16 GPT on CUDA: logits and gradients with FlashAttention-2 varlen (auto) equal the fp32
    tiles' (--attention-backend unfused) within bf16 accuracy."""
    from megalite.config import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.state import ParallelState
    from megalite.tensor_parallel.random import RNGTracker

    device = torch.device("cuda")
    assert kernels.flash_unavailable(device, torch.bfloat16, 32) == ""  # else auto would quietly run the tiles too
    ps = ParallelState.single(device)
    tokens = torch.randint(0, 63, (2, 256), generator=torch.Generator().manual_seed(0))
    tokens[:, [0, 40, 41, 200]] = 63  # a one-token document first, one of length 1 in the middle
    seg = torch.cumsum((tokens == 63).long(), 1) - (tokens == 63).long()
    runs = {}
    for backend in ("auto", "unfused"):
        cfg = ModelConfig(
            num_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            seq_length=256,
            vocab_size=64,
            position_embedding_type="rope",
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype="bfloat16",
            attention_backend=backend,
        )
        model = GPTModel(cfg, ps, RNGTracker(3, 0, 0, device), 3).to(device)
        logits = model(tokens.to(device), segment_ids=seg.to(device))
        logits.float().square().mean().backward()
        runs[backend] = (logits.detach().float(), [p.grad.float() for p in model.parameters()])
    (a, ga), (b, gb) = runs["auto"], runs["unfused"]
    assert float((a - b).abs().max() / b.abs().max()) < 2e-2
    assert all(float((x - y).abs().max() / y.abs().max().clamp(min=1e-6)) < 5e-2 for x, y in zip(ga, gb))
