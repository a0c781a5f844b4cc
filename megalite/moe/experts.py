"""The experts of one MoE layer held by this rank, and the shared expert.

An expert is the dense MLP's shape at --moe-ffn-hidden-size (GeLU or SwiGLU). This rank holds
experts ``ep_rank * E/EP .. (ep_rank + 1) * E/EP - 1`` of the layer, each split over the expert
tensor-parallel group (ETP) as a TP MLP is (fc1 by output rows, gate and up split separately;
fc2 by input columns). They are stored grouped, one parameter per linear as megatron-core's
GroupedMLP: ``linear_fc1.weight`` [E_local, f/etp (x2 gated), h], ``linear_fc2.weight``
[E_local, h, f/etp], biases [E_local, out]. Each expert's slice is drawn from the full matrix of
its global per-expert name (``mlp.experts.local_experts.<e>.linear_fc1.weight``), so every EP/ETP
layout builds the same model, and checkpoints, conversions and the optimizer's saved state keep
those per-expert names (tensor_parallel.layers.per_expert_names, checkpointing.layout). No TP
collective runs inside: the dispatcher hands every ETP rank the same tokens and sums the fc2
partial outputs itself. Every parameter is tagged ``expert_parallel``: the optimizer reduces its
gradient over the expert data-parallel group.

Compute: one grouped GEMM per linear where torch has one (``torch._grouped_mm``, CUDA bf16, and
no split backward) on the grouped weights as stored, otherwise a loop over the local experts: one
autograd node per linear (``_LoopLinear``) whose backward writes each expert's weight gradient into
its slice of one grouped gradient (slices taken with ``unbind`` would have autograd stack them, a copy
per call); with capacity padding or a split backward, per-expert slices (``unbind``). The grouped path pads each expert's rows to the kernels' alignment with one gather and
takes its offsets from the dispatcher's counts on the device (``aligned_groups``). Under a
zero-bubble schedule the loop's weight GEMMs wait for W as the dense ones do, each expert's dW
landing in its slice of the grouped gradient (tensor_parallel.layers.WeightGradStore).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.spec import MLPSpec, ModelSpec
from megalite.model.transformer import MLP
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightGradSplit,
    _Linear,
    set_tp_attributes,
)
from megalite.tensor_parallel.random import full_normal

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def _activation(mlp: MLPSpec, h: torch.Tensor) -> torch.Tensor:
    if mlp.gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if mlp.activation == "gelu_tanh" else "none")


class _AddOnce(torch.autograd.Function):
    """fc2's bias under expert tensor parallelism: the ETP ranks' partial outputs are summed, so only rank 0
    adds it; every rank gets its whole gradient (the upstream gradient is the same on all of them), so the
    replicated copies stay equal without a collective."""

    @staticmethod
    def forward(ctx, y, bias, add: bool):
        return y + bias if add else y.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.reshape(-1, grad.shape[-1]).sum(dim=0), None


class GroupedLinear(nn.Module):
    """One linear of every local expert, stored grouped: ``weight`` [E_local, out, in] (this rank's ETP
    shard of each expert's matrix: fc1's rows, fc2's columns, as Column/RowParallelLinear split them) and
    ``bias`` [E_local, out]. One parameter per linear as megatron-core's GroupedMLP: the grouped GEMM
    reads it as is, no per-step stack. Each expert's slice is drawn from the full matrix of its global
    per-expert name, so every EP/ETP layout builds the same model."""

    def __init__(self, cfg: ModelConfig, etp: AxisGroup, seed: int, prefix: str, experts: range, fc: int):
        super().__init__()
        spec = ModelSpec.of(cfg).moe.expert
        self.tp, self.experts, self.fc, self.prefix = etp, experts, fc, prefix
        std = cfg.init_method_std / (1.0 if fc == 1 else math.sqrt(2.0 * cfg.num_layers))
        layers = [self._layer(cfg, spec, etp, seed, std, f"{prefix}.local_experts.{e}.linear_fc{fc}") for e in experts]
        self.weight = nn.Parameter(torch.stack([m.weight.data for m in layers]))
        set_tp_attributes(self.weight, True, 1 if fc == 1 else 2)  # fc1: rows of each expert, fc2: columns
        self.bias = None
        if cfg.add_bias_linear:
            self.bias = nn.Parameter(torch.stack([m.bias.data for m in layers]))
            set_tp_attributes(self.bias, fc == 1, 1 if fc == 1 else -1)
        self.output_sizes = list(spec.fc1_pieces) if fc == 1 else [cfg.hidden_size]
        self.local_sizes = layers[0].local_sizes if fc == 1 else [cfg.hidden_size]
        self.split_wgrad: Optional[WeightGradSplit] = None  # set by enable_weight_grad_split (zero-bubble)
        rules = layers[0]  # its slicing rules for local_from_full, without a copy of any weight
        rules.weight, rules.bias = None, None
        self._rules = (rules,)  # in a tuple: not a submodule

    @staticmethod
    def _layer(cfg: ModelConfig, spec, etp: AxisGroup, seed: int, std: float, name: str) -> nn.Module:
        """One expert's Column/RowParallelLinear: its initial values (drawn from the full matrix of ``name``)."""
        bias = cfg.add_bias_linear
        if name.endswith("linear_fc1"):
            return ColumnParallelLinear(
                cfg.hidden_size, list(spec.fc1_pieces), etp, bias=bias, init_std=std, seed=seed, name=name
            )
        return RowParallelLinear(spec.ffn, cfg.hidden_size, etp, bias=bias, init_std=std, seed=seed, name=name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Each expert's slice under its per-expert name (the checkpoint keeps the per-expert layout)."""
        head = prefix[: len(prefix) - len(f"linear_fc{self.fc}.")]
        for pname, t in (("weight", self.weight), ("bias", self.bias)):
            if isinstance(t, DTensor):  # FSDP's shard of the experts (data_parallel.fsdp.gathered_state_dict)
                t = t.full_tensor()
            if t is not None:
                for i, e in enumerate(self.experts):
                    part = t[i] if keep_vars else t.detach()[i].clone()
                    destination[f"{head}local_experts.{e}.linear_fc{self.fc}.{pname}"] = part

    def local_from_full(self, pname: str, fulls: List[torch.Tensor]) -> torch.Tensor:
        """This rank's grouped tensor from each local expert's full tensor (in local order)."""
        return torch.stack([self._rules[0].local_from_full(pname, f) for f in fulls])


def _expert_linear(
    x: torch.Tensor, fc: GroupedLinear, w: torch.Tensor, b: Optional[torch.Tensor], i: int
) -> torch.Tensor:
    """x [n, in] @ local expert ``i``'s weight ``w`` (a slice of ``fc.weight``), splittable for zero-bubble."""
    if fc.split_wgrad:
        return _Linear.apply(x, w.detach(), b, None, (fc.weight, fc.split_wgrad, i))
    return F.linear(x, w, b)


class _LoopLinear(torch.autograd.Function):
    """Rows of local expert i (``counts[i]`` of them, in expert order) times W[i]^T (+ b[i]): one linear of every
    local expert in one autograd node. Its backward writes each expert's weight gradient straight into its
    slice of one grouped gradient; per-expert slices of the grouped weight (``unbind``) would have autograd
    stack them, a copy of every expert's weight gradient per call. ``add_bias``: False on the ETP ranks but
    the first for fc2 (their partial outputs are summed; every rank still gets the bias's whole gradient,
    so the replicated copies stay equal)."""

    @staticmethod
    def forward(ctx, x, weight, bias, counts: List[int], add_bias: bool):
        ctx.counts, ctx.has_bias = counts, bias is not None
        ctx.save_for_backward(x, weight)
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for i, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                torch.mm(x[rows], weight[i].t(), out=out[rows])
                if bias is not None and add_bias:
                    out[rows] += bias[i]
            start += n
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.empty_like(weight) if need_w else None
        db = grad.new_zeros(weight.shape[0], weight.shape[1]) if ctx.has_bias else None
        start = 0
        for i, n in enumerate(ctx.counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:  # no rows: a zero gradient for this expert
                if dw is not None:
                    dw[i].zero_()
                continue
            if dx is not None:
                torch.mm(grad[rows], weight[i], out=dx[rows])
            if dw is not None:
                torch.mm(grad[rows].t(), x[rows], out=dw[i])
            if db is not None:
                db[i] = grad[rows].sum(dim=0)
        return dx, dw, db, None, None


class _ExpertView:
    """One local expert seen through the grouped parameters (its slices, as views): what tests and the
    reference loop read as ``local_experts[str(e)]``. Registers nothing."""

    def __init__(self, owner: "LocalExperts", i: int):
        self.owner, self.i, self.spec = owner, i, owner.spec

    @property
    def linear_fc1(self) -> SimpleNamespace:
        return self._slices(self.owner.linear_fc1)

    @property
    def linear_fc2(self) -> SimpleNamespace:
        return self._slices(self.owner.linear_fc2)

    def _slices(self, fc: GroupedLinear) -> SimpleNamespace:
        return SimpleNamespace(weight=fc.weight[self.i], bias=None if fc.bias is None else fc.bias[self.i], tp=fc.tp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return self.owner._expert(x, self.i, (fc1.weight, fc1.bias, fc2.weight, fc2.bias))


class LocalExperts(nn.Module):
    """This rank's experts of one layer, grouped: ``linear_fc1`` / ``linear_fc2`` hold every local expert's
    weights ([E_local, ...]); ``local_experts`` views them per expert, keyed by global expert index. The
    checkpoints, conversions and the optimizer's saved state still name each expert's tensors
    ``local_experts.<e>.linear_fc{1,2}.*`` (e global): see tensor_parallel.layers.per_expert_names and
    checkpointing.layout."""

    def __init__(self, cfg: ModelConfig, ep: AxisGroup, etp: AxisGroup, seed: int, prefix: str):
        super().__init__()
        self.cfg, self.spec = cfg, ModelSpec.of(cfg).moe.expert
        self.num_local = cfg.num_experts // ep.size
        self.first = ep.rank * self.num_local
        experts = range(self.first, self.first + self.num_local)
        self.linear_fc1 = GroupedLinear(cfg, etp, seed, prefix, experts, 1)
        self.linear_fc2 = GroupedLinear(cfg, etp, seed, prefix, experts, 2)
        self.local_experts = {str(e): _ExpertView(self, i) for i, e in enumerate(experts)}
        for p in self.parameters():
            p.grouped_experts = tuple(experts)  # saved per expert: tensor_parallel.layers.per_expert_names
            p.expert_parallel = True
            p.first_of_etp = etp.rank == 0  # a copy replicated over ETP (fc2's bias) is counted there only

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Join the per-expert tensors of a checkpoint into the grouped parameters' keys first."""
        for fc in (self.linear_fc1, self.linear_fc2):
            for pname in ("weight", "bias"):
                keys = [f"{prefix}local_experts.{e}.linear_fc{fc.fc}.{pname}" for e in fc.experts]
                if all(k in state_dict for k in keys):
                    state_dict[f"{prefix}linear_fc{fc.fc}.{pname}"] = torch.stack([state_dict.pop(k) for k in keys])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self,
        x: torch.Tensor,
        counts: List[int],
        pad_to: Optional[int] = None,
        device_counts: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [sum(counts), h]: the tokens of local expert 0, then 1, ... -> their outputs, same order.
        ``pad_to``: run each expert on exactly that many rows (zero padding, dropped after).
        ``device_counts``: ``counts`` as a tensor on x's device (the grouped GEMM's offsets come from it
        without a host-to-device copy)."""
        if self._grouped(x) and pad_to is None:
            if device_counts is None:
                device_counts = torch.tensor(counts, device=x.device)
            return self._grouped_forward(x, counts, device_counts)
        if pad_to is None and not self.linear_fc1.split_wgrad:
            return self._loop_forward(x, counts)
        outs = []
        for i, (part, slices) in enumerate(zip(x.split(counts, dim=0), self._slices())):
            n = part.shape[0]
            if pad_to is not None and pad_to > n:
                part = torch.cat([part, part.new_zeros(pad_to - n, part.shape[1])])
            outs.append(self._expert(part, i, slices)[:n])
        return torch.cat(outs) if outs else x[:0]

    def _loop_forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """The experts one after the other on the grouped weights, each linear one autograd node (_LoopLinear):
        no per-expert slices, cats or stacked gradients."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        h = _LoopLinear.apply(x, fc1.weight, fc1.bias, counts, True)
        return _LoopLinear.apply(_activation(self.spec, h), fc2.weight, fc2.bias, counts, fc2.tp.rank == 0)

    def _slices(self) -> List[tuple]:
        """Each local expert's (fc1 weight, fc1 bias, fc2 weight, fc2 bias): unbind, not indexing, so backward
        gathers the experts' gradients into one grouped gradient instead of one full-size tensor per expert."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        parts = [
            t.unbind(0) if t is not None else [None] * self.num_local
            for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        ]
        return list(zip(*parts))

    def _expert(self, x: torch.Tensor, i: int, slices: tuple) -> torch.Tensor:
        """Local expert ``i`` (its slices ``(w1, b1, w2, b2)``) on x [n, h] -> this shard's part of its output
        [n, h] (summed over ETP by the dispatcher)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        w1, b1, w2, b2 = slices
        y = _expert_linear(_activation(self.spec, _expert_linear(x, fc1, w1, b1, i)), fc2, w2, None, i)
        if b2 is None:
            return y
        if fc2.tp.size == 1:
            return y + b2
        return _AddOnce.apply(y, b2, fc2.tp.rank == 0)

    def _grouped(self, x: torch.Tensor) -> bool:
        return (
            _GROUPED_MM is not None
            and x.is_cuda
            and x.dtype == torch.bfloat16
            and not self.cfg.add_bias_linear
            and torch.cuda.get_device_capability(x.device)[0] >= 9  # its kernels: Hopper and later
            and x.shape[1] % 8 == 0
            and self.linear_fc2.weight.shape[2] % 8 == 0
            and not self.linear_fc1.split_wgrad
        )

    def _grouped_forward(
        self, x: torch.Tensor, counts: List[int], device_counts: torch.Tensor, experts: Optional[list] = None
    ) -> torch.Tensor:
        """One grouped GEMM per linear on the grouped weights as stored, each expert's rows padded to a
        multiple of 8 (the kernels' alignment). ``experts`` is ignored (the grouped weights are read whole)."""
        src, rows, offs = aligned_groups(counts, device_counts)
        w1 = self.linear_fc1.weight.transpose(1, 2)  # [E, h, f]: a view, no copy
        w2 = self.linear_fc2.weight.transpose(1, 2)  # [E, f, h]
        h = _GROUPED_MM(x.index_select(0, src), w1, offs=offs)
        return _GROUPED_MM(_activation(self.spec, h), w2, offs=offs).index_select(0, rows)


def aligned_groups(
    counts: List[int], device_counts: torch.Tensor, align: int = 8
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped GEMM's row layout when each group's rows start at a multiple of ``align``:
    (source row of every padded row, padded row of every real row, int32 end offsets), on the device.

    A padding row repeats its group's last real row instead of being zero, so the input is one gather
    (no zero buffer filled then scattered into): its outputs are never read, so its gradient is zero and
    adds nothing to the weights' gradient (Megatron pads dropped tokens the same way)."""
    dev, n = device_counts.device, sum(counts)
    total = sum(-(-c // align) * align for c in counts)  # from the host's counts: no sync
    groups = torch.arange(len(counts), device=dev)
    padded = (device_counts + align - 1) // align * align
    offs = padded.cumsum(0)
    pad_start, real_start = offs - padded, device_counts.cumsum(0) - device_counts
    g = torch.repeat_interleave(groups, padded, output_size=total)  # group of each padded row
    within = torch.arange(total, device=dev) - pad_start[g]
    src = real_start[g] + torch.minimum(within, device_counts[g] - 1)
    g = torch.repeat_interleave(groups, device_counts, output_size=n)  # group of each real row
    rows = pad_start[g] + torch.arange(n, device=dev) - real_start[g]
    return src, rows, offs.to(torch.int32)


class SharedExpert(MLP):
    """The shared expert: a dense TP MLP of --moe-shared-expert-intermediate-size every token passes
    through, its output optionally scaled by sigmoid(x . gate_weight) (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig, tp: AxisGroup, seed: int, prefix: str, sequence_parallel: bool):
        super().__init__(cfg, tp, seed, prefix, sequence_parallel, ffn=cfg.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(
                full_normal((1, cfg.hidden_size), cfg.init_method_std, seed, f"{prefix}.gate_weight")
            )
            set_tp_attributes(self.gate_weight, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out
