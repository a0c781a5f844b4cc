"""The reference of the context-parallel attention tests: a dense float64 softmax over an explicit causal
(and packed-document) mask, and packed document ids."""

import math

import torch


def dense_reference(q, k, v, segment_ids=None):
    """softmax(q k^T / sqrt(d) + mask) v in float64; q [b, nq, s, d], k/v [b, nkv, s, d], natural order."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def packed_segments(b, s, seed=0):
    """Document ids [b, s] of rows packing several documents (ends at random places, one row unpacked)."""
    g = torch.Generator().manual_seed(seed)
    ends = (torch.rand(b, s, generator=g) < 0.15).long()
    ends[-1] = 0
    return ends.cumsum(1) - ends
