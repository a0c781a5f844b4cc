"""The router: which experts each token goes to, with what weight, and the balancing losses.

::

    x [T, h] (this rank's tokens) -> logits = x W^T in fp32 [T, E]  (+ z-loss attached)
      softmax:  top-k of the logits, softmax over the k        (--moe-router-pre-softmax: softmax over
                all E first, then top-k of the probabilities)
      sigmoid:  top-k of sigmoid(logits), normalised over the k (DeepSeek-V3)
      expert bias (DeepSeek-V3's auxiliary-loss-free balancing, sigmoid only): added to the scores for choosing
                the top-k only, never to the weights; moved after each step toward equal loads
      capacity: with --moe-expert-capacity-factor each expert keeps ceil(T x k / E x factor) of its
                tokens (the highest probabilities, or the first positions); the others are dropped
    -> routing map [T, E] (bool) and probs [T, E] (the weight of each kept choice, 0 elsewhere)

The balancing losses follow megatron-core. The micro-batch's tokens are split over the tp x cp
ranks (sequence parallelism, context parallelism), so expert loads are summed over that group
and each rank's loss is its own tokens' part: the parts add up to the loss of the whole
micro-batch, and the router's replicated weight sums its gradient over TP as sequence-parallel
weights do. A loss reaches backward through ``AuxLossScaler``: the activation it is attached to
passes unchanged, and in backward the loss gets the gradient the LM loss of one micro-batch
gets: its router's ``aux_loss_scale``, which the executor sets every step (``set_aux_loss_scale``:
loss scale / micro-batches, x cp).
"""

from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.state import AxisGroup
from megalite.tensor_parallel.layers import set_tp_attributes
from megalite.tensor_parallel.random import full_normal


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``x``; in backward the attached ``loss`` gets d/dloss = ``router.aux_loss_scale``
    (read then: the value of the step that runs the backward)."""

    @staticmethod
    def forward(ctx, x, loss, router):
        ctx.save_for_backward(loss)
        ctx.router = router
        return x

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.router.aux_loss_scale), None


def sum_over(t: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum of ``t`` over ``group`` (no gradient: counts)."""
    if group.size > 1:
        t = t.clone()
        group.collective(dist.all_reduce, t)
    return t


def capacity(tokens: int, topk: int, experts: int, factor: float) -> int:
    """Megatron's expert capacity: ceil(tokens x topk / experts x factor)."""
    return int(math.ceil(tokens * topk / experts * factor))


