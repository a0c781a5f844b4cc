"""Counting the calls of a function that would make a GPU wait for the host (tests/unit/test_moe_syncs.py
explains why they are counted on CPU): host reads through a TorchFunctionMode, ops whose output size depends
on the data through a TorchDispatchMode (which also sees the backward's ops)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}
_DATA_SHAPED = {"nonzero", "masked_select", "bincount", "unique", "_unique2", "unique_dim", "unique_consecutive"}


class _Reads(TorchFunctionMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _HOST_READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _DataShaped(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        bool_index = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        free_size = name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3
        if name in _DATA_SHAPED or bool_index or free_size:
            self.seen.append(name)
        return func(*args, **kwargs)


def count_syncs(fn):
    """(what ``fn()`` returned, the calls in it that would wait for a GPU)."""
    seen = []
    with _Reads(seen), _DataShaped(seen):
        out = fn()
    return out, seen
