"""DualPipeV's paired forward and backward, run side by side (--overlap-moe-expert-parallel-comm).

DualPipeV pairs the forward of one micro-batch with the backward of another (its phase 4: "F(a)
Bw(b)"); DeepSeek-V3 runs each pair at once so that one's expert all-to-alls hide behind the
other's compute. The executor does the same when a forward is followed, with only transfers in
between, by a backward of another chunk whose input is already here or posted (the schedules'
receives are placed one compute ahead for this):

    wait for both inputs -> forward on a second thread (inside ParallelState.shadow_groups: its
    collectives go to communicators of their own, in the same order on every rank) || backward
    on this thread -> join -> post the transfers that sat between them

The results equal the sequential run's (each micro-batch's arithmetic is unchanged; only the
wall clock overlaps). Dropout must be 0: the random state is shared by the two threads.
"""

from __future__ import annotations

import threading
from typing import List, Optional, Sequence

from megalite.pipeline.actions import Comm, Compute


def paired_backward(ex, actions: Sequence[object], i: int, p2p) -> Optional[int]:
    """Index of the backward to run beside forward ``actions[i]``, or None (run it alone)."""
    f = actions[i]
    if f.kind != "F":
        return None
    j = i + 1
    while j < len(actions) and isinstance(actions[j], Comm):
        j += 1
    if j == len(actions) or actions[j].kind != "B" or actions[j].chunk == f.chunk:
        return None
    b = actions[j]
    stage = ex._stage(b.chunk)
    if stage + 1 < ex.num_stages:  # its gradient arrives from the next stage: here, or posted already
        key = ("B", b.mb, stage)
        local = ex.layout.rank_of(stage + 1) == ex.ps.pp_rank
        if key not in (p2p.payloads if local else p2p._recvs):
            return None
    return j


def run_pair(ex, f: Compute, b: Compute, get_batch, m: int, inputs, outputs, p2p, st, t0: float) -> None:
    """Forward ``f`` on a second thread beside backward ``b`` on this one (both inputs waited for first)."""
    recv_f, recv_b = ex._wait_input(f, p2p), ex._wait_input(b, p2p)
    start = ex._now()
    recorder = ex.ps.recorder
    events = [recorder.record(a.kind, mb=a.mb, chunk=a.chunk, run=recorder.run) for a in (f, b)]
    errors: List[BaseException] = []

    def forward() -> None:
        try:
            with ex.ps.shadow_groups():
                ex._forward(f, get_batch, m, False, inputs, outputs, p2p.payloads, recv_f, st)
        except BaseException as e:  # noqa: BLE001 - re-raised on the executor's thread
            errors.append(e)

    thread = threading.Thread(target=forward, name=f"F{f.mb}.{f.chunk}", daemon=True)
    thread.start()
    try:
        ex._backward(b, inputs, outputs, p2p.payloads, recv_b)
    finally:
        thread.join()
    if errors:
        raise errors[0]
    end = ex._now()
    for event in events:
        recorder.done(event)
    st.forward += end - start  # both ran over the whole span
    st.backward += end - start
    for a in (f, b):
        st.events.append(
            {
                "rank": ex.ps.pp_rank,
                "kind": a.kind,
                "mb": a.mb,
                "chunk": a.chunk,
                "start": start - t0,
                "end": end - t0,
                "paired": True,
            }
        )
