"""The sharded format: layout-free blocks on torch.distributed.checkpoint.

::

    iter_0000100/
      __<rank>_0.distcp  .metadata   every tensor block once, written by the DP-rank-0 replica owning it
      index_<rank>.json              block -> global tensor name, global shape, offsets, sizes, dtype
      rng_<rank>.pt                  RandomStates of each rank (restored only into the same layout)

Model blocks are slices of each parameter's full tensor (``layout.py``);
optimizer state (fp32 main weights, Adam moments) is gathered over DP into the
same per-parameter shapes and saved as the same blocks, so a checkpoint loads
into any tp, pp, vp, dp and distributed-optimizer setting: each rank reads the
saved blocks that overlap the blocks it holds. Every read is restricted to
plain data (``safe_load.py``).

This module holds what both sides share; the writer is ``sharded_write.py``, the
reader ``sharded_read.py``.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed.checkpoint as dcp

from megalite.checkpointing.protocol import read_json
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader

OPTIM_KEYS = ("param", "exp_avg", "exp_avg_sq")

__all__ = ["OPTIM_KEYS", "quiet_single_process", "dcp_read", "read_index"]


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """torch.distributed.checkpoint warns when it runs without a process group; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message="Global metadata is not found")
        yield


def dcp_read(state: Dict[str, torch.Tensor], d: str, advice: str) -> None:
    """torch.distributed.checkpoint's load into ``state``; any failure (DCP wraps each rank's in its own
    exception types) becomes one CheckpointError line naming ``d``, then ``advice``."""
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(d))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise CheckpointError(f"reading the tensors of {d} failed ({first[:200]}); the checkpoint is damaged: "
                              f"{advice}") from None


def read_index(d: str) -> Dict[Tuple[str, str], List[dict]]:
    """Every rank's ``index_<rank>.json`` of ``d`` joined: (prefix, tensor name) -> its saved blocks."""
    out: Dict[Tuple[str, str], List[dict]] = {}
    for fn in sorted(os.listdir(d)):
        if fn.startswith("index_") and fn.endswith(".json"):
            for e in read_json(os.path.join(d, fn)):
                out.setdefault((e["prefix"], e["name"]), []).append(e)
    return out
