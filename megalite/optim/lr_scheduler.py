"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min-lr.

Same arithmetic as Megatron's OptimizerParamScheduler (counted in iterations):
during warmup lr = max_lr * step / warmup (so the very first step uses 0 when
warmup > 0); afterwards the decay ratio is (step - warmup) / (decay - warmup)
and past ``lr_decay_iters`` the rate stays at ``min_lr``.

The state saved holds the settings with the step count. Resuming with other settings is refused,
as Megatron does, unless ``--override-opt_param-scheduler`` (the settings given win) or
``--use-checkpoint-opt_param-scheduler`` (the saved ones win). State saved before the settings
were recorded (``num_steps`` only) loads as it always did. Two leniencies against Megatron: with
``constant`` decay on both sides, ``--min-lr`` and the decay length are not compared (they do not
change the rate), and a longer ``--train-iters`` passes when ``--lr-decay-iters`` is given and equal
(Megatron also compares its weight-decay increment length, which follows ``--train-iters``).
"""

from __future__ import annotations

import math
from typing import Dict, Union

import torch

from megalite.checkpointing.safe_load import CheckpointError
from megalite.config import OptimConfig

# (state key, attribute, flag): the settings the schedule is made of
SETTINGS = (
    ("lr", "lr", "--lr"),
    ("min_lr", "min_lr", "--min-lr"),
    ("lr_warmup_iters", "warmup", "--lr-warmup-iters"),
    ("lr_decay_iters", "decay_iters", "--lr-decay-iters"),
    ("lr_decay_style", "style", "--lr-decay-style"),
)


class LRScheduler:
    """Sets ``lr`` on every param group of an optimizer, once per iteration."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, train_iters: int):
        self.optimizer, self.cfg = optimizer, cfg
        self.lr, self.min_lr, self.style = cfg.lr, cfg.min_lr, cfg.lr_decay_style
        self.warmup, self.decay_iters = cfg.lr_warmup_iters, cfg.lr_decay_iters or train_iters
        self.num_steps = 0
        self._apply()

    def get_lr(self, step: int = None) -> float:
        """The learning rate for iteration ``step`` (default: the current one)."""
        step = self.num_steps if step is None else step
        warmup = self.warmup
        if warmup > 0 and step <= warmup:
            return self.lr * step / warmup
        if self.style == "constant":
            return self.lr
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - warmup) / max(1, self.decay_iters - warmup)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"unknown --lr-decay-style {self.style!r}")
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> Dict[str, Union[int, float, str]]:
        return {"num_steps": self.num_steps, **{key: getattr(self, attr) for key, attr, _ in SETTINGS}}

    def load_state_dict(self, state: Dict[str, Union[int, float, str]]) -> None:
        """Resume at ``state``'s step; its settings are checked against this run's (see the module docstring)."""
        saved = {key: state[key] for key, _, _ in SETTINGS if key in state}
        if self.cfg.use_checkpoint_opt_param_scheduler:
            for key, attr, _ in SETTINGS:
                setattr(self, attr, saved.get(key, getattr(self, attr)))
        elif not self.cfg.override_opt_param_scheduler:
            self._refuse_changes(saved)
        self.num_steps = state["num_steps"]
        self._apply()

    def _refuse_changes(self, saved: Dict[str, Union[int, float, str]]) -> None:
        constant = self.style == "constant" and saved.get("lr_decay_style", self.style) == "constant"
        diffs = []
        for key, attr, flag in SETTINGS:
            if key not in saved or (constant and key in ("min_lr", "lr_decay_iters")):  # no decay: they do nothing
                continue
            if saved[key] != getattr(self, attr):
                implied = ", from --train-iters" if key == "lr_decay_iters" and not self.cfg.lr_decay_iters else ""
                diffs.append(f"{flag} {getattr(self, attr)} (given{implied}) vs {saved[key]} (checkpoint)")
        if diffs:
            raise CheckpointError(
                f"the learning-rate schedule differs from the checkpoint's: {'; '.join(diffs)}; "
                f"pass --override-opt_param-scheduler to use the values given or "
                f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
