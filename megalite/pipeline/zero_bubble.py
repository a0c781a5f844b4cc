"""Zero-bubble schedules (Qi et al. 2023): the backward split into B (input grads) and W (weights).

The previous stage waits only for B, so B runs as early as 1F1B would run the
whole backward and W, which nobody waits for, fills the time a rank would
otherwise sit idle. With unit costs F = B = W::

    1F1B   rank 0: F0 F1 F2 F3 .. .. .. BW0 .. BW1 ..   (BW: both halves at once)
    ZB-H1  rank 3:             F0 B0 F1 B1 .. W0 W1 W2   (rank r holds back r W's)

ZB-H1 keeps 1F1B's order of F and B, and rank r holds back its first r W's
until the end, where 1F1B would leave rank r idle for r backward steps: the
bubble shrinks from (pp-1)(F+B+W) to (pp-1)(F+B-W), a third of 1F1B's with
equal costs, while at most pp micro-batches have activations alive (forward
done, W not yet), exactly 1F1B's peak on rank 0.

ZB-V runs two chunks per rank in a V (stage_layout.py). Because the V puts
the first and last stage on rank 0, a micro-batch comes back to the rank it
started on and the warmup bubble of one arm is filled with the other arm's
work. Two orders are built and the one with the shorter step (ties: the
first) is used, timed by ``step_time`` with the given F/B/W costs under the
executor's semantics (the same makespan megalite.analysis.simulate gives in
its executor mode; tests/unit/test_schedules.py checks both agree):

* the zero-bubble paper's phase order (the one torch.distributed.pipelining's
  ScheduleZBVZeroBubble runs). Rank r of pp, a = its first-arm chunk, b = its
  second-arm chunk, n = max(m, 2pp-1) micro-batches (those >= m dropped), W
  always the oldest held-back one of its chunk::

    1. 2(pp-r)-1 x  F(a)
    2. r         x  F(b) F(a)
    3. pp-r      x  F(b) B(b) W(b)
    4. until both arms have run n forwards:  [F(a)] B(a) W(a) F(b) B(b) W(b)
    5. r         x  B(a) B(b)
    6. pp-r      x  B(a) W(a)
    7. the held-back W(b)'s, then the W(a)'s

* a greedy list schedule: every rank, as soon as it is free, runs the first
  ready action by priority B > F > W, with F only while fewer than 2pp chunk
  activations are alive, and W as filler.

Both keep 1F1B's activation memory (2pp chunk activations: pp micro-batches
of a whole rank). With unit costs the phase order is faster than or equal to
the greedy one for every m > pp on pp 2..7 (pp 6, m 12: bubble 6.9% vs 11.1%);
the greedy one wins for m <= pp (the phases assume 2pp-1 micro-batches) and
at pp 8, m 11. Both are deterministic, so every rank builds the same lists.

DualPipeV (DeepSeek-V3's DualPipe folded into the same V) runs the same
actions in a fixed phase order instead of a greedy one. Rank r of pp, with a =
its first-arm chunk (stage r) and b = its second-arm chunk (stage 2pp-1-r);
"Bw" is a whole backward (B then W at once), "B" a split one whose W joins a
FIFO that "W" drains::

    1. 2(pp-r-1) x  F(a)
    2. r+1       x  F(a) F(b)
    3. pp-r-1    x  B(b) W F(b)
    4. m-2pp+r+1 x  F(a) Bw(b) F(b) Bw(a)     (the paired F and Bw are what DualPipe
                                              overlaps to hide expert all-to-alls)
    5. pp-r-1    x  Bw(b) F(b) Bw(a)
    6. r+1       x  B?(b) B?(a)               (split from the middle pair on: at the
                                              pair's b for odd r, its a for even r)
    7. pp-r-1    x  W B(a)
    8. r+1       x  W
On one device the paired F and backward run one after the other, so the
schedule is another zero-bubble V: with unit costs its simulated bubble equals
ZB-V's (phase order) for m in {2pp, 3pp, 4pp}, pp 2..8, for one more chunk
activation per rank (peak 2pp + 1); it needs m >= 2pp. Its gain is the F/B
pairing, which overlaps expert-parallel all-to-alls on GPUs.
tests/unit/test_schedules.py checks the per-rank order equals
torch.distributed.pipelining's ScheduleDualPipeV.

Both V schedules need pp >= 2 and vp == 2 (``check_zbv``, ``check_dualpipev``);
registry.py names the three builders with their layout and constraints.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

from megalite.pipeline.actions import Compute
from megalite.pipeline.schedules import check_one_chunk, check_sizes
from megalite.pipeline.stage_layout import StageLayout


def check_zb_h1(pp: int, vp: int, m: int) -> None:
    """zb_h1 runs 1F1B's layout: one chunk per rank, any m >= 1."""
    check_one_chunk("zb_h1", pp, vp, m)


