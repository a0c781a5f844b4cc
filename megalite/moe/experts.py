"""The experts of one MoE layer held by this rank, and the shared expert.

An expert is the dense MLP's shape at --moe-ffn-hidden-size (GeLU or SwiGLU). This rank holds
experts ``ep_rank * E/EP .. (ep_rank + 1) * E/EP - 1`` of the layer, each split over the expert
tensor-parallel group (ETP) as a TP MLP is (fc1 by output rows, gate and up split separately;
fc2 by input columns). Their parameter names carry the global expert index
(``mlp.experts.local_experts.<e>.linear_fc1.weight``) and their initial values are drawn from the
full matrix of that name, so every EP/ETP layout builds the same model. Each is a
Column/RowParallelLinear whose group is ETP (the checkpoint layout reads ``module.tp``); no TP
collective runs inside: the dispatcher hands every ETP rank the same tokens and sums the fc2
partial outputs itself. Every parameter is tagged ``expert_parallel``: the optimizer reduces its
gradient over the expert data-parallel group.

Compute: one grouped GEMM per linear where torch has one (``torch._grouped_mm``, CUDA bf16, and
no split backward), otherwise a loop over the local experts. The grouped path pads each expert's
rows to the kernels' alignment with one gather and takes its offsets from the dispatcher's counts
on the device (``aligned_groups``): no zero buffer, no host-to-device copy. The loop's matmuls go through the
splittable linear of tensor_parallel.layers, so under a zero-bubble schedule the expert weight
GEMMs wait for W as the dense ones do.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.spec import MLPSpec, ModelSpec
from megalite.model.transformer import MLP
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, _matmul, set_tp_attributes
from megalite.tensor_parallel.random import full_normal

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


class Expert(nn.Module):
    """One expert's MLP (this rank's ETP shard of it)."""

    def __init__(self, cfg: ModelConfig, etp: AxisGroup, seed: int, prefix: str):
        super().__init__()
        self.spec = ModelSpec.of(cfg).moe.expert  # the expert's shape and activation (model/spec.py)
        ffn, h = self.spec.ffn, cfg.hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            h,
            list(self.spec.fc1_pieces),
            etp,
            bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std,
            seed=seed,
            name=f"{prefix}.linear_fc1",
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            h,
            etp,
            bias=cfg.add_bias_linear,
            init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers),
            seed=seed,
            name=f"{prefix}.linear_fc2",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, h] -> this shard's part of the output [n, h] (summed over ETP by the dispatcher)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        h = _matmul(x, fc1.weight, fc1.bias, None, fc1.split_wgrad)
        y = _matmul(_activation(self.spec, h), fc2.weight, None, None, fc2.split_wgrad)
        if fc2.bias is None:
            return y
        if fc2.tp.size == 1:
            return y + fc2.bias
        return _AddOnce.apply(y, fc2.bias, fc2.tp.rank == 0)


class LocalExperts(nn.Module):
    """This rank's experts of one layer: ``local_experts`` keyed by global expert index."""

    def __init__(self, cfg: ModelConfig, ep: AxisGroup, etp: AxisGroup, seed: int, prefix: str):
        super().__init__()
        self.cfg = cfg
        self.num_local = cfg.num_experts // ep.size
        self.first = ep.rank * self.num_local
        self.local_experts = nn.ModuleDict(
            {
                str(e): Expert(cfg, etp, seed, f"{prefix}.local_experts.{e}")
                for e in range(self.first, self.first + self.num_local)
            }
        )
        for p in self.parameters():
            p.expert_parallel = True
            p.first_of_etp = etp.rank == 0  # a copy replicated over ETP (fc2's bias) is counted there only

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
        experts = list(self.local_experts.values())
        if self._grouped(x) and pad_to is None:
            if device_counts is None:
                device_counts = torch.tensor(counts, device=x.device)
            return self._grouped_forward(x, counts, device_counts, experts)
        outs = []
        for expert, part in zip(experts, x.split(counts, dim=0)):
            n = part.shape[0]
            if pad_to is not None and pad_to > n:
                part = torch.cat([part, part.new_zeros(pad_to - n, part.shape[1])])
            outs.append(expert(part)[:n])
        return torch.cat(outs) if outs else x[:0]

    def _grouped(self, x: torch.Tensor) -> bool:
        return (
            _GROUPED_MM is not None
            and x.is_cuda
            and x.dtype == torch.bfloat16
            and not self.cfg.add_bias_linear
            and torch.cuda.get_device_capability(x.device)[0] >= 9  # its kernels: Hopper and later
            and x.shape[1] % 8 == 0
            and self.local_experts[str(self.first)].linear_fc2.weight.shape[1] % 8 == 0
            and not any(e.linear_fc1.split_wgrad for e in self.local_experts.values())
        )

    def _grouped_forward(
        self, x: torch.Tensor, counts: List[int], device_counts: torch.Tensor, experts: List[Expert]
    ) -> torch.Tensor:
        """One grouped GEMM per linear, each expert's rows padded to a multiple of 8 (the kernels' alignment)."""
        src, rows, offs = aligned_groups(counts, device_counts)
        w1 = torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2)  # [E, h, f]
        w2 = torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2)  # [E, f, h]
        h = _GROUPED_MM(x.index_select(0, src), w1, offs=offs)
        return _GROUPED_MM(_activation(experts[0].spec, h), w2, offs=offs).index_select(0, rows)


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
