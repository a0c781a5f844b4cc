"""Sharded data parallelism on torch's FSDP2 (``fully_shard``): gradients, and weights too, split over
the replicas (ZeRO-2 / ZeRO-3), beside tensor, pipeline, context and expert parallelism.

::

    TP-local parameter [rows, ...] (what a TP rank holds; FSDP never sees the full tensor)
    | dp_cp rank 0: rows 0 .. c-1 | rank 1: rows c .. 2c-1 | ... |      c = ceil(rows / dp_cp)
      each rank keeps its rows in fp32: the main weight the optimizer steps (no second copy)

    optim_grads        a layer's weights are gathered (in the compute dtype) by the step's first
                       forward and kept until finalize_grads; gradients reduce-scattered in fp32
                       after each micro-batch's backward (ZeRO-2)
    optim_grads_params gathered before each forward and again before each backward, freed
                       after each (--no-reshard-after-forward: kept from forward to backward)

FSDP units: each transformer layer, each MoE layer's experts (sharded over the expert
data-parallel group instead, their gradients divided by dp x cp as the grad buffer does), each
router (gathered in fp32, as the half-precision path keeps routers), and the chunk itself
(embedding, final norm, output layer). With one rank per expert DP group the experts are left
out of FSDP (``ignored_params``) and keep a plain gradient buffer.

A rank's shard of a parameter is one contiguous run of its flattening (rows ``[r*c, (r+1)*c)``),
so the optimizer's pieces and the checkpoint's flat entries describe it exactly as they describe
the distributed optimizer's shard (optim/optimizer.py, checkpointing/sharded_write.py).
"""

from __future__ import annotations

import inspect
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from megalite.config import Config
from megalite.config.checks import check_fsdp_leaves_out
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.data_parallel.grad_buffers import GradBuffers
from megalite.moe.experts import LocalExperts
from megalite.parallel.state import AxisGroup, ParallelState
from megalite.tensor_parallel.layers import per_expert_names

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # type: ignore
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore

_LEAVES_OUT = "ignored_params" in inspect.signature(fully_shard).parameters  # torch >= 2.7
__all__ = ["ShardedPart", "FSDPGrads", "shard_chunks", "unsharded", "local_shard_range", "gathered_state_dict"]


def unsharded(t: torch.Tensor) -> torch.Tensor:
    """The whole TP-local tensor of a parameter (collective over its FSDP group when sharded)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_shard_range(p: torch.Tensor) -> Tuple[int, int]:
    """Elements [start, end) of the TP-local parameter's flattening that this rank's FSDP shard holds."""
    if not isinstance(p, DTensor):
        return 0, p.numel()
    mesh, dim = p.device_mesh, p.device_mesh.ndim - 1  # hybrid sharding: shards along the last mesh dim
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    rows, per_row = p.shape[0], math.prod(p.shape[1:])
    chunk = -(-rows // size)  # torch.chunk's split, as FSDP2 shards dim 0
    a, b = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    return a * per_row, b * per_row


def gathered_state_dict(chunk: nn.Module, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """``chunk.state_dict()`` with every FSDP shard gathered into its TP-local tensor in ``dtype`` (the weights
    as the unsharded run holds them; collective over each parameter's FSDP group, every rank in one order)."""
    sharded = {e for n, p in chunk.named_parameters() if isinstance(p, DTensor) for e in per_expert_names(n, p)}
    return {
        k: v.full_tensor().to(dtype) if isinstance(v, DTensor) else v.to(dtype) if k in sharded else v
        for k, v in chunk.state_dict().items()
    }


class ShardedPart:
    """Parameters FSDP shards over ``dp`` (the dense replicas, or the experts' DP group): what the optimizer
    and the checkpoint writer read of a gradient buffer part."""

    shard_grads = True
    buckets: List = []

    def __init__(
        self, params: Sequence[nn.Parameter], dp: AxisGroup, scale: float = 1.0, copies: Optional[AxisGroup] = None
    ):
        """``dp``: the ranks the shards are spread over; ``copies`` (hybrid sharding): the ranks holding the same
        shard, of which the first writes it to checkpoints."""
        self.params, self.dp, self.scale, self.copies = list(params), dp, scale, copies
        self.index: Dict[nn.Parameter, Tuple[int, int]] = {}

    @property
    def num_copies(self) -> int:
        return self.copies.size if self.copies is not None else 1

    @property
    def writes(self) -> bool:
        """Whether this rank's shards are the ones a checkpoint (or a gather over all of dp x cp) takes."""
        return self.copies is None or self.copies.rank == 0

    @property
    def grad_data(self) -> torch.Tensor:
        """This rank's gradient shards, flat (for byte counts)."""
        grads = [p.grad._local_tensor.view(-1) for p in self.params if p.grad is not None]
        return torch.cat(grads) if grads else torch.zeros(0)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(p._local_tensor.shape) * 4 for p in self.params)

    def start_step(self, num_microbatches: int) -> None:
        for p in self.params:
            p.grad = None  # FSDP accumulates each micro-batch's reduced shard into .grad

    def finish(self) -> None:
        """FSDP's root has waited for its reduce-scatters at the end of every backward: only the scale is left."""
        if self.scale != 1.0:
            grads = [p.grad._local_tensor for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.scale)

    def gather_params(self, async_op: bool = False) -> None:
        pass  # the next forward gathers the updated shards

    def wait_params(self, params=None) -> None:
        pass

    def install_param_gather_hooks(self, modules) -> None:
        pass