class Router(nn.Module):
    """Top-k router of one MoE layer; ``forward`` gives (routing map, probs) and records statistics."""

    def __init__(self, cfg: ModelConfig, seed: int, prefix: str, tp_cp: AxisGroup):
        super().__init__()
        self.cfg, self.tp_cp = cfg, tp_cp
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.weight = nn.Parameter(
            full_normal((cfg.num_experts, cfg.hidden_size), cfg.init_method_std, seed, f"{prefix}.weight")
        )
        set_tp_attributes(self.weight, False)
        self.expert_bias = None
        if cfg.moe_router_enable_expert_bias:  # not trained by the optimizer: moved by update_expert_bias
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
            set_tp_attributes(self.expert_bias, False)
        self.dtype = torch.float64 if cfg.moe_router_dtype == "fp64" else torch.float32
        self.local_tokens_per_expert = torch.zeros(cfg.num_experts)  # this step's loads (expert bias)
        self.aux_loss_scale = 1.0  # d(total loss)/d(aux loss): set by the executor each step (set_aux_loss_scale)

    def keep_fp32(self) -> None:
        """After the model is cast to bf16/fp16: the expert bias stays fp32 (as megatron-core keeps it)."""
        if self.expert_bias is not None:
            self.expert_bias.data = self.expert_bias.data.float()

    def _scores(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k indices [T, k], their weights [T, k], scores for the aux loss [T, E])."""
        k, bias = self.topk, self.expert_bias
        if self.cfg.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            choose = scores + bias.to(scores.dtype) if bias is not None else scores
            idx = torch.topk(choose, k, dim=-1).indices
            probs = scores.gather(1, idx)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
            return idx, probs, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        full = torch.softmax(logits, dim=-1)  # (the expert bias needs the sigmoid router: validate_moe.py)
        if self.cfg.moe_router_pre_softmax:
            idx = torch.topk(full, k, dim=-1).indices
            return idx, full.gather(1, idx), full
        idx = torch.topk(logits, k, dim=-1).indices
        return idx, torch.softmax(logits.gather(1, idx), dim=-1), full

    def _drop(self, routing: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keep at most ``capacity`` tokens per expert (probs: the highest weights; position: the first)."""
        cfg, T = self.cfg, routing.shape[0]
        cap = min(T, capacity(T, self.topk, self.num_experts, cfg.moe_expert_capacity_factor))
        if cfg.moe_token_drop_policy == "probs":
            keep_idx = torch.topk(probs, cap, dim=0, sorted=False).indices  # [cap, E]
        else:
            order = torch.where(routing, torch.arange(T, 0, -1, device=routing.device)[:, None], 0)
            keep_idx = torch.topk(order, cap, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing).scatter_(0, keep_idx, True)
        routing = routing & keep
        return routing, probs * routing

    def forward(self, x: torch.Tensor, seq_batch: Tuple[int, int], record) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (routing map [T, E] bool, probs [T, E] in fp32). ``record(name, value)`` keeps a
        statistic (None: nothing recorded, e.g. in a recomputation)."""
        cfg = self.cfg
        logits = F.linear(x.to(self.dtype), self.weight.to(self.dtype))
        if cfg.moe_z_loss_coeff:
            z = torch.logsumexp(logits, dim=-1).square().mean()
            if torch.is_grad_enabled():
                logits = AuxLossScaler.apply(logits, z * (cfg.moe_z_loss_coeff / self.tp_cp.size), self)
            if record is not None:
                record("z_loss", z.detach() / self.tp_cp.size)  # parts over tp x cp add up to the mean
        idx, top, aux_scores = self._scores(logits)
        routing = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, True)
        probs = torch.zeros_like(logits).scatter(1, idx, top)
        if cfg.moe_expert_capacity_factor is not None:
            routing, probs = self._drop(routing, probs)
        counts = routing.sum(dim=0)  # after dropping: what the experts compute
        if cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff > 0:
            # the loads the loss sees are the unbiased choices (megatron-core's): the expert bias only steers
            aux = self._aux_loss(
                aux_scores,
                torch.topk(aux_scores, self.topk, dim=-1).indices if self.expert_bias is not None else idx,
                seq_batch,
            )
            if torch.is_grad_enabled():
                probs = AuxLossScaler.apply(probs, aux * cfg.moe_aux_loss_coeff, self)
            if record is not None:  # megatron-core's names for the two kinds
                record(
                    "load_balancing_loss"
                    if cfg.moe_router_load_balancing_type == "aux_loss"
                    else "seq_load_balancing_loss",
                    aux.detach(),
                )
        if record is not None:
            record("tokens_per_expert", counts.detach().float())
            if self.expert_bias is not None and self.training:
                self.local_tokens_per_expert = self.local_tokens_per_expert.to(counts.device) + counts.detach()
        return routing, probs

    def _aux_loss(self, scores: torch.Tensor, idx: torch.Tensor, seq_batch: Tuple[int, int]) -> torch.Tensor:
        """This rank's part of the load-balancing loss (before the coefficient): E / (k T^2) x
        sum_e P_e f_e over the micro-batch (aux_loss), or the same per sequence, averaged (seq_aux_loss)."""
        E, k, T_local = self.num_experts, self.topk, scores.shape[0]
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0)  # before dropping, as megatron-core
        n = self.tp_cp.size
        if self.cfg.moe_router_load_balancing_type == "aux_loss":
            total = T_local * n
            loads = sum_over(chosen.sum(dim=0).detach(), self.tp_cp)
            return (scores.sum(dim=0) * loads).sum() * (E / (k * total * total))
        s, b = seq_batch  # tokens are [s, b] flattened: token s_i * b + b_i
        S = s * n
        loads = sum_over(chosen.view(s, b, E).sum(dim=0).detach(), self.tp_cp)  # [b, E] per sequence
        return ((scores.view(s, b, E).sum(dim=0) * loads).sum(dim=1) * (E / (k * S * S))).mean()


def routers_of(modules: Iterable[nn.Module]) -> List[Router]:
    """Every MoE router inside ``modules`` (a rank's model chunks), in module order."""
    return [m for module in modules for m in module.modules() if isinstance(m, Router)]


def set_aux_loss_scale(routers: Iterable[Router], scale: float) -> None:
    """The gradient each auxiliary loss attached by ``routers`` receives in backward (the executor sets
    it each step: its loss scale / micro-batches, x cp)."""
    for router in routers:
        router.aux_loss_scale = float(scale)
