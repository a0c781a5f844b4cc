"""Simulate a pipeline schedule: prove it deadlock-free, time it, measure it.

The simulator runs the per-rank action lists built by megalite.pipeline's
registry (or any hand-written list of its actions) under
conservative rendezvous semantics, valid for both NCCL and gloo: a rank that
reaches a ``Comm`` blocks until, for every op in it, the peer has posted the
matching op (reached the Comm holding it). Ops are matched per directed
channel (src rank -> dst rank): the k-th send on a channel meets the k-th recv
on it, and both must describe the same message::

    rank 0:          F0.0 [sF0->1] F1.0 [sF1->1 rB0<-1] B0.0 ...
    rank 1: [rF0<-0] F0.0 B0.0 [sB0->0 rF1<-0] F1.0 ...

Channel 0->1 pairs sF0 with rF0 and sF1 with rF1; channel 1->0 pairs sB0 with
rB0. Rank 0's second Comm completes once rank 1 has reached its own second
Comm, which holds both counterparts.

A forward chunk costs f_cost/vp and a backward b_cost/vp, so one micro-batch
through a whole rank costs f_cost + b_cost whatever vp is; Comms cost 0. In a
split-backward (zero-bubble) schedule B costs (b_cost - w_cost)/vp and W
w_cost/vp (default w_cost = b_cost / 2: the weight GEMMs are half the
backward's matmuls). A chunk's activations count as alive from its F to its
W (to its B when the schedule has no W): the inputs the weight GEMMs read are
held until then.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Optional, Sequence

from megalite.pipeline.actions import Action, Comm, Compute, P2POp, format_action
from megalite.pipeline.registry import build_schedule, layout_for
from megalite.pipeline.stage_layout import StageLayout

Pos = tuple[int, int]  # (rank, index into that rank's action list)


class ScheduleError(Exception):
    """An action list that no executor can run correctly."""


class DeadlockError(ScheduleError):
    """Ranks remain but none can make progress."""


@dataclass
class SimResult:
    """Outcome of ``simulate``; times are in cost units.

    ``bubble_fraction[r]`` is (makespan - busy[r]) / busy[r] (Megatron's
    definition); ``peak_in_flight[r]`` is the most micro-batch chunks whose
    forward is done and backward is not, i.e. activations held.
    """

    schedule: str
    pp: int
    vp: int
    m: int
    makespan: float
    busy: list[float]
    bubble_fraction: list[float]
    peak_in_flight: list[int]
    events: list[dict] = field(default_factory=list)

    def to_timeline(self) -> dict:
        """Return the shared TIMELINE JSON dict (``source`` = "simulated")."""
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "vp": self.vp,
            "m": self.m,
            "source": "simulated",
            "events": [dict(e) for e in self.events],
        }


def _check_op(rank: int, pos: int, op: P2POp, layout: StageLayout) -> None:
    """Check one op is well formed and belongs to ``rank``."""
    last = layout.num_stages - 1
    step = 1 if op.kind == "F" else -1
    ok = (
        op.op in ("send", "recv")
        and op.kind in ("F", "B")
        and 0 <= op.src_stage <= last
        and op.dst_stage == op.src_stage + step
        and 0 <= op.dst_stage <= last
    )
    if not ok:
        raise ScheduleError(f"rank {rank} action {pos}: malformed op {op}")
    local, remote = (op.src_stage, op.dst_stage) if op.op == "send" else (op.dst_stage, op.src_stage)
    if layout.rank_of(local) != rank or op.peer != layout.rank_of(remote) or op.peer == rank:
        raise ScheduleError(f"rank {rank} action {pos}: op {op} does not connect rank {rank} to the rank of its stage")


def _fail(rank: int, pos: int, action: Action, problem: str) -> NoReturn:
    """Raise a ScheduleError that says where (formatting is deferred: it is slow)."""
    raise ScheduleError(f"rank {rank} action {pos} {format_action(action)}: {problem}")


def _check_rank(rank: int, actions: list[Action], layout: StageLayout, m: int, kinds: str) -> None:
    """Per-rank dataflow checks: one of each of ``kinds`` per (mb, chunk), inputs received first.

    An input produced on this rank (a V's turn) must have been computed, not received.
    """
    last, vp = layout.num_stages - 1, layout.vp
    received: set[tuple] = set()
    done: set[tuple[str, int, int]] = set()

    def has_input(kind: str, mb: int, s: int, other: int) -> bool:
        if layout.rank_of(other) == rank:
            return (kind, mb, layout.chunk_of(other)) in done
        return (kind, mb, other, s) in received

    for pos, action in enumerate(actions):
        if isinstance(action, Comm):
            for op in action.ops:
                _check_op(rank, pos, op, layout)
                if op.op == "recv":
                    received.add(op.message())
                    continue
                if (op.kind, op.mb, layout.chunk_of(op.src_stage)) not in done:
                    _fail(rank, pos, action, f"sends {op.kind} of mb {op.mb} before computing it")
            continue
        if not (0 <= action.chunk < vp and 0 <= action.mb < m and action.kind in kinds):
            _fail(rank, pos, action, f"compute outside kinds {kinds}, mb < {m}, chunk < {vp}")
        key = (action.kind, action.mb, action.chunk)
        if key in done:
            _fail(rank, pos, action, "runs twice")
        s = layout.stage(rank, action.chunk)
        if action.kind == "F" and s > 0 and not has_input("F", action.mb, s, s - 1):
            _fail(rank, pos, action, "forward before its input was received")
        if action.kind == "B":
            if ("F", action.mb, action.chunk) not in done:
                _fail(rank, pos, action, "backward before its forward")
            if s < last and not has_input("B", action.mb, s, s + 1):
                _fail(rank, pos, action, "backward before its output gradient was received")
        if action.kind == "W" and ("B", action.mb, action.chunk) not in done:
            _fail(rank, pos, action, "weight gradient before its input-gradient backward")
        done.add(key)
    missing = [(k, mb, c) for k in kinds for mb in range(m) for c in range(vp) if (k, mb, c) not in done]
    if missing:
        raise ScheduleError(f"rank {rank}: never runs {', '.join(f'{k}{mb}.{c}' for k, mb, c in missing)}")


def _match_channels(actions: list[list[Action]]) -> tuple[dict[Pos, list[Pos]], dict]:
    """Pair the k-th send with the k-th recv on every directed channel.

    Returns, for every Comm position, the positions of the Comms holding its
    ops' counterparts, and for every (Comm position, op) its counterpart's Comm. Raises ScheduleError on a message mismatch or an
    unmatched op.
    """
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for rank, rank_actions in enumerate(actions):
        for pos, action in enumerate(rank_actions):
            if isinstance(action, Comm):
                for op in action.ops:
                    if op.op == "send":
                        sends[(rank, op.peer)].append(((rank, pos), op))
                    else:
                        recvs[(op.peer, rank)].append(((rank, pos), op))
    needs: dict[Pos, list[Pos]] = defaultdict(list)
    pairs: dict[tuple[Pos, P2POp], Pos] = {}
    for channel in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends[channel], recvs[channel]
        for (s_pos, s_op), (r_pos, r_op) in zip(s_list, r_list):
            if s_op.message() != r_op.message():
                raise ScheduleError(
                    f"mismatch on channel {channel[0]}->{channel[1]}: rank {s_pos[0]} action "
                    f"{s_pos[1]} sends {format_action(Comm((s_op,)))} but rank {r_pos[0]} action "
                    f"{r_pos[1]} receives {format_action(Comm((r_op,)))}"
                )
            needs[s_pos].append(r_pos)
            needs[r_pos].append(s_pos)
            pairs[(s_pos, s_op)], pairs[(r_pos, r_op)] = r_pos, s_pos
        extra = s_list[len(r_list) :] or r_list[len(s_list) :]
        if extra:
            (rank, pos), op = extra[0]
            raise ScheduleError(
                f"rank {rank} action {pos} {format_action(Comm((op,)))}: no matching "
                f"{'recv' if op.op == 'send' else 'send'} on channel {channel[0]}->{channel[1]}"
            )
    return needs, pairs


def _deadlock_message(actions: list[list[Action]], pc: list[int], needs: dict, posted: dict) -> str:
    """Say where every rank is stuck and on whom it waits."""
    parts = []
    for rank, rank_actions in enumerate(actions):
        if pc[rank] >= len(rank_actions):
            parts.append(f"rank {rank} finished")
            continue
        waiting = sorted({p[0] for p in needs[(rank, pc[rank])] if p not in posted})
        parts.append(
            f"rank {rank} at action {pc[rank]} {format_action(rank_actions[pc[rank]])} waits for rank(s) {waiting}"
        )
    return "deadlock: " + "; ".join(parts)


def _infer_m(actions: list[list[Action]]) -> int:
    mbs = [a.mb for rank in actions for a in rank if isinstance(a, Compute)]
    return max(mbs) + 1 if mbs else 0


class _Tally:
    """Per-rank clocks, busy time, activations alive and events, shared by both run modes."""

    def __init__(self, pp: int, cost: Callable[[int, Compute], float], split: bool):
        self.now, self.busy = [0.0] * pp, [0.0] * pp
        self.alive, self.peak = [0] * pp, [0] * pp
        self.events: list[dict] = []
        self.cost, self.split = cost, split

    def compute(self, rank: int, action: Compute) -> None:
        end = self.now[rank] + self.cost(rank, action)
        self.events.append(
            {
                "rank": rank,
                "kind": action.kind,
                "mb": action.mb,
                "chunk": action.chunk,
                "start": self.now[rank],
                "end": end,
            }
        )
        self.busy[rank] += end - self.now[rank]
        self.now[rank] = end
        freed = "W" if self.split else "B"  # the kind after which a chunk's activations are gone
        self.alive[rank] += 1 if action.kind == "F" else -1 if action.kind == freed else 0
        self.peak[rank] = max(self.peak[rank], self.alive[rank])


def _run_rendezvous(actions: list[list[Action]], needs: dict[Pos, list[Pos]], tally: _Tally) -> None:
    """Rendezvous model: a Comm completes when every counterpart op has been posted.

    A worklist holds the ranks that may progress: a rank leaves it when blocked
    at a Comm and is woken when a peer posts a Comm it waits on.
    """
    pp, now = len(actions), tally.now
    pc, posted = [0] * pp, {}
    work = list(range(pp))
    while work:
        rank = work.pop()
        while pc[rank] < len(actions[rank]):
            action, pos = actions[rank][pc[rank]], (rank, pc[rank])
            if isinstance(action, Compute):
                tally.compute(rank, action)
            else:
                if pos not in posted:
                    posted[pos] = now[rank]
                    work.extend({peer for peer, _ in needs[pos]} - set(work))
                if not all(p in posted for p in needs[pos]):
                    break  # a peer posting its counterpart wakes us
                now[rank] = max([now[rank]] + [posted[p] for p in needs[pos]])
            pc[rank] += 1
    if any(pc[r] < len(actions[r]) for r in range(pp)):
        raise DeadlockError(_deadlock_message(actions, pc, needs, posted))


def _run_executor(
    actions: list[list[Action]], needs: dict[Pos, list[Pos]], pairs: dict, tally: _Tally, layout: StageLayout
) -> None:
    """The executor's semantics: a Comm is posted without blocking; a compute waits only for the
    receive it reads (complete once the matching send is posted); sends complete at step end.

    ``pairs`` maps (Comm position, op) to the counterpart op's Comm position.
    """
    pp, now = len(actions), tally.now
    reads = {}  # (rank, message) -> position of the Comm holding the receive
    sends: list[list[tuple[Pos, P2POp]]] = [[] for _ in range(pp)]
    for rank, rank_actions in enumerate(actions):
        for i, a in enumerate(rank_actions):
            for op in a.ops if isinstance(a, Comm) else ():
                if op.op == "recv":
                    reads[(rank, op.message())] = ((rank, i), op)
                else:
                    sends[rank].append(((rank, i), op))
    pc, posted, finished = [0] * pp, {}, [False] * pp
    work = list(range(pp))
    while work:
        rank = work.pop()
        while pc[rank] < len(actions[rank]):
            action, pos = actions[rank][pc[rank]], (rank, pc[rank])
            if isinstance(action, Comm):
                posted[pos] = now[rank]
                work.extend({peer for peer, _ in needs[pos]} - set(work))
            else:
                read = _received_input(rank, action, layout, reads)
                if read is not None:
                    other = pairs[read]
                    if other not in posted:
                        break  # the matching send's poster wakes us
                    now[rank] = max(now[rank], posted[read[0]], posted[other])
                tally.compute(rank, action)
            pc[rank] += 1
        if pc[rank] == len(actions[rank]):
            waits = [pairs[s] for s in sends[rank]]
            finished[rank] = all(p in posted for p in waits)
            if finished[rank]:
                now[rank] = max([now[rank]] + [posted[p] for p in waits])
    if not all(finished):
        stuck = [r for r in range(pp) if not finished[r]]
        where = "; ".join(
            f"rank {r} at action {pc[r]}"
            + (
                f" {format_action(actions[r][pc[r]])}"
                if pc[r] < len(actions[r])
                else " (step end: a send nobody receives)"
            )
            for r in stuck
        )
        raise DeadlockError(f"deadlock (executor semantics): {where}")


def _received_input(rank: int, a: Compute, layout: StageLayout, reads: dict) -> Optional[tuple]:
    """(Comm position, op) of the receive compute ``a`` reads, None when its input is local."""
    s = layout.stage(rank, a.chunk)
    other = s - 1 if a.kind == "F" else s + 1
    if a.kind == "W" or not 0 <= other < layout.num_stages or layout.rank_of(other) == rank:
        return None
    return reads[(rank, (a.kind, a.mb, other, s))]


MODES = ("rendezvous", "executor")


def simulate(
    actions: list[list[Action]],
    pp: int,
    vp: int,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    *,
    schedule: str = "custom",
    forward_only: bool = False,
    stage_costs: Optional[Sequence[tuple]] = None,
    w_cost: Optional[float] = None,
    layout: Optional[StageLayout] = None,
    mode: str = "rendezvous",
) -> SimResult:
    """Check and time a per-rank action list; return bubble, memory and events.

    Raises ScheduleError for a dataflow error or mismatched p2p messages, and
    DeadlockError when ranks remain but none can progress. ``mode``
    "rendezvous" (conservative, any backend): a rank at a Comm resumes at the
    latest of its own time and the times its counterparts were posted.
    "executor": the executor's own semantics (``_run_executor``), which block
    strictly less. ``schedule`` only names the result; ``forward_only`` accepts
    (and requires) a schedule without backwards. ``stage_costs`` gives
    (forward, backward[, weight]) cost per global stage, for unequal stages
    (e.g. the last one also running the output layer and loss); by default
    every chunk costs f_cost/vp and b_cost/vp. With W actions B costs the
    backward minus the weight part (``w_cost``, default half the backward);
    in "executor" mode, with one stage per rank, the first stage's B costs 0
    and its W the whole backward, as the executor runs it.
    ``layout`` places stages on ranks (default: interleaved).
    """
    if len(actions) != pp:
        raise ScheduleError(f"expected action lists for {pp} pipeline ranks, got {len(actions)}")
    if mode not in MODES:
        raise ValueError(f"unknown simulation mode {mode!r}; valid: {', '.join(MODES)}")
    layout = layout or StageLayout(pp, vp)
    m = _infer_m(actions)
    split = any(isinstance(a, Compute) and a.kind == "W" for rank in actions for a in rank)
    for rank, rank_actions in enumerate(actions):
        _check_rank(rank, rank_actions, layout, m, "F" if forward_only else "FBW" if split else "FB")
    needs, pairs = _match_channels(actions)
    if stage_costs is None:
        w = b_cost / 2 if w_cost is None else w_cost
        stage_costs = [(f_cost / vp, b_cost / vp, w / vp)] * (pp * vp)
    if len(stage_costs) != pp * vp:
        raise ScheduleError(f"stage_costs needs {pp * vp} (forward, backward) pairs, got {len(stage_costs)}")

    def cost(rank: int, a: Compute) -> float:
        stage = layout.stage(rank, a.chunk)
        f, b, *rest = stage_costs[stage]
        w = rest[0] if rest else b / 2
        if split and stage == 0 and layout.whole_first_backward and mode == "executor":
            w = b  # the executor runs this first stage's backward whole in its W (nothing waits for B)
        return f if a.kind == "F" else w if a.kind == "W" else b - w if split else b

    tally = _Tally(pp, cost, split)
    if mode == "rendezvous":
        _run_rendezvous(actions, needs, tally)
    else:
        _run_executor(actions, needs, pairs, tally, layout)
    tally.events.sort(key=lambda e: (e["rank"], e["start"]))
    makespan = max(tally.now) if tally.now else 0.0
    bubble = [(makespan - b) / b if b > 0 else 0.0 for b in tally.busy]
    return SimResult(schedule, pp, vp, m, makespan, tally.busy, bubble, tally.peak, tally.events)


def timeline_bubble(timeline: dict) -> list[float]:
    """Per-rank bubble fraction (makespan - busy) / busy of a TIMELINE dict.

    Works for simulated and measured timelines; the makespan runs from the
    earliest start to the latest end over all ranks.
    """
    events = timeline["events"]
    if not events:
        return []
    start = min(e["start"] for e in events)
    makespan = max(e["end"] for e in events) - start
    busy = [0.0] * int(timeline["pp"])
    for e in events:
        busy[e["rank"]] += e["end"] - e["start"]
    return [(makespan - b) / b if b > 0 else 0.0 for b in busy]


def simulate_schedule(
    name: str,
    pp: int,
    vp: int,
    m: int,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    stage_costs: Optional[Sequence[tuple]] = None,
    w_cost: Optional[float] = None,
    mode: str = "rendezvous",
) -> SimResult:
    """Build schedule ``name`` with communication and simulate it."""
    return simulate(
        build_schedule(name, pp, vp, m),
        pp,
        vp,
        f_cost,
        b_cost,
        schedule=name,
        stage_costs=stage_costs,
        w_cost=w_cost,
        layout=layout_for(name, pp, vp),
        mode=mode,
    )
