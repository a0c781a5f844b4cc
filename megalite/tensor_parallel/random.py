"""Random numbers that do not depend on the parallel layout.

Two concerns live here:

* **Initialisation.** Every parameter's *full* weight is drawn from a generator
  seeded by (seed, the parameter's global name), and each tensor-parallel rank
  keeps its slice. The full model is therefore identical for any TP/PP layout,
  which is what lets every parallel run be checked against one process.
* **Dropout.** Inside the tensor-parallel region (attention heads, MLP shards)
  each TP rank owns different activations, so its dropout masks must differ;
  outside it (the replicated hidden state) all TP ranks must draw the same mask.
  ``RNGTracker`` keeps a separate generator state for the TP region and swaps
  it in with ``tracker.fork()`` (Megatron's CudaRNGStatesTracker, on any device).
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from typing import Dict, Iterator, Sequence

import torch

from megalite.parallel.eager import eager

# Offsets as in Megatron, so seeds line up with runs users know.
_TP_REGION_SEED_OFFSET = 2718
_PP_SEED_STRIDE = 100


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one named parameter (crc32 keeps it process-independent)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_normal(shape: Sequence[int], std: float, seed: int, name: str) -> torch.Tensor:
    """The full, unsharded weight N(0, std^2) for ``name``, identical on every rank and layout."""
    g = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32) * std


class RNGTracker:
    """Default-generator state for dropout plus a separate state for the TP region."""

    def __init__(self, seed: int, tp_rank: int, pp_rank: int, device: torch.device):
        self.device = device
        self.base_seed = seed + _PP_SEED_STRIDE * pp_rank
        self.tp_seed = self.base_seed + _TP_REGION_SEED_OFFSET + tp_rank
        # .on: a checkpointed forward runs again on this thread (per thread: a paired forward may run
        # beside a backward's recomputation)
        self._recomputation = threading.local()
        self.reset()

    def reset(self) -> None:
        """Seed the default generator (same on all TP ranks) and the TP-region state."""
        torch.manual_seed(self.base_seed)
        saved = self._get_state()
        torch.manual_seed(self.tp_seed)
        self.states: Dict[str, torch.Tensor] = {"tp": self._get_state()}
        self._set_state(saved)

    def _get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Run the body with the ``name`` generator state, then restore the default one."""
        saved = self._get_state()
        self._set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get_state()
            self._set_state(saved)

    @eager  # inside a compiled layer: one graph break (generator states are not traceable), the body eager
    def forked(self, name: str, fn, *args):
        """``fn(*args)`` with the ``name`` generator state (``fork``)."""
        with self.fork(name):
            return fn(*args)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """All states, for checkpoints and activation recomputation."""
        return {"default": self._get_state(), **{k: v.clone() for k, v in self.states.items()}}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._set_state(states["default"])
        self.states = {k: v.clone() for k, v in states.items() if k != "default"}

    @property
    def recomputing(self) -> bool:
        """True while a forward checkpointed with this tracker runs again in backward (on this thread):
        what it counts (MoE routing statistics) was counted by its first run."""
        return getattr(self._recomputation, "on", False)

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        """Mark the body (on this thread) as a checkpoint's recomputation."""
        outer, self._recomputation.on = self.recomputing, True
        try:
            yield
        finally:
            self._recomputation.on = outer


class _Checkpoint(torch.autograd.Function):
    """Run ``fn`` without keeping activations; rerun it in backward with the same random states."""

    @staticmethod
    def forward(ctx, fn, tracker, *args):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.rng_states = tracker.get_states()
        with torch.no_grad():
            out = fn(*args)
        ctx.save_for_backward(*args)
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        current = ctx.tracker.get_states()
        ctx.tracker.set_states(ctx.rng_states)  # the same dropout masks as the first forward
        try:
            with ctx.tracker.recomputation(), torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            ctx.tracker.set_states(current)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])


@eager  # inside a compiled layer (selective recompute): one graph break, the checkpoint runs eagerly
def checkpoint(fn, tracker: RNGTracker, *args: torch.Tensor):
    """Activation recomputation (Megatron's reentrant checkpoint): keep only ``args`` for backward.

    Both the default generator and the tracker's tensor-parallel state are
    saved before the forward and restored for the recomputation, so dropout
    draws the same masks. Without grad mode (evaluation) ``fn`` simply runs.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    return _Checkpoint.apply(fn, tracker, *args)