def _check_v(name: str, pp: int, vp: int, m: int) -> None:
    """A V needs two ranks or more and exactly its two arms per rank."""
    check_sizes(pp, vp, m)
    if pp < 2:
        raise ValueError(
            f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2 (on one rank use no_pipelining)"
        )
    if vp != 2:
        raise ValueError(
            f"--pipeline-schedule {name} runs two chunks per rank in a V: it needs "
            f"--virtual-pipeline-model-parallel-size 2 (got vp={vp})"
        )


def check_zbv(pp: int, vp: int, m: int) -> None:
    """zbv: pp >= 2, vp == 2 (the two arms of the V), any m >= 1."""
    _check_v("zbv", pp, vp, m)


def check_dualpipev(pp: int, vp: int, m: int) -> None:
    """dualpipev: as zbv, and m >= 2pp (its phases pair forwards with backwards from the start)."""
    _check_v("dualpipev", pp, vp, m)
    if m < 2 * pp:
        raise ValueError(
            f"--pipeline-schedule dualpipev needs at least 2 x pp = {2 * pp} micro-batches per "
            f"step (got {m}); raise --global-batch-size or use zbv"
        )


def build_zb_h1(pp: int, m: int) -> list[list[Compute]]:
    """ZB-H1: 1F1B's F/B order; rank r runs W after each B except its first r, which go last."""
    check_sizes(pp, 1, m)
    schedule = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        held = min(rank, m)
        order = [Compute("F", mb, 0) for mb in range(warmup)]
        next_f, next_w = warmup, 0
        for b in range(m):
            if next_f < m:
                order.append(Compute("F", next_f, 0))
                next_f += 1
            order.append(Compute("B", b, 0))
            if b >= held:  # past the held-back ones: W right behind its B, as 1F1B would
                order.append(Compute("W", next_w, 0))
                next_w += 1
        order += [Compute("W", mb, 0) for mb in range(next_w, m)]
        schedule.append(order)
    return schedule


def build_zbv(
    pp: int, m: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0), max_alive: Optional[int] = None
) -> list[list[Compute]]:
    """ZB-V: two chunks per rank in a V; the paper's phase order, or the greedy one where that
    is faster (module docstring).

    ``costs`` are (F, B, W) per chunk; ``max_alive`` caps the chunk activations alive per
    rank (default 2pp, the activation memory of 1F1B).
    """
    check_sizes(pp, 2, m)
    layout = StageLayout(pp, 2, v_shape=True)
    cap = max_alive or 2 * pp
    greedy = greedy_schedule(layout, m, costs, cap)
    phases = [_ZBVRank(pp, rank).order(m) for rank in range(pp)]
    return phases if step_time(phases, layout, costs, cap) <= step_time(greedy, layout, costs, cap) else greedy


def step_time(
    order: list[list[Compute]], layout: StageLayout, costs: tuple[float, float, float], max_alive: int
) -> float:
    """Step time of a split-backward compute order under the executor's semantics (inf: over ``max_alive``).

    The executor posts every Comm without blocking and a compute waits only for the receive it
    reads, whose send is posted as soon as its producer ends. So each compute starts when its rank
    is free and, when its input comes from another rank, when the producer ended: F(mb, s) after
    F(mb, s-1), B(mb, s) after B(mb, s+1). Inputs made on the rank itself (F before B, B before W,
    a V's turn) are ordered by the list. F costs ``costs[0]``, B ``costs[1]``, W ``costs[2]``
    (B as (B + W) - W, the simulator's arithmetic, so both give the same floats). A rank's
    activations alive rise at each F and fall at each W.
    """
    f, b, w = costs
    cost = {"F": f, "B": (b + w) - w, "W": w}
    last = layout.num_stages - 1
    end: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> time that compute ended
    free, pc = [0.0] * layout.pp, [0] * layout.pp
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(order):
            while pc[rank] < len(actions):
                a = actions[pc[rank]]
                s, start = layout.stage(rank, a.chunk), free[rank]
                src = s - 1 if a.kind == "F" else s + 1
                if a.kind != "W" and 0 <= src <= last and layout.rank_of(src) != rank:
                    if (a.kind, a.mb, src) not in end:
                        break  # its producer has not run yet
                    start = max(start, end[(a.kind, a.mb, src)])
                free[rank] = end[(a.kind, a.mb, s)] = start + cost[a.kind]
                pc[rank] += 1
                progress = True
    if any(pc[rank] < len(actions) for rank, actions in enumerate(order)):
        raise RuntimeError(f"a zero-bubble V order deadlocks (pp={layout.pp}); stuck at {pc}")
    for actions in order:
        alive = peak = 0
        for a in actions:
            alive += 1 if a.kind == "F" else -1 if a.kind == "W" else 0
            peak = max(peak, alive)
        if peak > max_alive:
            return float("inf")
    return max(free, default=0.0)


