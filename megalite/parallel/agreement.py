"""Cross-rank agreement: every rank learns whether any rank found a problem, and which one reports it.

Stops (a non-finite loss, a signal, a bad sample, a failed dataset or checkpoint read) must
end every rank at once and be said once; these one-collective helpers are how the ranks agree.
Each is a single all-reduce over the whole world (a no-op in one process).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.parallel.state import ParallelState


def flag_on_any_rank(flag: bool, ps: ParallelState) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    return flags_on_any_rank([flag], ps)[0]


def flags_on_any_rank(flags: Sequence[bool], ps: ParallelState) -> List[bool]:
    """Element-wise OR of ``flags`` over every rank, in one all-reduce."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=ps.device)
    if ps.world_size > 1 and dist.is_initialized():
        ps.recorder.call("world", dist.all_reduce, t, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in t.tolist()]


def lowest_rank_with(flag: bool, ps: ParallelState) -> Optional[int]:
    """The lowest global rank where ``flag`` is true, known on every rank (None: on none).

    Lets exactly one of the ranks that found the same problem report it.
    """
    t = torch.tensor([ps.rank if flag else ps.world_size], device=ps.device, dtype=torch.float64)
    if ps.world_size > 1 and dist.is_initialized():
        ps.recorder.call("world", dist.all_reduce, t, op=dist.ReduceOp.MIN)
    lowest = int(t.item())
    return None if lowest >= ps.world_size else lowest
