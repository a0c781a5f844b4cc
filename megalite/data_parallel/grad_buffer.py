"""Contiguous gradient (and parameter) storage with bucketed data-parallel reduction.

"dp" below is the group the buffer is given: the replicas of this rank's model shard,
dp x cp (``ParallelState.dp_cp``; with context parallelism the CP ranks of a replica hold
partial gradients of the same samples, averaged like any other replica's).

::

    grad buffer (fp32 with --bf16 / --accumulate-allreduce-grads-in-fp32, else the param dtype;
                 parameters in reverse registration order, roughly the order backward makes them)
    | bucket 0: p_n ... p_k  pad | bucket 1: p_k-1 ...  pad | ... | shared (tied embedding) |
      each bucket padded to a multiple of dp; with the distributed optimizer DP rank r
      owns the r-th 1/dp slice of every bucket:
    | r0 | r1 | r2 | r3 |  <- reduce-scatter of the bucket's gradients, all-gather of its weights

Every parameter gets ``param.main_grad``, a view into the buffer. When the
buffer has the parameter's dtype, ``param.grad`` is that same view and autograd
accumulates micro-batch gradients in place; otherwise (bf16 weights, fp32
gradients) a post-accumulate hook adds ``param.grad`` into ``main_grad`` and
frees it. With ``overlap`` a bucket's reduction starts as soon as all its
parameters have seen every micro-batch's backward.

With the distributed optimizer the parameters' storage is also one flat buffer
of the same layout, so the updated shards are all-gathered straight into the
weights (bucket by bucket; with ``overlap_param_gather`` in the background,
each bucket waited for by the first forward of a module that uses it).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalite.observability.flight_recorder import FlightRecorder
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.comms import all_gather_flat, reduce_scatter_flat

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # Megatron's default DDP bucket size
_PAD = 64  # bucket sizes are multiples of dp x 64 elements (aligned shards)


class Bucket:
    """A contiguous range [start, end) of the buffers and the parameters in it."""

    def __init__(self, params: List[nn.Parameter], start: int, end: int, dp_size: int, dp_rank: int):
        self.params, self.start, self.end = params, start, end
        per = (end - start) // dp_size
        self.shard = (start + dp_rank * per, start + (dp_rank + 1) * per)  # this rank's slice
        self.deferred = False  # reduced only in finish() (tied embedding: summed over stages first)
        self.pending = 0
        self.grad_handle = None
        self.grad_out: Optional[torch.Tensor] = None
        self.param_handle = None
        self.gather_src: Optional[torch.Tensor] = None  # kept alive until its all-gather completes


class GradBuffer:
    """Owns ``main_grad`` of every parameter; averages it over ``dp`` (the replicas: the optimizer passes
    ParallelState.dp_cp) by all-reduce or reduce-scatter."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        dp: AxisGroup,
        *,
        grad_dtype: Optional[torch.dtype] = None,
        bucket_elements: Optional[int] = None,
        overlap: bool = False,
        shard: bool = False,
        deferred: Sequence[nn.Parameter] = (),
        average_over: Optional[int] = None,
        recorder: Optional[FlightRecorder] = None,
    ):
        self.dp, self.shard_grads = dp, shard
        # the rank's flight recorder (ParallelState.recorder) sees the reductions; None: nothing recorded
        self.recorder = recorder if recorder is not None else FlightRecorder(0)
        # The sum over dp is divided by this (default dp's size): an MoE expert's replicas (expert DP) divide
        # by the dense replicas' count instead, as their gradients already hold the other ranks' tokens.
        self.average_over = average_over or dp.size
        self.overlap = overlap and dp.size > 1
        self.params = [p for p in params if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.param_dtype = dtypes.pop()
        self.grad_dtype = grad_dtype or self.param_dtype
        self.accumulate_in_hook = self.grad_dtype != self.param_dtype
        bucket_elements = bucket_elements or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp.size)
        self.index: Dict[nn.Parameter, Tuple[int, int]] = {}  # param -> [start, end) in the buffer
        self.buckets: List[Bucket] = []
        self._bucket_of: Dict[nn.Parameter, Bucket] = {}
        deferred_ids = {id(p) for p in deferred}
        plain = [p for p in reversed(self.params) if id(p) not in deferred_ids]
        shared = [p for p in reversed(self.params) if id(p) in deferred_ids]
        offset = self._layout(plain, 0, bucket_elements)
        offset = self._layout(shared, offset, bucket_elements, deferred=True)
        device = self.params[0].device
        self.grad_data = torch.zeros(offset, dtype=self.grad_dtype, device=device)
        self.param_data: Optional[torch.Tensor] = None
        if shard:  # weights live in one flat buffer so shards can be gathered into them
            self.param_data = torch.zeros(offset, dtype=self.param_dtype, device=device)
            for p, (a, b) in self.index.items():
                self.param_data[a:b].copy_(p.data.view(-1))
                p.data = self.param_data[a:b].view_as(p)
        for p, (a, b) in self.index.items():
            p.main_grad = self.grad_data[a:b].view_as(p)
        self._seen: Dict[nn.Parameter, int] = {p: 0 for p in self.params}
        self.num_microbatches = 1
        if self.overlap or self.accumulate_in_hook:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _layout(self, plist: List[nn.Parameter], offset: int, bucket_elements: int, deferred: bool = False) -> int:
        start, members = offset, []
        for p in plist:
            self.index[p] = (offset, offset + p.numel())
            offset += p.numel()
            members.append(p)
            if offset - start >= bucket_elements or p is plist[-1]:
                multiple = self.dp.size * _PAD
                end = start + -(-(offset - start) // multiple) * multiple
                bucket = Bucket(members, start, end, self.dp.size, self.dp.rank)
                bucket.deferred = deferred
                self.buckets.append(bucket)
                for q in members:
                    self._bucket_of[q] = bucket
                offset = start = end
                members = []
        return offset

    # -- one step ------------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """Zero the gradients and arm the readiness counters for a step of ``num_microbatches``."""
        self.num_microbatches = num_microbatches
        self.grad_data.zero_()
        for p in self.params:
            p.grad = None if self.accumulate_in_hook else p.main_grad
            self._seen[p] = 0
        for b in self.buckets:
            b.pending, b.grad_handle, b.grad_out = len(b.params), None, None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.accumulate_in_hook:
            p.main_grad.add_(p.grad)
            p.grad = None
        if not self.overlap:
            return
        self._seen[p] += 1
        if self._seen[p] == self.num_microbatches:
            bucket = self._bucket_of[p]
            bucket.pending -= 1
            if bucket.pending == 0 and not bucket.deferred:
                self._start_reduce(bucket)

    def _start_reduce(self, b: Bucket) -> None:
        data = self.grad_data[b.start : b.end]
        # Average before the sum (as Megatron): a sum of fp16 gradients can overflow where the mean would not.
        data.mul_(1.0 / self.average_over)
        if self.shard_grads:
            # A separate output: an in-place reduce-scatter (output inside input) is not safe on gloo.
            b.grad_out = torch.empty(b.shard[1] - b.shard[0], dtype=data.dtype, device=data.device)
            b.grad_handle = self.recorder.call(
                "dp_cp", reduce_scatter_flat, b.grad_out, data, group=self.dp.group, async_op=True
            )
        else:
            b.grad_handle = self.recorder.call("dp_cp", dist.all_reduce, data, group=self.dp.group, async_op=True)

    def finish(self) -> None:
        """Complete every bucket's reduction (starting those not yet started): the mean over DP.

        Afterwards ``main_grad`` holds the DP mean: everywhere (all-reduce) or on this
        rank's shard of each bucket (reduce-scatter; the rest of the buffer is stale).
        """
        if not self.accumulate_in_hook:
            for p in self.params:
                if p.grad is not None and p.grad.data_ptr() != p.main_grad.data_ptr():
                    raise RuntimeError(
                        "a parameter's .grad was replaced during backward; "
                        "gradients must accumulate into the data-parallel buffer"
                    )
        if self.dp.size == 1:
            if self.average_over != 1:
                self.grad_data.mul_(1.0 / self.average_over)
            return
        for b in self.buckets:
            if b.grad_handle is None:
                self._start_reduce(b)
        for b in self.buckets:
            b.grad_handle.wait()
            b.grad_handle = None
            if self.shard_grads:
                self.grad_data[b.shard[0] : b.shard[1]].copy_(b.grad_out)
                b.grad_out = None

    # -- distributed optimizer: gather the updated weights ------------------------------------
    def gather_params(self, async_op: bool = False) -> None:
        """All-gather every bucket's weight shards into the full weights (after the update)."""
        if self.param_data is None or self.dp.size == 1:
            return
        for b in self.buckets:
            shard = self.param_data[b.shard[0] : b.shard[1]].clone()
            b.param_handle = self.recorder.call(
                "dp_cp", all_gather_flat, self.param_data[b.start : b.end], shard, group=self.dp.group, async_op=True
            )
            b.gather_src = shard
        if not async_op:
            self.wait_params()

    def wait_params(self, params: Optional[Sequence[nn.Parameter]] = None) -> None:
        """Wait for the gathers of the buckets holding ``params`` (default: every bucket)."""
        buckets = (
            self.buckets
            if params is None
            else {id(self._bucket_of[p]): self._bucket_of[p] for p in params if p in self._bucket_of}.values()
        )
        for b in buckets:
            if b.param_handle is not None:
                b.param_handle.wait()
                b.param_handle = None
                b.gather_src = None

    def install_param_gather_hooks(self, modules: Sequence[nn.Module]) -> None:
        """Forward pre-hooks: a module waits for its own weights' gather before it runs."""
        for root in modules:
            for m in root.modules():
                own = [p for p in m.parameters(recurse=False) if p in self._bucket_of]
                if own:
                    m.register_forward_pre_hook(lambda mod, args, own=own: self.wait_params(own))
