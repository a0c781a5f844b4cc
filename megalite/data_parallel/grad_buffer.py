"""Contiguous gradient storage and bucketed, overlapped data-parallel reduction.

::

    buffer (one flat tensor per dtype, parameters in reverse registration order,
            roughly the order backward produces their gradients)
    | bucket 0: p_n ... p_k | bucket 1: p_k-1 ... | ... |
      param.grad is a view into the buffer, so autograd accumulates micro-batch
      gradients in place and a bucket is one all-reduce.

A post-accumulate-grad hook counts how many backward passes each parameter has
seen; once every parameter of a bucket has seen all ``num_microbatches`` of
them, the bucket's all-reduce starts asynchronously while backward continues
on earlier layers. ``finish()`` waits for all buckets and averages over DP.
The same buffers are what a distributed optimizer will later reduce-scatter.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel_state import AxisGroup

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # Megatron's default DDP bucket size


class _Bucket:
    def __init__(self, params: List[nn.Parameter], data: torch.Tensor):
        self.params, self.data = params, data
        self.pending = len(params)
        self.handle = None


class GradBuffer:
    """Owns every parameter's ``.grad`` as a view of a flat buffer; reduces it over ``dp``."""

    def __init__(self, params: Sequence[nn.Parameter], dp: AxisGroup, *,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, overlap: bool = True):
        self.dp, self.overlap = dp, overlap and dp.size > 1
        self.params = [p for p in params if p.requires_grad]
        self.buffers: Dict[torch.dtype, torch.Tensor] = {}
        self.buckets: List[_Bucket] = []
        self._views: Dict[nn.Parameter, torch.Tensor] = {}
        self._bucket_of: Dict[nn.Parameter, _Bucket] = {}
        self._seen: Dict[nn.Parameter, int] = {}
        self.num_microbatches = 1
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
        for p in reversed(self.params):
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, plist in by_dtype.items():
            self._build(dtype, plist, bucket_elements)
        if self.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _build(self, dtype: torch.dtype, plist: List[nn.Parameter], bucket_elements: int) -> None:
        total = sum(p.numel() for p in plist)
        buf = torch.zeros(total, dtype=dtype, device=plist[0].device)
        self.buffers[dtype] = buf
        offset, start, members = 0, 0, []
        for p in plist:
            view = buf[offset:offset + p.numel()].view_as(p)
            self._views[p] = view
            p.grad = view
            members.append(p)
            offset += p.numel()
            if offset - start >= bucket_elements or p is plist[-1]:
                bucket = _Bucket(members, buf[start:offset])
                self.buckets.append(bucket)
                for q in members:
                    self._bucket_of[q] = bucket
                start, members = offset, []

    def start_step(self, num_microbatches: int) -> None:
        """Zero the gradients and arm the readiness counters for a step of ``num_microbatches``."""
        self.num_microbatches = num_microbatches
        for buf in self.buffers.values():
            buf.zero_()
        for p in self.params:
            if p.grad is None or p.grad.data_ptr() != self._views[p].data_ptr():
                p.grad = self._views[p]  # someone replaced it (e.g. zero_grad(set_to_none))
            self._seen[p] = 0
        for b in self.buckets:
            b.pending, b.handle = len(b.params), None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._seen[p] += 1
        if self._seen[p] == self.num_microbatches:
            bucket = self._bucket_of[p]
            bucket.pending -= 1
            if bucket.pending == 0:
                bucket.handle = dist.all_reduce(bucket.data, group=self.dp.group, async_op=True)

    def finish(self) -> None:
        """Complete every bucket's all-reduce (starting any not yet started) and average over DP."""
        for p in self.params:
            if p.grad.data_ptr() != self._views[p].data_ptr():
                raise RuntimeError("a parameter's .grad was replaced during backward; "
                                   "gradients must accumulate into the data-parallel buffer")
        if self.dp.size == 1:
            return
        for b in self.buckets:
            if b.handle is None:
                b.handle = dist.all_reduce(b.data, group=self.dp.group, async_op=True)
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
        for buf in self.buffers.values():
            buf.div_(self.dp.size)
