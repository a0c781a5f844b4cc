"""Adam(W) over a rank's model chunks, with Megatron's weight-decay grouping.

Biases and 1-D parameters (norm weights) are not decayed. NVIDIA apex's
FusedAdam is used when importable on GPU; otherwise torch's AdamW (fused on
CUDA, foreach on CPU). Mixed precision and the distributed optimizer wrap this
later without changing the training loop.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from megalite.config import OptimConfig

try:
    from apex.optimizers import FusedAdam as _ApexFusedAdam  # type: ignore
except Exception:  # noqa: BLE001
    _ApexFusedAdam = None


def param_groups(params: Sequence[nn.Parameter], weight_decay: float) -> List[dict]:
    """Split parameters into decayed (matrices) and non-decayed (biases, norms) groups."""
    decay = [p for p in params if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in params if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(params: Sequence[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay, as Megatron's ``--optimizer adam``."""
    groups = param_groups(params, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    if on_cuda and _ApexFusedAdam is not None:
        return _ApexFusedAdam(groups, adam_w_mode=True, **kwargs)
    if on_cuda:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)
