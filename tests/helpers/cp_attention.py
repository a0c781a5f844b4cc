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


def documents(*rows):
    """Document ids [len(rows), s] from each row's document lengths (every row sums to the same s)."""
    ids = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)) for lengths in rows]
    return torch.stack(ids)


# s = 48 in rows of documents of length 1, documents crossing the chunk boundaries of CP 2 (chunks of 12)
# and CP 4 (chunks of 6), and a row that is one document
EDGE_DOCUMENTS = ([1, 1, 9, 14, 1, 3, 7, 11, 1], [48], [5, 1, 1, 20, 21])
