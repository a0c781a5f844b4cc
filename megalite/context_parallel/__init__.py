"""Context parallelism: every sequence split over the CP group, attention over the whole of it.

The sequence is cut into 2 x CP chunks; CP rank r holds chunks r and 2CP-1-r (every rank then does
the same causal-attention work). Everything outside attention is per token and runs on the local
tokens; attention needs every earlier key, so K/V (only the nkv groups) move::

    s = 16, CP = 2     chunks   c0 c1 c2 c3          rank 0: q,k,v of c0+c3    rank 1: c1+c2
    p2p         ring: step t, rank r attends the K/V block of rank r-t; the next block is in flight
                (backward: dK/dV accumulators follow the blocks and come home after one loop)
    all_gather  every rank gathers all K/V blocks (backward: reduce-scatter of dK/dV)
    a2a         all-to-all: [s/CP tokens, all heads] -> [s tokens, heads/CP]; attend; back

sequence.py: where tokens live (cp_token_index, the batch slicer) and packed documents;
attention.py: context_parallel_attention (the entry point); ring.py, collectives.py: the
communication; kernels.py: the variable-length attention kernels (FlashAttention-2 on CUDA) and which
one runs; varlen.py: chunk pairs as kernel calls (segments from the document boundaries); blocks.py:
tiled fp32 attention with a log-sum-exp (masks built per tile; CPU and the fallback).
"""

from megalite.context_parallel.attention import context_parallel_attention

__all__ = ["context_parallel_attention"]
