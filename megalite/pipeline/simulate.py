"""Simulate a pipeline schedule: prove it deadlock-free, time it, measure it.

The simulator runs the per-rank action lists of ``schedules.py`` under
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
through a whole rank costs f_cost + b_cost whatever vp is; Comms cost 0.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Optional, Sequence

from megalite.pipeline.partition import num_stages, rank_of_stage, stage_of
from megalite.pipeline.schedules import Action, Comm, Compute, P2POp, build_schedule, format_action

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


def _check_op(rank: int, pos: int, op: P2POp, pp: int, vp: int) -> None:
    """Check one op is well formed and belongs to ``rank``."""
    last = num_stages(pp, vp) - 1
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
    if rank_of_stage(pp, local) != rank or op.peer != rank_of_stage(pp, remote) or op.peer == rank:
        raise ScheduleError(f"rank {rank} action {pos}: op {op} does not connect rank {rank} "
                            f"to the rank of its stage")


def _fail(rank: int, pos: int, action: Action, problem: str) -> NoReturn:
    """Raise a ScheduleError that says where (formatting is deferred: it is slow)."""
    raise ScheduleError(f"rank {rank} action {pos} {format_action(action)}: {problem}")


def _check_rank(rank: int, actions: list[Action], pp: int, vp: int, m: int, kinds: str) -> None:
    """Per-rank dataflow checks: one of each of ``kinds`` per (mb, chunk), inputs received first."""
    last = num_stages(pp, vp) - 1
    received: set[tuple] = set()
    done: set[tuple[str, int, int]] = set()
    for pos, action in enumerate(actions):
        if isinstance(action, Comm):
            for op in action.ops:
                _check_op(rank, pos, op, pp, vp)
                if op.op == "recv":
                    received.add(op.message())
                    continue
                chunk = op.src_stage // pp
                if (op.kind, op.mb, chunk) not in done:
                    _fail(rank, pos, action, f"sends {op.kind} of mb {op.mb} before computing it")
            continue
        if not (0 <= action.chunk < vp and 0 <= action.mb < m and action.kind in kinds):
            _fail(rank, pos, action, f"compute outside kinds {kinds}, mb < {m}, chunk < {vp}")
        key = (action.kind, action.mb, action.chunk)
        if key in done:
            _fail(rank, pos, action, "runs twice")
        s = stage_of(pp, vp, rank, action.chunk)
        if action.kind == "F" and s > 0 and ("F", action.mb, s - 1, s) not in received:
            _fail(rank, pos, action, "forward before its input was received")
        if action.kind == "B":
            if ("F", action.mb, action.chunk) not in done:
                _fail(rank, pos, action, "backward before its forward")
            if s < last and ("B", action.mb, s + 1, s) not in received:
                _fail(rank, pos, action, "backward before its output gradient was received")
        done.add(key)
    missing = [(k, mb, c) for k in kinds for mb in range(m) for c in range(vp) if (k, mb, c) not in done]
    if missing:
        raise ScheduleError(f"rank {rank}: never runs {', '.join(f'{k}{mb}.{c}' for k, mb, c in missing)}")


def _match_channels(actions: list[list[Action]]) -> dict[Pos, list[Pos]]:
    """Pair the k-th send with the k-th recv on every directed channel.

    Returns, for every Comm position, the positions of the Comms holding its
    ops' counterparts. Raises ScheduleError on a message mismatch or an
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
        extra = s_list[len(r_list):] or r_list[len(s_list):]
        if extra:
            (rank, pos), op = extra[0]
            raise ScheduleError(
                f"rank {rank} action {pos} {format_action(Comm((op,)))}: no matching "
                f"{'recv' if op.op == 'send' else 'send'} on channel {channel[0]}->{channel[1]}"
            )
    return needs


def _deadlock_message(actions: list[list[Action]], pc: list[int], needs: dict, posted: dict) -> str:
    """Say where every rank is stuck and on whom it waits."""
    parts = []
    for rank, rank_actions in enumerate(actions):
        if pc[rank] >= len(rank_actions):
            parts.append(f"rank {rank} finished")
            continue
        waiting = sorted({p[0] for p in needs[(rank, pc[rank])] if p not in posted})
        parts.append(
            f"rank {rank} at action {pc[rank]} {format_action(rank_actions[pc[rank]])} "
            f"waits for rank(s) {waiting}"
        )
    return "deadlock: " + "; ".join(parts)


