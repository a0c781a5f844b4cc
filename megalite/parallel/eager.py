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

_disable = getattr(getattr(torch, "compiler", None), "disable", None) or torch._dynamo.disable


def is_compiling() -> bool:
    """True while dynamo traces the caller (torch.compiler.is_compiling from torch 2.3; older: dynamo's own)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if check is None:  # pragma: no cover - torch < 2.3
        return torch._dynamo.is_compiling()
    return check()


def eager(fn: F) -> F:
    """``fn`` unchanged in eager mode; a graph break with ``fn`` run eagerly inside a compiled region."""
    outside = _disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return outside(*args, **kwargs) if is_compiling() else fn(*args, **kwargs)

    return call