class FSDPGrads(GradBuffers):
    """The optimizer's gradient side under FSDP2: ``GradBuffers`` over its ``parts`` (ShardedPart, and a plain
    expert buffer where experts stay out of FSDP), plus the FSDP modules, resharded at the end of each step's
    backward."""

    def __init__(self, parts: Sequence, modules: Sequence[FSDPModule], compute_dtype: torch.dtype):
        super().__init__(parts)
        self.modules, self.compute_dtype = list(modules), compute_dtype

    @property
    def nbytes(self) -> int:
        """Bytes of every gradient: the shards' fp32 size (held from the first backward on), the buffers'."""
        return sum(
            part.nbytes if isinstance(part, ShardedPart) else part.grad_data.numel() * part.grad_data.element_size()
            for part in self.parts
        )

    def finish(self) -> None:
        super().finish()
        for m in self.modules:  # optim_grads kept the weights gathered over the step: free them before the update
            m.reshard()


def _policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Gather weights in ``dtype`` (None: as stored, fp32), reduce gradients in fp32; inputs left alone (the
    model casts its own activations, as on the unsharded path)."""
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _keep_attributes(chunk: nn.Module) -> Dict[str, dict]:
    """The megalite tags of every parameter (tensor_parallel, expert_parallel, shared, ...): fully_shard
    replaces each parameter by a new DTensor one, which must carry them on."""
    return {n: dict(p.__dict__) for n, p in chunk.named_parameters()}


def _mesh(group: AxisGroup, device: torch.device, whole: Optional[AxisGroup] = None, copies=None):
    """A device mesh over ``group``; with ``copies`` the 2-D (replicate, shard) mesh of hybrid sharding, whose
    rows are the runs of ``whole`` (dp x cp) that ``group`` is one of."""
    from torch.distributed.device_mesh import DeviceMesh

    if copies is None:
        return DeviceMesh.from_group(group.group, device.type)
    layout = torch.tensor(whole.ranks).view(copies.size, group.size)  # [replicate, shard]: global ranks
    return DeviceMesh.from_group(
        [copies.group, group.group], device.type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


def _units(chunk: nn.Module) -> Tuple[List[nn.Module], List[nn.Module]]:
    """(the chunk's transformer layers, their experts modules): the FSDP units below the chunk's own."""
    layers = list(chunk.decoder.layers.values())
    experts = [m for layer in layers for m in layer.modules() if isinstance(m, LocalExperts)]
    return layers, experts


def _prefetch(layers: Sequence[nn.Module]) -> None:
    """Each layer's forward starts the next layer's gather, and its backward the previous one's: on a GPU the
    transfer runs while this layer computes (FSDP2's own lookahead is one module, in backward only)."""
    if not hasattr(FSDPModule, "set_modules_to_forward_prefetch"):  # torch < 2.5: FSDP2's own lookahead only
        return
    for before, after in zip(layers, layers[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])


def shard_chunks(chunks: Sequence[nn.Module], ps: ParallelState, cfg: Config) -> FSDPGrads:
    """Apply FSDP2 to this rank's model chunks (in place) and return the optimizer's gradient side.

    ``cfg.optim``: the strategy (optim_grads or optim_grads_params), --no-reshard-after-forward, and
    --num-distributed-optimizer-instances > 1 for hybrid sharding (HSDP) of the dense weights. In a 16-bit run
    the weights are kept in fp32 and gathered in the compute dtype. Frozen parameters (the router's expert
    bias) stay plain.
    """
    o, dtype = cfg.optim, cfg.model.torch_dtype
    strategy, reshard_after_forward, instances = (
        o.sharding,
        o.reshard_after_forward,
        o.num_distributed_optimizer_instances,
    )
    policy = _policy(None if dtype == torch.float32 else dtype)
    keep = strategy == "optim_grads" or not reshard_after_forward
    shard, copies = ps.dp_cp, None
    if instances > 1:  # hybrid sharding: shard within a run of dp_cp / instances ranks, replicate over the runs
        ps.init_hybrid_shard_groups(instances)
        shard, copies = ps.axes["dp_cp_shard"], ps.axes["dp_cp_replicate"]
    dense_mesh = _mesh(shard, ps.device, ps.dp_cp, copies)
    expert_mesh = _mesh(ps.edp, ps.device) if ps.has_experts and ps.edp_size > 1 else None
    modules, dense, experts_fsdp, experts_plain = [], [], [], []
    for chunk in chunks:
        tags = _keep_attributes(chunk)
        layers, expert_modules = _units(chunk)
        plain_experts = set() if expert_mesh is not None else {p for m in expert_modules for p in m.parameters()}
        ignored = {p for p in chunk.parameters() if not p.requires_grad} | plain_experts
        ignored_ids = {id(p) for p in ignored}
        if ignored:
            check_fsdp_leaves_out(cfg, _LEAVES_OUT)
        leave_out = {"ignored_params": ignored} if ignored else {}
        with torch.no_grad():
            for p in chunk.parameters():
                if id(p) not in ignored_ids:  # fp32 main weights are the shards themselves (buffers keep their dtype)
                    p.data = p.data.float()
        for m in expert_modules if expert_mesh is not None else ():
            fully_shard(m, mesh=expert_mesh, reshard_after_forward=not keep, mp_policy=policy)
            modules.append(m)
        for m in layers:
            fully_shard(m, mesh=dense_mesh, reshard_after_forward=not keep, mp_policy=policy, **leave_out)
            modules.append(m)
        fully_shard(chunk, mesh=dense_mesh, reshard_after_forward=not keep, mp_policy=policy, **leave_out)
        modules.append(chunk)
        _prefetch(layers)
        for n, p in chunk.named_parameters():
            p.__dict__.update({k: v for k, v in tags[n].items() if k not in p.__dict__})
            if p.requires_grad and isinstance(p, DTensor):
                (experts_fsdp if getattr(p, "expert_parallel", False) else dense).append(p)
            elif p.requires_grad:
                experts_plain.append(p)
    if keep:
        for m in modules:  # gathered once by the step's first forward, kept until finalize_grads
            m.set_reshard_after_backward(False)
    parts: list = [ShardedPart(dense, shard, copies=copies)]
    if experts_fsdp:
        # FSDP averages over expert DP; the grad buffer's rule is their sum over dense replicas (a divide factor
        # of FSDP's own would be a PREMUL_SUM reduction, which gloo lacks)
        parts.append(ShardedPart(experts_fsdp, ps.edp, scale=ps.edp_size / ps.dp_cp_size))
    elif experts_plain:  # one rank per expert DP group: nothing to shard; their sum divided by dp x cp
        parts.append(
            GradBuffer(
                experts_plain, ps.edp, grad_dtype=torch.float32, average_over=ps.dp_cp_size, recorder=ps.recorder
            )
        )
    return FSDPGrads(parts, modules, dtype)
