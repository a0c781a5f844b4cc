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
no split backward), otherwise a loop over the local experts. The loop's matmuls go through the
splittable linear of tensor_parallel.layers, so under a zero-bubble schedule the expert weight
GEMMs wait for W as the dense ones do.
"""

from __future__ import annotations

import math
from typing import List, Optional

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

    def forward(self, x: torch.Tensor, counts: List[int], pad_to: Optional[int] = None) -> torch.Tensor:
        """x [sum(counts), h]: the tokens of local expert 0, then 1, ... -> their outputs, same order.
        ``pad_to``: run each expert on exactly that many rows (zero padding, dropped after)."""
        experts = list(self.local_experts.values())
        if self._grouped(x) and pad_to is None:
            return self._grouped_forward(x, counts, experts)
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

    def _grouped_forward(self, x: torch.Tensor, counts: List[int], experts: List[Expert]) -> torch.Tensor:
        """One grouped GEMM per linear; each expert's rows padded to a multiple of 8 (the kernels' alignment)."""
        padded = [-(-n // 8) * 8 for n in counts]
        starts = torch.tensor([0] + padded[:-1], device=x.device).cumsum(0)
        rows = torch.cat([torch.arange(n, device=x.device) + s for n, s in zip(counts, starts)])  # real rows
        xp = x.new_zeros(sum(padded), x.shape[1]).index_copy(0, rows, x)
        offs = torch.tensor(padded, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2)  # [E, h, f]
        w2 = torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2)  # [E, f, h]
        h = _GROUPED_MM(xp, w1, offs=offs)
        return _GROUPED_MM(_activation(experts[0].spec, h), w2, offs=offs).index_select(0, rows)


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
