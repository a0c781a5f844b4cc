"""Point-to-point transfers between pipeline stages.

A schedule's ``Comm`` action lists sends and receives that are posted together
(one ``batch_isend_irecv``), so two neighbours that each send and receive
never wait on each other in the wrong order (on NCCL, an unbatched send then
recv on both sides deadlocks). Posting does not block: a receive is waited for
only by the compute action that reads it, and sends only at the end of the
step. That blocks strictly later than the simulator's rendezvous model
(everything in a Comm completes before the rank moves on), so every schedule
the simulator proves deadlock-free stays deadlock-free, while a rank can run
the forward whose input already arrived before the gradient it will need next.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.observability.flight_recorder import FlightRecorder
from megalite.parallel.state import ParallelState
from megalite.pipeline.actions import Comm

Key = Tuple[str, int, int]  # (kind, mb, dst_stage): how both sides name a transfer


class P2PState:
    """Transfers of one step in flight: receive buffers with their handles, send handles."""

    def __init__(self, timeout: Optional[timedelta] = None, recorder: Optional[FlightRecorder] = None) -> None:
        # gloo receives ignore the process group's timeout unless given one: without it a hung
        # neighbour would hold this rank forever. (NCCL waits are stream syncs: left as they are.)
        self.timeout = timeout
        self.recorder = recorder if recorder is not None else FlightRecorder(0)  # the rank's (ps.recorder)
        self.payloads: Dict[Key, torch.Tensor] = {}  # produced, to be sent by a later Comm
        self._recvs: Dict[Key, Tuple[torch.Tensor, List, int]] = {}  # + the flight recorder's event id
        self._sends: List[Tuple[torch.Tensor, List, int]] = []

    def post(self, comm: Comm, ps: ParallelState, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
        """Post every op of ``comm`` as one batch without waiting."""
        ops: List[dist.P2POp] = []
        tensors: List[Tuple[str, Key, torch.Tensor, int]] = []
        for op in comm.ops:
            key = (op.kind, op.mb, op.dst_stage)
            peer = ps.pp.ranks[op.peer]
            if op.op == "send":
                t = self.payloads.pop(key).contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, ps.pp_group))
            else:
                t = torch.empty(shape, dtype=dtype, device=ps.device)
                ops.append(dist.P2POp(dist.irecv, t, peer, ps.pp_group))
            tensors.append((op.op, key, t, self.recorder.transfer(op.op, peer, op.kind, op.mb, op.dst_stage)))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        # gloo returns one handle per op; NCCL may return one for the whole batch.
        per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
        for (kind, key, t, event), w in zip(tensors, per_op):
            if kind == "send":
                self._sends.append((t, w, event))  # keep the tensor alive until the send completes
            else:
                self._recvs[key] = (t, w, event)

    def take(self, key: Key) -> torch.Tensor:
        """Wait for the receive named ``key`` and hand over its buffer."""
        t, works, event = self._recvs.pop(key)
        self._wait_all(works, event)
        return t

    def _wait_all(self, works: List, event: int) -> None:
        waiting = self.recorder.wait_on(event)  # left open when the wait fails: what the hang diagnosis reads
        for w in works:
            self._wait(w)
        self.recorder.done(waiting)
        self.recorder.done(event)

    def _wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        elif not work.wait(self.timeout):
            raise dist.DistBackendError(f"a pipeline transfer did not complete within {self.timeout}")

    def finish(self) -> None:
        """Wait for every send; fail loudly if the schedule left anything unmatched."""
        for _, works, event in self._sends:
            self._wait_all(works, event)
        self._sends.clear()
        if self.payloads or self._recvs:
            raise RuntimeError(
                f"schedule left transfers unmatched: unsent {sorted(self.payloads)}, unread {sorted(self._recvs)}"
            )