class _VRank:
    """One rank's actions in a V built phase by phase: per-chunk F and B counters."""

    def __init__(self, pp: int, rank: int):
        self.pp, self.rank = pp, rank
        self.actions: list[Compute] = []
        self.next = {(c, k): 0 for c in (0, 1) for k in "FB"}

    def _add(self, kind: str, chunk: int) -> int:
        """Append ``kind`` of the chunk's next micro-batch; return that micro-batch."""
        mb = self.next[(chunk, kind)]
        self.next[(chunk, kind)] += 1
        self.actions.append(Compute(kind, mb, chunk))
        return mb

    def f(self, chunk: int) -> None:
        self._add("F", chunk)


class _ZBVRank(_VRank):
    """One rank's actions in the zero-bubble paper's ZB-V phase order (module docstring)."""

    def __init__(self, pp: int, rank: int):
        super().__init__(pp, rank)
        self.held: dict[int, deque] = {0: deque(), 1: deque()}  # per chunk: mbs whose B ran, W not yet

    def b(self, chunk: int) -> None:
        self.held[chunk].append(self._add("B", chunk))

    def w(self, chunk: int) -> None:
        self.actions.append(Compute("W", self.held[chunk].popleft(), chunk))

    def order(self, m: int) -> list[Compute]:
        pp, r, a, b = self.pp, self.rank, 0, 1
        n = max(m, 2 * pp - 1)  # the phases need 2pp - 1 micro-batches; extra ones are dropped below
        for _ in range(2 * (pp - r) - 1):
            self.f(a)
        for _ in range(r):
            self.f(b), self.f(a)
        for _ in range(pp - r):
            self.f(b), self.b(b), self.w(b)
        while self.next[(b, "F")] < self.next[(a, "F")] or self.next[(a, "F")] < n:
            if self.next[(a, "F")] < n:
                self.f(a)
            self.b(a), self.w(a), self.f(b), self.b(b), self.w(b)
        for _ in range(r):
            self.b(a), self.b(b)
        for _ in range(pp - r):
            self.b(a), self.w(a)
        for chunk in (b, a):
            while self.held[chunk]:
                self.w(chunk)
        return [x for x in self.actions if x.mb < m]


def build_dualpipev(pp: int, m: int) -> list[list[Compute]]:
    """DualPipeV's per-rank order on the V layout (module docstring), whole backwards as B then W."""
    check_dualpipev(pp, 2, m)
    return [_DualPipeVRank(pp, rank).order(m) for rank in range(pp)]


class _DualPipeVRank(_VRank):
    """One rank's DualPipeV actions, with the FIFO of held-back W's."""

    def __init__(self, pp: int, rank: int):
        super().__init__(pp, rank)
        self.held: deque = deque()

    def b(self, chunk: int, split: bool) -> None:
        mb = self._add("B", chunk)
        if split:
            self.held.append((mb, chunk))
        else:
            self.actions.append(Compute("W", mb, chunk))

    def w(self) -> None:
        if self.held:
            mb, chunk = self.held.popleft()
            self.actions.append(Compute("W", mb, chunk))

    def order(self, m: int) -> list[Compute]:
        pp, r, a, b = self.pp, self.rank, 0, 1
        for _ in range(2 * (pp - r - 1)):
            self.f(a)
        for _ in range(r + 1):
            self.f(a), self.f(b)
        for _ in range(pp - r - 1):
            self.b(b, split=True), self.w(), self.f(b)
        for _ in range(m - 2 * pp + r + 1):
            self.f(a), self.b(b, split=False), self.f(b), self.b(a, split=False)
        for _ in range(pp - r - 1):
            self.b(b, split=False), self.f(b), self.b(a, split=False)
        split = False
        for i in range(r + 1):
            middle = i == (r + 1) // 2
            split = split or (middle and r % 2 == 1)
            self.b(b, split)
            split = split or middle
            self.b(a, split)
        for _ in range(pp - r - 1):
            self.w(), self.b(a, split=True)
        for _ in range(r + 1):
            self.w()
        return self.actions


