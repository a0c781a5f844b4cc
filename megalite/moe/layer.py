"""The MoE block that takes the MLP's place in a transformer layer.

::

    x [s, b, h] (under SP: this rank's [s/tp, b, h]) -> tokens [T, h]
      -> router: routing map, probs (+ balancing losses attached for backward)
      -> dispatcher (allgather | alltoall over ETP x EP) -> local experts -> combined [T, h]
      (+ shared expert, a dense TP MLP every token passes through)
    -> [s, b, h]

Statistics of the iteration (for the log line) accumulate in ``stats`` until ``reset_stats``:
``load_balancing_loss`` and ``z_loss`` (this rank's part, summed over micro-batches; parts over
tp x cp add up), ``tokens_per_expert`` [E] (this rank's routed tokens, summed). A checkpoint's
recomputation runs the forward again without counting (its RNGTracker's ``recomputing``).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from megalite.moe.experts import LocalExperts, SharedExpert
from megalite.moe.router import Router, capacity
from megalite.parallel.eager import eager
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker


class MoELayer(nn.Module):
    """Router + experts (+ shared expert) of one layer; parameter names ``mlp.router.*``,
    ``mlp.experts.local_experts.<e>.*``, ``mlp.shared_experts.*`` (megatron-core's)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        seed: int,
        prefix: str,
        sequence_parallel: bool,
        dispatcher: str = "allgather",
        layer: int = 0,
        *,
        tracker: RNGTracker,
    ):
        super().__init__()
        self.cfg, self.layer_number = cfg, layer
        self.tracker = tracker  # the chunk's: its checkpoints mark their recomputation there
        self.router = Router(cfg, seed, f"{prefix}.router", ps.tp_cp)
        self.experts = LocalExperts(cfg, ps.ep, ps.etp, seed, f"{prefix}.experts")
        self.shared_experts = (
            SharedExpert(cfg, ps.tp, seed, f"{prefix}.shared_experts", sequence_parallel)
            if cfg.moe_shared_expert_intermediate_size
            else None
        )
        self.dispatcher_type = dispatcher
        self.dispatch = (
            AllToAllDispatcher(ps.expert_mp, self.experts, ps.etp_size)
            if dispatcher == "alltoall"
            else AllGatherDispatcher(ps.expert_mp, self.experts)
        )
        self.stats: Dict[str, torch.Tensor] = {}

    def reset_stats(self) -> None:
        self.stats = {}

    def _record(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.stats[name] = self.stats[name] + value if name in self.stats else value.clone()

    @eager  # data-dependent token counts per expert: eager inside a compiled layer (README, --compile)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        record = self._record if self.training and not self.tracker.recomputing else None
        routing, probs = self.router(tokens, (s, b), record)
        pad_to = None
        if self.cfg.moe_pad_expert_input_to_capacity:
            pad_to = capacity(
                s * b, self.cfg.moe_router_topk, self.cfg.num_experts, self.cfg.moe_expert_capacity_factor
            )
        out = self.dispatch(tokens, routing, probs, pad_to).view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def moe_layers(chunks) -> list:
    """Every MoE layer of ``chunks`` (model chunks), in layer order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def update_expert_bias(chunks, ps: ParallelState, rate: Optional[float] = None) -> None:
    """DeepSeek-V3's balancing after a step: each expert's bias += rate x sign(mean load - its load), the
    loads summed over every rank of the stage (all micro-batches of the step); the counts then restart."""
    layers = [m for m in moe_layers(chunks) if m.router.expert_bias is not None]
    if not layers:
        return
    import torch.distributed as dist

    loads = torch.stack([m.router.local_tokens_per_expert.to(ps.device).float() for m in layers])
    if ps.stage.size > 1:
        ps.stage.collective(dist.all_reduce, loads)
    for m, load in zip(layers, loads):
        r = m.cfg.moe_router_bias_update_rate if rate is None else rate
        with torch.no_grad():
            m.router.expert_bias.add_(torch.sign(load.mean() - load) * r)
        m.router.local_tokens_per_expert = torch.zeros_like(m.router.local_tokens_per_expert)