def _infer_m(actions: list[list[Action]]) -> int:
    mbs = [a.mb for rank in actions for a in rank if isinstance(a, Compute)]
    return max(mbs) + 1 if mbs else 0


def _run(
    actions: list[list[Action]], needs: dict[Pos, list[Pos]], cost: Callable[[int, Compute], float]
) -> tuple[list[float], list[float], list[int], list[dict]]:
    """Event-driven run; returns per-rank end time, busy time, peak in flight, and events.

    A worklist holds the ranks that may progress: a rank leaves it when blocked
    at a Comm and is woken when a peer posts a Comm it waits on.
    """
    pp = len(actions)
    pc, now = [0] * pp, [0.0] * pp
    busy, in_flight, peak = [0.0] * pp, [0] * pp, [0] * pp
    posted: dict[Pos, float] = {}
    events: list[dict] = []
    work = list(range(pp))
    while work:
        rank = work.pop()
        while pc[rank] < len(actions[rank]):
            action, pos = actions[rank][pc[rank]], (rank, pc[rank])
            if isinstance(action, Compute):
                end = now[rank] + cost(rank, action)
                events.append({"rank": rank, "kind": action.kind, "mb": action.mb,
                               "chunk": action.chunk, "start": now[rank], "end": end})
                busy[rank] += end - now[rank]
                now[rank] = end
                in_flight[rank] += 1 if action.kind == "F" else -1
                peak[rank] = max(peak[rank], in_flight[rank])
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
    events.sort(key=lambda e: (e["rank"], e["start"]))
    return now, busy, peak, events


def simulate(
    actions: list[list[Action]],
    pp: int,
    vp: int,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    *,
    schedule: str = "custom",
    forward_only: bool = False,
    stage_costs: Optional[Sequence[tuple[float, float]]] = None,
) -> SimResult:
    """Check and time a per-rank action list; return bubble, memory and events.

    Raises ScheduleError for a dataflow error or mismatched p2p messages, and
    DeadlockError when ranks remain but none can progress. A rank at a Comm
    resumes at the latest of its own time and the times its counterparts were
    posted. ``schedule`` only names the result; ``forward_only`` accepts
    (and requires) a schedule without backwards. ``stage_costs`` gives
    (forward, backward) cost per global virtual stage, for unequal stages
    (e.g. the last one also running the output layer and loss); by default
    every chunk costs f_cost/vp and b_cost/vp.
    """
    if len(actions) != pp:
        raise ScheduleError(f"expected action lists for {pp} pipeline ranks, got {len(actions)}")
    m = _infer_m(actions)
    for rank, rank_actions in enumerate(actions):
        _check_rank(rank, rank_actions, pp, vp, m, "F" if forward_only else "FB")
    needs = _match_channels(actions)
    if stage_costs is None:
        stage_costs = [(f_cost / vp, b_cost / vp)] * (pp * vp)
    if len(stage_costs) != pp * vp:
        raise ScheduleError(f"stage_costs needs {pp * vp} (forward, backward) pairs, got {len(stage_costs)}")

    def cost(rank: int, a: Compute) -> float:
        f, b = stage_costs[a.chunk * pp + rank]
        return f if a.kind == "F" else b

    now, busy, peak, events = _run(actions, needs, cost)
    makespan = max(now) if now else 0.0
    bubble = [(makespan - b) / b if b > 0 else 0.0 for b in busy]
    return SimResult(schedule, pp, vp, m, makespan, busy, bubble, peak, events)


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


def simulate_schedule(name: str, pp: int, vp: int, m: int, f_cost: float = 1.0,
                      b_cost: float = 2.0,
                      stage_costs: Optional[Sequence[tuple[float, float]]] = None) -> SimResult:
    """Build schedule ``name`` with communication and simulate it."""
    return simulate(build_schedule(name, pp, vp, m), pp, vp, f_cost, b_cost, schedule=name,
                    stage_costs=stage_costs)

