"""The gradient buffers of one rank: the dense parameters' (averaged over dp x cp) and, in a mixture of
experts, the experts' (summed over the expert data-parallel group, divided by dp x cp: each expert's
gradient already holds the tokens every rank of its expert-parallel group sent it).

``GradBuffers`` runs each step's calls on both, so the optimizer treats them as one.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from megalite.data_parallel.grad_buffer import Bucket, GradBuffer


class GradBuffers:
    """``parts[0]``: the dense buffer; ``parts[1]`` (MoE only): the experts'."""

    def __init__(self, parts: Sequence[GradBuffer]):
        self.parts: List[GradBuffer] = list(parts)

    @property
    def dense(self) -> GradBuffer:
        return self.parts[0]

    @property
    def dp(self):
        return self.dense.dp

    @property
    def grad_data(self):
        """The dense buffer's flat gradients (the experts' are ``parts[1].grad_data``)."""
        return self.dense.grad_data

    @property
    def nbytes(self) -> int:
        """Bytes of every gradient buffer."""
        return sum(part.grad_data.numel() * part.grad_data.element_size() for part in self.parts)

    @property
    def buckets(self) -> List[Bucket]:
        return [b for part in self.parts for b in part.buckets]

    @property
    def index(self) -> Dict[nn.Parameter, Tuple[int, int]]:
        return {p: span for part in self.parts for p, span in part.index.items()}

    def start_step(self, num_microbatches: int) -> None:
        for part in self.parts:
            part.start_step(num_microbatches)

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def gather_params(self, async_op: bool = False) -> None:
        for part in self.parts:
            part.gather_params(async_op)

    def wait_params(self, params: Optional[Sequence[nn.Parameter]] = None) -> None:
        for part in self.parts:
            part.wait_params(params)

    def install_param_gather_hooks(self, modules: Sequence[nn.Module]) -> None:
        for part in self.parts:
            if part.shard_grads:
                part.install_param_gather_hooks(modules)
