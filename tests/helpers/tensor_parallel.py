"""Tensor-parallel layers against their torch counterparts on one rank of any TP size: outputs and
gradients of the column/row linears, the vocabulary-parallel embedding and cross entropy, and the RNG
tracker's dropout inside and outside the TP region."""

import torch
import torch.nn.functional as F

from megalite.parallel.state import ParallelState
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    vocab_parallel_cross_entropy,
)
from megalite.tensor_parallel.layers import vocab_range

SEED = 3


def _err(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _check_linears(ps: ParallelState):
    torch.manual_seed(0)  # same input on every rank
    x = torch.randn(5, 3, 16)
    errs = {}
    # Column (fused pieces, gathered output) vs nn.Linear with the full weight.
    col = ColumnParallelLinear(16, [8, 16], ps.tp, gather_output=True, seed=SEED, name="c")
    full = ColumnParallelLinear(16, [8, 16], ParallelState.single().tp, seed=SEED, name="c")
    ref = torch.nn.Linear(16, 24)
    ref.weight.data.copy_(full.weight.data)
    ref.bias.data.copy_(full.bias.data)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = col(xa)
    # The gathered output orders pieces rank by rank; map the reference the same way.
    pieces = [p.chunk(ps.tp_size, dim=-1) for p in ref(xb).split([8, 16], dim=-1)]
    y_ref = torch.cat([torch.cat([p[r] for p in pieces], dim=-1) for r in range(ps.tp_size)], dim=-1)
    errs["column_out"] = _err(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    errs["column_dx"] = _err(xa.grad, xb.grad)
    errs["column_dw"] = _err(col.weight.grad, col.local_from_full("weight", ref.weight.grad))
    # Row (input not parallel: scatters x itself) vs nn.Linear.
    row = RowParallelLinear(16, 12, ps.tp, input_is_parallel=False, seed=SEED, name="r")
    ref = torch.nn.Linear(16, 12)
    ref.weight.data.copy_(RowParallelLinear(16, 12, ParallelState.single().tp, seed=SEED, name="r").weight.data)
    ref.bias.data.zero_()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = row(xa), ref(xb)
    errs["row_out"] = _err(y, y_ref)
    (y * torch.arange(12.0)).sum().backward()
    (y_ref * torch.arange(12.0)).sum().backward()
    errs["row_dx"] = _err(xa.grad, xb.grad)
    errs["row_dw"] = _err(row.weight.grad, row.local_from_full("weight", ref.weight.grad))
    errs["row_db"] = _err(row.bias.grad, ref.bias.grad)
    return errs


def _check_embedding_and_loss(ps: ParallelState):
    vocab, padded = 50, 64 * ps.tp_size
    errs = {}
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (3, 7))
    emb = VocabParallelEmbedding(vocab, padded, 8, ps.tp, seed=SEED)
    ref = torch.nn.Embedding(vocab, 8)
    ref.weight.data.copy_(VocabParallelEmbedding(vocab, vocab, 8, ParallelState.single().tp, seed=SEED).weight.data)
    out, out_ref = emb(ids), ref(ids)
    errs["embedding_out"] = _err(out, out_ref)
    (out * out).sum().backward()
    (out_ref * out_ref).sum().backward()
    start, end = vocab_range(padded, ps.tp)
    expected = torch.zeros(end - start, 8)
    rows = ref.weight.grad[start : min(end, vocab)]
    expected[: rows.shape[0]] = rows
    errs["embedding_dw"] = _err(emb.weight.grad, expected)
    # Cross entropy over sharded logits vs F.cross_entropy on the real vocabulary.
    torch.manual_seed(2)
    logits_full = torch.randn(7, 3, padded) * 3
    target = torch.randint(0, vocab, (7, 3))
    local = logits_full[..., start:end].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ps.tp, start, vocab)
    ref_logits = logits_full[..., :vocab].clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    errs["xent_out"] = _err(loss.reshape(-1), ref_loss)
    weights = torch.arange(21.0).reshape(7, 3)
    (loss * weights).sum().backward()
    (ref_loss * weights.reshape(-1)).sum().backward()
    expected = torch.zeros(7, 3, padded)
    expected[..., :vocab] = ref_logits.grad
    errs["xent_dlogits"] = _err(local.grad, expected[..., start:end])
    return errs


def _check_rng(ps: ParallelState):
    tracker = RNGTracker(11, ps.tp_rank, ps.pp_rank, torch.device("cpu"))
    outside = F.dropout(torch.ones(64), 0.5)
    with tracker.fork("tp"):
        inside = F.dropout(torch.ones(64), 0.5)
    outside_all = gather_from_tp_region(outside[None], ps.tp)[0].view(ps.tp_size, 64)
    inside_all = gather_from_tp_region(inside[None], ps.tp)[0].view(ps.tp_size, 64)
    same_outside = all(torch.equal(outside_all[0], o) for o in outside_all)
    distinct_inside = len({tuple(i.tolist()) for i in inside_all}) == ps.tp_size
    return same_outside, distinct_inside


def _all_checks(ps: ParallelState):
    out = _check_linears(ps)
    out.update(_check_embedding_and_loss(ps))
    out["rng"] = _check_rng(ps)
    x = torch.ones(4, requires_grad=True)
    copy_to_tp_region(x, ps.tp).sum().backward()
    out["copy_grad_allreduced"] = float(x.grad[0])
    return out
