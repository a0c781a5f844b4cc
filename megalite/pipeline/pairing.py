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

On CUDA the paired forward also runs on a CUDA stream of its own (``PairStreams``), so its kernels
and its all-to-alls (NCCL orders each collective after the issuing thread's current stream) can
run while the backward's do. Autograd runs a backward op on the stream its forward op ran on, so a
backward whose forward was itself paired runs on that side stream: the pair's forward takes the
other of two side streams, never the one its partner's backward runs on. Ordering: the side
stream waits for the main stream before the forward starts (its inputs were made there); after
the join the main stream waits for the side stream; the tensors that cross (the received input,
the output and the payload for the next stage) are recorded on the stream that uses them last, so
the caching allocator does not hand their memory out early.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalite.pipeline.actions import Comm, Compute


class PairStreams:
    """Two side CUDA streams for paired forwards, and which stream each (mb, chunk)'s forward ran on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
        self.forward_on: Dict[Tuple[int, int], int] = {}  # (mb, chunk) -> side stream index; absent: main

    def for_pair(self, f: Compute, b: Compute) -> "torch.cuda.Stream":
        """The side stream for forward ``f``: not the one ``b``'s backward will run on (its forward's)."""
        k = 1 - self.forward_on.pop((b.mb, b.chunk), 1)  # b's forward on side k' -> 1 - k'; on main -> 0
        self.forward_on[(f.mb, f.chunk)] = k
        return self.side[k]


def _record(tensors, stream) -> None:
    """Tell the caching allocator these tensors are also used on ``stream``."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def _streams(ex) -> Optional[PairStreams]:
    """The executor's PairStreams on a CUDA run (made at the first pair), else None."""
    if ex.ps.device.type != "cuda":
        return None
    if ex.pair_streams is None:
        ex.pair_streams = PairStreams(ex.ps.device)
    return ex.pair_streams


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
    streams = _streams(ex)
    side = main = None
    if streams is not None:  # the forward's own stream, after everything its inputs came from
        side, main = streams.for_pair(f, b), torch.cuda.current_stream(streams.device)
        side.wait_stream(main)
        _record([recv_f], side)

    def forward() -> None:
        try:
            with ex.ps.shadow_groups(), _on(side):
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
    if side is not None:  # what the forward made is used on the main stream from here on
        main.wait_stream(side)
        _record([outputs.get((f.mb, f.chunk)), p2p.payloads.get(("F", f.mb, ex._stage(f.chunk) + 1))], main)
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


def _on(stream: Optional["torch.cuda.Stream"]):
    """This thread on ``stream`` (and its device: a new thread starts on device 0); nothing without one."""
    if stream is None:
        return contextlib.nullcontext()
    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.cuda.device(stream.device))
    ctx.enter_context(torch.cuda.stream(stream))
    return ctx
