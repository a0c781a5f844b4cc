"""What the log line reports of the MoE layers: balancing losses and tokens per expert, reduced over ranks.

Each layer's ``stats`` hold this rank's part summed over the step's micro-batches (layer.py). Summed
over every rank of the world, a layer's loss counts each micro-batch of the global batch once (its
tp x cp parts add up; data-parallel ranks hold other micro-batches; other stages hold other layers),
so dividing by dp x m gives the mean over micro-batches: what one process logs for the same batch.
As in Megatron-LM, the losses are logged without their coefficients, averaged over the MoE layers
(``--moe-per-layer-logging`` adds each layer's); tokens per expert are the step's routed tokens of
each expert over the whole global batch (min / mean / max over experts, averaged over layers).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.parallel.state import ParallelState

LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def logged_losses(cfg: ModelConfig) -> tuple:
    """The MoE losses this model computes (and the log line reports)."""
    out = []
    if cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff > 0:
        out.append(
            "load_balancing_loss" if cfg.moe_router_load_balancing_type == "aux_loss" else "seq_load_balancing_loss"
        )
    if cfg.moe_z_loss_coeff:
        out.append("z_loss")
    return tuple(out)


def reduce_moe_stats(
    layers: Sequence, ps: ParallelState, num_microbatches: int, cfg: Optional[ModelConfig] = None
) -> Dict[str, float]:
    """The step's MoE figures, the same on every rank (a collective over the whole world: every rank
    calls it, with its own MoE layers, possibly none). Keys: ``load_balancing_loss`` (``seq_load_balancing_loss``
    with seq_aux_loss) / ``z_loss`` (mean
    over MoE layers), ``<loss> layer <i>`` per MoE layer, ``tokens_per_expert_min/mean/max``."""
    cfg = cfg if cfg is not None else layers[0].cfg
    L, E = cfg.num_layers, cfg.num_experts
    flat = torch.zeros(L * (len(LOSSES) + E), device=ps.device)
    losses, counts = flat[: L * len(LOSSES)].view(len(LOSSES), L), flat[L * len(LOSSES) :].view(L, E)
    for layer in layers:
        for k, name in enumerate(LOSSES):
            if name in layer.stats:
                losses[k, layer.layer_number] += layer.stats[name].to(ps.device)
        if "tokens_per_expert" in layer.stats:
            counts[layer.layer_number] += layer.stats["tokens_per_expert"].to(ps.device)
    if ps.world_size > 1 and dist.is_initialized():  # recorded: every iteration, the log's own collective
        ps.recorder.call("world", dist.all_reduce, flat)
    losses = losses / (ps.dp_size * num_microbatches)
    moe = [i for i in range(L) if cfg.is_moe_layer(i)]
    out: Dict[str, float] = {}
    for k, name in enumerate(LOSSES):
        if name in logged_losses(cfg):
            out[name] = float(losses[k, moe].mean())
            out.update({f"{name} layer {i}": float(losses[k, i]) for i in moe})
    c = counts[moe]
    out.update(
        tokens_per_expert_min=float(c.min(dim=1).values.mean()),
        tokens_per_expert_mean=float(c.mean()),
        tokens_per_expert_max=float(c.max(dim=1).values.mean()),
    )
    for i in moe:
        out.update(
            {
                f"tokens_per_expert_min layer {i}": float(counts[i].min()),
                f"tokens_per_expert_max layer {i}": float(counts[i].max()),
            }
        )
    return out
