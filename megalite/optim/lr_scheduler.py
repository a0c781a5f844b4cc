"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min-lr.

Same arithmetic as Megatron's OptimizerParamScheduler (counted in iterations):
during warmup lr = max_lr * step / warmup (so the very first step uses 0 when
warmup > 0); afterwards the decay ratio is (step - warmup) / (decay - warmup)
and past ``lr_decay_iters`` the rate stays at ``min_lr``.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

from megalite.config import OptimConfig


class LRScheduler:
    """Sets ``lr`` on every param group of an optimizer, once per iteration."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, train_iters: int):
        self.optimizer, self.cfg = optimizer, cfg
        self.decay_iters = cfg.lr_decay_iters or train_iters
        self.num_steps = 0
        self._apply()

    def get_lr(self, step: int = None) -> float:
        """The learning rate for iteration ``step`` (default: the current one)."""
        step = self.num_steps if step is None else step
        cfg, warmup = self.cfg, self.cfg.lr_warmup_iters
        if warmup > 0 and step <= warmup:
            return cfg.lr * step / warmup
        if cfg.lr_decay_style == "constant":
            return cfg.lr
        if step > self.decay_iters:
            return cfg.min_lr
        ratio = (step - warmup) / max(1, self.decay_iters - warmup)
        if cfg.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif cfg.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"unknown --lr-decay-style {cfg.lr_decay_style!r}")
        return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> Dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.num_steps = state["num_steps"]
        self._apply()
