"""Loss scaling for fp16 training: constant, or dynamic with Megatron's rules.

Dynamic scaling (Megatron's DynamicGradScaler): start at ``initial_scale``;
on an overflow the step is skipped and, once ``hysteresis`` overflows have been
seen since the last growth, the scale is halved (never below ``min_scale``);
after ``growth_interval`` (``--loss-scale-window``) overflow-free steps in a
row the scale doubles and the hysteresis budget is refilled. The state is
part of the optimizer's state dict, so a resumed run continues with the same
scale.
"""

from __future__ import annotations

from typing import Dict


class ConstantGradScaler:
    """A fixed scale (``--loss-scale``); overflowing steps are still skipped."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Halve on overflow (after ``hysteresis`` of them), double after ``growth_interval`` clean steps."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.scale = float(initial_scale)
        self.min_scale, self.growth_interval, self.hysteresis = float(min_scale), growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> Dict[str, float]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
