"""Mixture of experts: router, experts, token dispatch over the expert-parallel group (README, MoE)."""

from megalite.moe.layer import MoELayer, moe_layers, update_expert_bias
from megalite.moe.router import routers_of, set_aux_loss_scale

__all__ = ["MoELayer", "moe_layers", "routers_of", "set_aux_loss_scale", "update_expert_bias"]
