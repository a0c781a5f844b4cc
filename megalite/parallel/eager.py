"""Code that compiled layers call but torch.compile does not trace: a clean graph break around it.

``eager(fn)``: in eager mode ``fn`` itself runs (no cost); while dynamo traces a compiled layer,
the call becomes one graph break and ``fn`` runs eagerly between the two graphs. It marks the
tensor-parallel collectives (gloo/NCCL calls recorded by the flight recorder), the selective-recompute
checkpoint (it saves and restores random states), the context-parallel attention (a ring of p2p
exchanges) and the MoE block (token counts per expert change every step: traced, it would recompile).
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_compiler = getattr(torch, "compiler", None)
_disable = getattr(_compiler, "disable", None) or torch._dynamo.disable  # torch.compiler's from 2.1
# True while dynamo traces the caller (torch.compiler.is_compiling from torch 2.3; older: dynamo's own)
is_compiling: Callable[[], bool] = getattr(_compiler, "is_compiling", None) or torch._dynamo.is_compiling


def eager(fn: F) -> F:
    """``fn`` unchanged in eager mode; a graph break with ``fn`` run eagerly inside a compiled region."""
    outside = _disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return outside(*args, **kwargs) if is_compiling() else fn(*args, **kwargs)

    return call
