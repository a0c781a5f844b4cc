"""Runs one rank's action list (any schedule) for one global batch.

The executor is the only place that knows how an action becomes work::

    F(mb, c): input = tokens (first stage) or the received activation
              output = chunk c(input); on the last stage: loss = lm_loss / m x loss scale
              (packed documents: every stage also gets the micro-batch's position and
              segment ids; under CP lm_loss is the local sum / the whole sequence's count x cp)
    B(mb, c): backward from the loss (last stage) or from the received gradient
              of the output; the input's gradient becomes the next send. In a
              schedule with W actions only the input gradient: the linear
              layers' weight GEMMs wait in a WeightGradStore for W(mb, c).
              The first stage has no input gradient to send, so with one
              stage per rank (ZB-H1) its B does nothing and W runs its whole
              backward unsplit (as torch's pipelining does): splitting it would
              only cost time. In a V the split stays: rank 0 also runs the last
              stage, and B then W of the first stage leaves it fewer idle gaps
              (ZB-V's greedy order at pp 4, m 4: simulated bubble 12.5% split,
              25.0% unsplit; its phase order does equally well either way)
    W(mb, c): run the weight GEMMs B(mb, c) left (zero-bubble schedules); expert
              linears (megalite.moe) are built on the same split, so theirs wait too
    Comm:     post one batch of sends/receives (p2p.P2PState); a compute waits
              only for the receive it reads, sends are waited at the end

Stages are placed by a StageLayout (interleaved or V); when two consecutive
stages sit on this rank (a V's turn) the tensor is handed over in memory.

Inputs and outputs of micro-batches in flight are held in dicts keyed by
(mb, chunk) and dropped as soon as their backward is done. Times of every
action are recorded so the caller can report forward / backward / p2p time,
the measured bubble, and write a timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megalite.context_parallel.sequence import sequence_kwargs
from megalite.moe import routers_of, set_aux_loss_scale
from megalite.parallel.state import ParallelState
from megalite.pipeline.actions import Comm, Compute
from megalite.pipeline.p2p import P2PState
from megalite.pipeline.pairing import paired_backward, run_pair
from megalite.pipeline.stage_layout import StageLayout
from megalite.tensor_parallel.layers import WeightGradSplit, WeightGradStore, enable_weight_grad_split

Batch = Dict[str, torch.Tensor]


@dataclass
class StepStats:
    """What one executor run measured (seconds) and the last stage's micro-batch losses."""

    losses: List[torch.Tensor] = field(default_factory=list)
    forward: float = 0.0
    backward: float = 0.0
    p2p: float = 0.0
    events: List[dict] = field(default_factory=list)

    @property
    def compute(self) -> float:
        return self.forward + self.backward

    @property
    def bubble(self) -> float:
        """Measured idle fraction: (schedule time - compute) / compute, Megatron's bubble definition."""
        wall = self.events[-1]["end"] if self.events else 0.0
        return max(0.0, wall - self.compute) / self.compute if self.compute > 0 else 0.0