def greedy_schedule(
    layout: StageLayout, m: int, costs: tuple[float, float, float], max_alive: int
) -> list[list[Compute]]:
    """List-schedule F, B, W of every (micro-batch, stage) with unit-free ``costs``; see the module doc.

    Stages take micro-batches in order (F and B of stage s: 0, 1, ..., m-1). Transfers cost 0
    here; step_time (or the simulator) times the result with its own costs and placement.
    """
    pp, S = layout.pp, layout.num_stages
    f_end: dict[tuple[int, int], float] = {}  # (mb, stage) -> time its F ends
    b_end: dict[tuple[int, int], float] = {}
    next_f, next_b = [0] * S, [0] * S
    pending_w: list[deque] = [deque() for _ in range(pp)]  # (mb, chunk) whose B is done
    alive, free = [0] * pp, [0.0] * pp
    orders: list[list[Compute]] = [[] for _ in range(pp)]
    todo = 3 * m * S
    while todo:
        best = None
        for rank in range(pp):
            pick = _next_action(
                rank, layout, m, f_end, b_end, next_f, next_b, pending_w[rank], alive[rank] < max_alive, free[rank]
            )
            if pick is not None and (best is None or pick[0] < best[0]):
                best = (pick[0], rank, pick[1])
        if best is None:
            raise RuntimeError("greedy schedule stalled (max_alive too small?)")
        start, rank, action = best
        end = start + costs["FBW".index(action.kind)]
        free[rank] = end
        stage = layout.stage(rank, action.chunk)
        if action.kind == "F":
            f_end[(action.mb, stage)], next_f[stage], alive[rank] = end, next_f[stage] + 1, alive[rank] + 1
        elif action.kind == "B":
            b_end[(action.mb, stage)], next_b[stage] = end, next_b[stage] + 1
            pending_w[rank].append((action.mb, action.chunk))
        else:
            pending_w[rank].popleft()
            alive[rank] -= 1
        orders[rank].append(action)
        todo -= 1
    return orders


def _next_action(
    rank: int,
    layout: StageLayout,
    m: int,
    f_end: dict,
    b_end: dict,
    next_f: list,
    next_b: list,
    pending_w: deque,
    may_forward: bool,
    free: float,
):
    """(start time, action) of what ``rank`` runs next, or None when it has nothing left.

    Candidates are the next F and B of each local stage and the oldest pending W, each
    with the time its inputs are ready; the rank starts at the earliest such time and,
    among the candidates ready by then, takes B before F before W (later stages first).
    """
    last = layout.num_stages - 1
    ready: list[tuple[float, int, int, Compute]] = []  # (ready time, priority, -stage, action)
    for chunk in range(layout.vp):
        s = layout.stage(rank, chunk)
        mb = next_b[s]
        if mb < m and (mb, s) in f_end and (s == last or (mb, s + 1) in b_end):
            t = max(f_end[(mb, s)], b_end.get((mb, s + 1), 0.0))
            ready.append((t, 0, -s, Compute("B", mb, chunk)))
        mb = next_f[s]
        if may_forward and mb < m and (s == 0 or (mb, s - 1) in f_end):
            ready.append((f_end.get((mb, s - 1), 0.0), 1, -s, Compute("F", mb, chunk)))
    if pending_w:
        mb, chunk = pending_w[0]
        ready.append((0.0, 2, 0, Compute("W", mb, chunk)))
    if not ready:
        return None
    start = max(free, min(r[0] for r in ready))
    return start, heapq.nsmallest(1, [r for r in ready if r[0] <= start], key=lambda r: r[1:3])[0][3]
