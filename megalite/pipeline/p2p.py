"""Point-to-point transfers between pipeline stages, one batch at a time.

A schedule's ``Comm`` action lists sends and receives that are issued together
(``batch_isend_irecv``) and waited for together, so two neighbours that each
send and receive never wait on each other in the wrong order (on NCCL, an
unbatched send then recv on both sides deadlocks). The schedule simulator
proves each schedule's batches match up before anything runs.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megalite.parallel_state import ParallelState
from megalite.pipeline.schedules import Comm

Key = Tuple[str, int, int]  # (kind, mb, dst_stage)


def run_comm(comm: Comm, ps: ParallelState, payloads: Dict[Key, torch.Tensor],
             received: Dict[Key, torch.Tensor], shape: Tuple[int, ...], dtype: torch.dtype) -> None:
    """Issue every op of ``comm`` at once and wait for all of them.

    Sends take their tensor from ``payloads`` (keyed by what the receiver will
    call it); receives allocate a ``shape`` buffer and store it in ``received``.
    """
    ops: List[dist.P2POp] = []
    for op in comm.ops:
        key = (op.kind, op.mb, op.dst_stage)
        peer = ps.pp.ranks[op.peer]
        if op.op == "send":
            ops.append(dist.P2POp(dist.isend, payloads.pop(key).contiguous(), peer, ps.pp_group))
        else:
            buf = torch.empty(shape, dtype=dtype, device=ps.device)
            received[key] = buf
            ops.append(dist.P2POp(dist.irecv, buf, peer, ps.pp_group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