class PipelineExecutor:
    """Executes schedules for this rank's model chunks (one per virtual stage)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        ps: ParallelState,
        activation_shape: Tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        sync_timing: bool = False,
        layout: Optional[StageLayout] = None,
    ):
        self.chunks, self.ps = list(chunks), ps
        self.layout = layout or StageLayout(ps.pp_size, len(self.chunks))
        self.pp, self.num_stages = ps.pp_size, self.layout.num_stages
        self.shape, self.dtype = activation_shape, dtype
        self.sync = sync_timing and ps.device.type == "cuda"
        self.fault = None  # faults.ScheduleFault for the next run (--inject-fault-kind hang / skip-send)
        self.pair_forward_backward = False  # DualPipeV pairs side by side (--overlap-moe-expert-parallel-comm)
        self.pair_streams = None  # pairing.PairStreams: the paired forwards' CUDA streams (made at the first pair)
        self._plans: Dict[int, tuple] = {}  # id(action list) -> (the list, its transfers): the flight recorder's
        self.wgrad_split = WeightGradSplit()  # where B leaves the weight GEMMs for W (zero-bubble schedules)
        self._routers = routers_of(self.chunks)  # MoE: their aux losses get the step's loss scale

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def run(
        self,
        actions: Sequence[object],
        get_batch: Callable[[int], Batch],
        num_microbatches: int,
        forward_only: bool = False,
        loss_scale: float = 1.0,
    ) -> StepStats:
        """Run ``actions``; ``get_batch(mb)`` gives tokens/labels/loss_mask of micro-batch ``mb``.

        Backward starts from ``loss / num_microbatches * loss_scale`` (fp16 loss scaling). MoE
        auxiliary losses (load balancing, z-loss) get the same factor, times cp: the LM loss of a CP
        rank is its local sum over the whole sequence's count x cp, so both sides of the dp_cp
        gradient average carry the same weight.
        """
        st = StepStats()
        actions, fault = self._begin_run(actions, num_microbatches, forward_only, loss_scale)
        if self.pair_streams is not None:  # a new step: no forward has run on a side stream yet
            self.pair_streams.forward_on.clear()
        recorder = self.ps.recorder
        inputs: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}
        outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        p2p = P2PState(self.ps.timeout if self.ps.backend == "gloo" else None, recorder)
        t0 = self._now()
        i = -1
        while i + 1 < len(actions):
            i += 1
            action = actions[i]
            start = self._now()
            if isinstance(action, Comm):
                p2p.post(action, self.ps, self.shape, self.dtype)
                st.p2p += self._now() - start
                continue
            assert isinstance(action, Compute)
            j = paired_backward(self, actions, i, p2p) if self.pair_forward_backward and not forward_only else None
            if j is not None:  # --overlap-moe-expert-parallel-comm: F and the next B side by side (pairing.py)
                run_pair(self, action, actions[j], get_batch, num_microbatches, inputs, outputs, p2p, st, t0)
                for comm in actions[i + 1 : j]:  # the transfers placed between them: after both
                    p2p.post(comm, self.ps, self.shape, self.dtype)
                i = j
                continue
            received = self._wait_input(action, p2p)
            now = self._now()
            st.p2p, start = st.p2p + (now - start), now
            event = recorder.record(action.kind, mb=action.mb, chunk=action.chunk, run=recorder.run)
            if fault is not None:
                fault.during(action, self.chunks[action.chunk])
            if action.kind == "F":
                self._forward(
                    action, get_batch, num_microbatches, forward_only, inputs, outputs, p2p.payloads, received, st
                )
            elif action.kind == "B":
                self._backward(action, inputs, outputs, p2p.payloads, received)
            else:
                self._wgrads.pop((action.mb, action.chunk)).run()
            end = self._now()
            recorder.done(event)
            self._account(st, action, start - t0, end - t0)
        if self._wgrads:
            raise RuntimeError(f"schedule left weight gradients unrun: {sorted(self._wgrads)}")
        start = self._now()
        p2p.finish()
        st.p2p += self._now() - start
        return st

    def _begin_run(
        self, actions: Sequence[object], num_microbatches: int, forward_only: bool, loss_scale: float
    ) -> Tuple[Sequence[object], object]:
        """Set the step's loss scales, take this run's injected fault (it may rewrite the list), tell the
        flight recorder the run's transfers and, when the list has W actions, split the weight GEMMs."""
        self.loss_scale = loss_scale
        if not forward_only:
            set_aux_loss_scale(self._routers, loss_scale / num_microbatches * self.ps.cp_size)
        fault, self.fault = self.fault, None  # --inject-fault-kind hang / skip-send: this run only
        if fault is not None:
            actions = fault.actions(actions)
        self.ps.recorder.begin_run(self._plan(actions))
        self._wgrads: Optional[Dict[Tuple[int, int], "WeightGradStore | _WholeBackward"]] = None
        if not forward_only and any(isinstance(a, Compute) and a.kind == "W" for a in actions):
            self._wgrads = {}
            for c, chunk in enumerate(self.chunks):  # idempotent; results are the same with or without it
                if self._stage(c) > 0 or not self.layout.whole_first_backward:
                    enable_weight_grad_split(chunk, self.wgrad_split)
        return actions, fault

    def _account(self, st: StepStats, action: Compute, start: float, end: float) -> None:
        """One compute action's time (seconds since the run began) into the step's totals and timeline."""
        if action.kind == "F":
            st.forward += end - start
        else:
            st.backward += end - start
        st.events.append(
            {
                "rank": self.ps.pp_rank,
                "kind": action.kind,
                "mb": action.mb,
                "chunk": action.chunk,
                "start": start,
                "end": end,
            }
        )

    def _plan(self, actions: Sequence[object]) -> Dict[str, Dict[int, list]]:
        """The run's transfers per direction and peer (global rank), in order: what the hang diagnosis
        compares between neighbours. Cached per action list (the Trainer reuses its lists)."""
        cache = self._plans
        if id(actions) not in cache:
            plan: Dict[str, Dict[int, list]] = {"send": {}, "recv": {}}
            for a in actions:
                for op in a.ops if isinstance(a, Comm) else ():
                    plan[op.op].setdefault(self.ps.pp.ranks[op.peer], []).append((op.kind, op.mb, op.dst_stage))
            cache[id(actions)] = (actions, plan)  # the list is kept alive, so its id stays its own
        return cache[id(actions)][1]

    def _stage(self, chunk: int) -> int:
        return self.layout.stage(self.ps.pp_rank, chunk)

    def _wait_input(self, a: Compute, p2p: P2PState) -> Optional[torch.Tensor]:
        """The tensor this compute reads (activation or gradient), once it has arrived.

        From a neighbour stage on this rank (a V's turn) it is the payload that stage left.
        """
        stage = self._stage(a.chunk)
        other = stage - 1 if a.kind == "F" else stage + 1
        if a.kind == "W" or not 0 <= other < self.num_stages:
            return None
        key = (a.kind, a.mb, stage)
        if self.layout.rank_of(other) == self.ps.pp_rank:
            return p2p.payloads.pop(key)
        return p2p.take(key)

    def _forward(
        self, a: Compute, get_batch, m: int, forward_only: bool, inputs, outputs, payloads, received, st: StepStats
    ) -> None:
        stage = self._stage(a.chunk)
        model = self.chunks[a.chunk]
        batch = get_batch(a.mb)  # None on a rank that reads no data
        if stage == 0:
            x = batch["tokens"]
            inputs[(a.mb, a.chunk)] = None
        else:
            x = received
            if not forward_only:
                x.requires_grad_()
            inputs[(a.mb, a.chunk)] = x
        out = model(x, **sequence_kwargs(batch))  # packed documents: positions and segments, every stage
        if stage == self.num_stages - 1:
            loss = model.loss(out, batch["labels"], batch["loss_mask"], batch.get("num_tokens"))
            st.losses.append(loss.detach())
            out = loss * (self.loss_scale / m)
        else:
            payloads[("F", a.mb, stage + 1)] = out.detach()
        if forward_only:
            inputs.pop((a.mb, a.chunk))
        else:
            outputs[(a.mb, a.chunk)] = out

    def _backward(self, a: Compute, inputs, outputs, payloads, received) -> None:
        stage = self._stage(a.chunk)
        out = outputs.pop((a.mb, a.chunk))
        x = inputs.pop((a.mb, a.chunk))
        grad = None if stage == self.num_stages - 1 else received
        if self._wgrads is None:
            torch.autograd.backward(out, grad_tensors=grad)
        elif (
            stage == 0 and self.layout.whole_first_backward
        ):  # nobody waits for its input gradient: all of it waits for W
            self._wgrads[(a.mb, a.chunk)] = _WholeBackward(out, grad)
        else:  # input gradients now; the weight GEMMs wait for this (mb, chunk)'s W
            store = WeightGradStore()
            with self.wgrad_split.collecting(store):
                torch.autograd.backward(out, grad_tensors=grad)
            self._wgrads[(a.mb, a.chunk)] = store
        if stage > 0:
            payloads[("B", a.mb, stage - 1)] = x.grad


@dataclass
class _WholeBackward:
    """The first stage's whole backward, held from its B for its W (a split there buys nothing).

    Its chunk's layers are not in split mode, so this is the plain fused backward (on one CPU
    thread, embedding + 2 layers at hidden 256, seq 128: 25.8 ms against 27.0 for B + W).
    """

    out: torch.Tensor
    grad: Optional[torch.Tensor]

    def run(self) -> None:
        torch.autograd.backward(self.out, grad_tensors=self.grad)
