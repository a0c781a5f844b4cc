"""Cross entropy over vocabulary-sharded logits, never gathering the full vocabulary.

Rank r holds logits[..., V_r] for its slice V_r of the (padded) vocabulary::

    m   = all_reduce_max(max_v logits)              # stability
    z   = all_reduce_sum(sum_v exp(logits - m))     # partition function
    t   = all_reduce_sum(logit of the target, on the rank that owns it, else 0)
    loss = log z - (t - m)

Padding rows (ids >= the real vocabulary size) are excluded from the softmax,
so the loss does not depend on how much padding a TP size needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.state import AxisGroup


def _all_reduce(x: torch.Tensor, g: AxisGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if g.size > 1:
        g.collective(dist.all_reduce, x, op=op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, g, vocab_start, vocab_size):
        logits = logits.float()
        local_v = logits.shape[-1]
        pad_from = vocab_size - vocab_start  # local index where padding starts
        if pad_from < local_v:
            logits = logits.clone()
            logits[..., max(pad_from, 0) :] = float("-inf")
        logits_max = _all_reduce(logits.max(dim=-1).values, g, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        local_t = target - vocab_start
        outside = (local_t < 0) | (local_t >= local_v)
        local_t = local_t.masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = _all_reduce(predicted, g)

        exp = shifted.exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), g)
        loss = sum_exp.log() - predicted

        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax, kept for backward
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp: AxisGroup, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """Per-token loss [...] from logits [..., V/tp] sharded over ``tp`` (fp32 math).

    ``vocab_start`` is the first vocabulary id held by this rank and
    ``vocab_size`` the real (unpadded) vocabulary size.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_start, vocab_size)
