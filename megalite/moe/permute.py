"""Permutation of routed tokens on the device: tokens to expert order and back, without host syncs.

::

    routing [T, E] (bool, n chosen pairs)  --sort_by_expert-->  (token, expert) of each pair [n],
                                                                 expert-major, tokens in order
    x [T, h] --index_select(token)--> rows [n, h] in expert order --> experts --> y [n, h]
    y [n, h], probs of the pairs [n] --unpermute--> out [T, h] = sum over a token's pairs of p x y

On CUDA a data-dependent shape (``nonzero``, boolean indexing, ``bincount``, ``repeat_interleave``
without ``output_size``) waits for the device; so does every ``.tolist()``/``.item()``. Here each
pair's place is a cumulative count and every size is handed in by the caller, which reads all the
sizes a dispatch needs with one ``host_sizes`` call (the all-to-all's split sizes need the host
anyway): one sync per dispatch, whether dropless, dropping over capacity or padding to it.
"""

from __future__ import annotations

from typing import List, Tuple

import torch


def host_sizes(counts: torch.Tensor) -> List[int]:
    """The one device-to-host read of a dispatch: its token counts as Python ints."""
    return counts.tolist()


def sort_by_expert(routing: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token [n], expert [n]) of the ``n`` chosen pairs of ``routing`` [T, E], sorted by expert, then
    token. A pair's place is the number of chosen pairs before it in expert-major order, so the sort
    is one cumulative sum and one scatter: linear, and its output size (``n``, from the host) known."""
    T = routing.shape[0]
    flat = routing.t().reshape(-1)  # [E * T], expert-major
    place = torch.where(flat, flat.cumsum(0) - 1, n)  # every pair not chosen lands in slot n, cut off below
    pair = torch.empty(n + 1, dtype=torch.long, device=routing.device)
    pair.scatter_(0, place, torch.arange(flat.numel(), device=routing.device))
    pair = pair[:n]
    return pair % T, pair // T


def regroup_index(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Where each received row goes when rows arrive per source rank, then per local expert
    (``recv_counts`` [sources, local experts], ``total`` rows) and the experts want them expert-major
    (per local expert, then source): a permutation of ``range(total)``, computed on the device."""
    sources, local = recv_counts.shape
    flat = recv_counts.reshape(-1)  # block b = source * local + expert, in the order received
    src_start = flat.cumsum(0) - flat
    by_expert = recv_counts.t().reshape(-1)  # the same blocks, expert-major
    dst_start = (by_expert.cumsum(0) - by_expert).view(local, sources).t().reshape(-1)  # back in block order
    block = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat, output_size=total)
    return dst_start[block] + torch.arange(total, device=flat.device) - src_start[block]


class _Unpermute(torch.autograd.Function):
    """out [T, h] = zeros, then out[token_i] += y_i x p_i for every pair i: the probabilities applied
    in the pass that adds a token's pairs up (one node; backward gathers the output gradient once)."""

    @staticmethod
    def forward(ctx, y, probs, token, num_tokens: int, dtype: torch.dtype):
        ctx.save_for_backward(y, probs, token)
        weighted = (y * probs.unsqueeze(-1)).to(dtype)  # in the wider of the two dtypes, as y * p would be
        return weighted.new_zeros((num_tokens, y.shape[1])).index_add_(0, token, weighted)

    @staticmethod
    def backward(ctx, grad):
        y, probs, token = ctx.saved_tensors
        rows = grad.index_select(0, token).to(torch.promote_types(y.dtype, probs.dtype))
        grad_y = (rows * probs.unsqueeze(-1)).to(y.dtype) if ctx.needs_input_grad[0] else None
        grad_p = (rows * y).sum(dim=-1).to(probs.dtype) if ctx.needs_input_grad[1] else None
        return grad_y, grad_p, None, None, None


def unpermute(y: torch.Tensor, probs: torch.Tensor, token: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each token's pairs summed back, weighted by their probabilities: [T, h] shaped and typed as ``like``."""
    return _Unpermute.apply(y, probs, token, like.shape[0], like.dtype)
