"""Balanced pipeline stages: the layer split the simulator finds fastest for given layer costs.

A real model's stages are never equal: the first also runs the embedding,
the last the final norm, the output layer and the loss (with a 32k vocabulary
that can cost several transformer layers). Given the (forward, backward) cost
of each layer kind, virtual stage s of a split ``counts`` costs::

    f_s = counts[s] * layer.f + (s == 0) * embedding.f + (s == S-1) * head.f    (b alike)

and the schedule's own action lists, run by ``analysis.simulate.simulate`` with those
per-stage costs (its executor-semantics mode, the schedule's stage placement),
give the step time (makespan) and the bubble. The search:

    candidates   even split; water-filling per stage and per pipeline rank (the
                 min-max loads); the best Megatron first/last split
    local search from the best candidate, move one layer between two stages while
                 the simulated step time drops (bounded number of simulations)

Everything is a pure function of (costs, layers, pp, vp, m, schedule) with
fixed iteration orders and strict-improvement acceptance, so every rank that
holds the same costs chooses the same split, and the even split (when legal)
is a candidate, so the result is never slower than it in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megalite.analysis.simulate import simulate
from megalite.pipeline.partition import stage_layer_counts
from megalite.pipeline.registry import build_schedule, layout_for


def _simulator_options(schedule: str, pp: int, vp: int) -> dict:
    """Simulate ``schedule`` as the executor runs it: its own stage placement (interleaved, or a V)
    and the executor's blocking rules (some schedules are deadlock-free only under those)."""
    return {"layout": layout_for(schedule, pp, vp), "mode": "executor"}


Split = Tuple[int, ...]
_MIN_GAIN = 1e-6  # a move must shorten the step by this fraction: float noise never moves a layer


@dataclass(frozen=True)
class LayerCosts:
    """Seconds (or any unit) per micro-batch of each layer kind: (forward, backward).

    ``weight``, when measured (schedules with a split backward), is the part of each kind's
    backward its W action runs, as (embedding, layer, head); without it the simulator takes
    half of every backward.
    """

    embedding: Tuple[float, float]
    layer: Tuple[float, float]
    head: Tuple[float, float]  # final norm + output layer + loss
    weight: Optional[Tuple[float, float, float]] = None

    def as_list(self) -> List[float]:
        return [*self.embedding, *self.layer, *self.head, *(self.weight or ())]

    @classmethod
    def from_list(cls, v: Sequence[float]) -> "LayerCosts":
        """The inverse of ``as_list``: 6 numbers, or 9 with the weight parts."""
        if len(v) not in (6, 9):
            raise ValueError(f"LayerCosts needs 6 or 9 numbers, got {len(v)}")
        v = [float(x) for x in v]
        return cls((v[0], v[1]), (v[2], v[3]), (v[4], v[5]), tuple(v[6:9]) if len(v) == 9 else None)

    def describe(self, scale: float = 1e3) -> str:
        """``embedding 0.10/0.20, layer ..., output layer + loss ...`` (forward/backward[ of which W], x scale)."""
        parts = (("embedding", self.embedding), ("transformer layer", self.layer), ("output layer + loss", self.head))
        ws = self.weight or (None, None, None)
        return ", ".join(
            f"{name} {f * scale:.3g}/{b * scale:.3g}" + ("" if w is None else f" (W {w * scale:.3g})")
            for (name, (f, b)), w in zip(parts, ws)
        )


def stage_costs(counts: Sequence[int], costs: LayerCosts) -> List[Tuple[float, ...]]:
    """(forward, backward[, weight part of the backward]) cost of every virtual stage of the split ``counts``."""
    last = len(counts) - 1
    we, wl, wh = costs.weight or (0.0, 0.0, 0.0)
    out: List[Tuple[float, ...]] = []
    for s, n in enumerate(counts):
        f, b, w = n * costs.layer[0], n * costs.layer[1], n * wl
        if s == 0:
            f, b, w = f + costs.embedding[0], b + costs.embedding[1], w + we
        if s == last:
            f, b, w = f + costs.head[0], b + costs.head[1], w + wh
        out.append((f, b, w) if costs.weight is not None else (f, b))
    return out


@dataclass(frozen=True)
class Prediction:
    """A split and what the simulator says of it: step time (makespan), mean bubble, per-rank busy time."""

    counts: Split
    step_time: float
    bubble: float
    busy: Tuple[float, ...]


def even_split(num_layers: int, stages: int) -> Split:
    """``num_layers`` over ``stages`` as evenly as possible (the remainder on the earliest stages)."""
    q, r = divmod(num_layers, stages)
    return tuple(q + (1 if s < r else 0) for s in range(stages))


def _water_fill(num_layers: int, fixed: Sequence[float], unit: float, groups: Sequence[Sequence[int]]) -> Split:
    """Give every group of stages its layers one at a time, each to the group whose load stays lowest.

    ``fixed[s]`` is stage s's cost without layers, ``unit`` one layer's; a group's
    load is its stages' sum. Greedy filling is optimal for this min-max problem
    (every layer costs the same); inside a group layers go to its cheapest stage.
    Ties go to the lowest index, so the result is deterministic.
    """
    counts = [1] * len(fixed)
    load = lambda g: sum(fixed[s] + counts[s] * unit for s in g)  # noqa: E731
    for _ in range(num_layers - len(fixed)):
        g = min(range(len(groups)), key=lambda i: (load(groups[i]) + unit, i))
        s = min(groups[g], key=lambda s: (fixed[s] + counts[s] * unit, s))
        counts[s] += 1
    return tuple(counts)


def _megatron_candidate(num_layers: int, pp: int, vp: int, costs: LayerCosts) -> Optional[Split]:
    """The legal first/last (Megatron's flags) split with the lowest busiest-rank load, if any."""
    options = [None] + list(range(vp, num_layers + 1, vp))
    best, best_key = None, None
    for first in options:
        for last in options:
            if first is None and last is None:
                continue
            try:
                counts = stage_layer_counts(num_layers, pp, vp, first, last)
            except ValueError:
                continue
            per_stage = [c[0] + c[1] for c in stage_costs(counts, costs)]
            key = max(sum(per_stage[r::pp]) for r in range(pp))
            if best_key is None or key < best_key:
                best, best_key = tuple(counts), key
    return best


def candidate_splits(
    num_layers: int, pp: int, vp: int, costs: LayerCosts, rank_stages: Optional[Sequence[Sequence[int]]] = None
) -> List[Split]:
    """Starting points, best guesses first, without duplicates (the even split always first).

    ``rank_stages[r]`` lists the global stages rank r runs (default: Megatron's
    interleaved placement, stage s on rank s % pp).
    """
    S = pp * vp
    unit = costs.layer[0] + costs.layer[1]
    fixed = [c[0] + c[1] for c in stage_costs([0] * S, costs)]
    groups = rank_stages or [list(range(r, S, pp)) for r in range(pp)]
    found = [
        even_split(num_layers, S),
        _water_fill(num_layers, fixed, unit, [[s] for s in range(S)]),
        _water_fill(num_layers, fixed, unit, groups),
        _megatron_candidate(num_layers, pp, vp, costs),
    ]
    out: List[Split] = []
    for c in found:
        if c is not None and c not in out:
            out.append(c)
    return out


def _rank_stages(actions: Sequence[Sequence[object]], stages: int) -> List[List[int]]:
    """The global stages each rank runs, read from its p2p ops (any placement: interleaved, V, ...)."""
    out: List[List[int]] = []
    for rank_actions in actions:
        mine = set()
        for a in rank_actions:
            for op in getattr(a, "ops", ()):
                mine.add(op.src_stage if op.op == "send" else op.dst_stage)
        out.append(sorted(mine))
    if sorted(s for r in out for s in r) != list(range(stages)):
        raise ValueError(f"the schedule's transfers do not place each of the {stages} stages on one rank")
    return out


class _Simulator:
    """Simulates one schedule's action lists under many per-stage costs (memoised by split)."""

    def __init__(self, schedule: str, pp: int, vp: int, m: int, costs: LayerCosts, overlap_p2p: bool):
        self.schedule, self.pp, self.vp, self.costs = schedule, pp, vp, costs
        self.actions = build_schedule(schedule, pp, vp, m, overlap_p2p=overlap_p2p)
        self.placement = _simulator_options(schedule, pp, vp)
        self.rank_stages = _rank_stages(self.actions, pp * vp)
        self.cache: Dict[Split, Prediction] = {}

    def __call__(self, counts: Split) -> Prediction:
        if counts not in self.cache:
            r = simulate(
                self.actions,
                self.pp,
                self.vp,
                stage_costs=stage_costs(counts, self.costs),
                schedule=self.schedule,
                **self.placement,
            )
            bubble = sum(r.bubble_fraction) / len(r.bubble_fraction)
            self.cache[counts] = Prediction(counts, r.makespan, bubble, tuple(r.busy))
        return self.cache[counts]


def _moves(counts: Split, rank_stages: Sequence[Sequence[int]], busy: Sequence[float], full: bool) -> List[Split]:
    """Splits one layer away: from stage i to stage j, in a fixed order.

    With many stages only layers leaving the two busiest ranks' stages are
    tried (a layer moved elsewhere cannot shorten the critical path first).
    """
    S = len(counts)
    sources = list(range(S))
    if not full:
        ranks = sorted(range(len(busy)), key=lambda r: (-busy[r], r))[:2]
        sources = sorted(s for r in ranks for s in rank_stages[r])
    out = []
    for i in sources:
        if counts[i] < 2:
            continue
        for j in range(S):
            if j != i:
                c = list(counts)
                c[i], c[j] = c[i] - 1, c[j] + 1
                out.append(tuple(c))
    return out


@dataclass(frozen=True)
class BalancePlan:
    """The chosen split, the even baseline, and how the choice was made."""

    schedule: str
    pp: int
    vp: int
    m: int
    costs: LayerCosts
    baseline: Prediction  # the even split (near-even when layers % stages != 0)
    chosen: Prediction
    simulations: int

    @property
    def speedup(self) -> float:
        return self.baseline.step_time / self.chosen.step_time if self.chosen.step_time > 0 else 1.0

    def describe(self, unit: str = "ms", scale: float = 1e3) -> str:
        """Log lines: the measured costs, the even and the chosen split with predicted step time and bubble."""
        even = "even" if len(set(self.baseline.counts)) == 1 else "near-even"

        def line(name: str, p: Prediction) -> str:
            return (
                f"  {name:<9} {','.join(map(str, p.counts))} layers per stage: predicted step "
                f"{p.step_time * scale:.4g} {unit}, bubble {100 * p.bubble:.1f}%"
            )

        return "\n".join(
            [
                f"pipeline balance: {self.schedule}, pp {self.pp} x vp {self.vp}, {self.m} micro-batches; "
                f"{unit} per micro-batch (forward/backward): {self.costs.describe(scale)}",
                line(even, self.baseline),
                line("balanced", self.chosen) + f" ({self.speedup:.2f}x, {self.simulations} simulations)",
                f"  training with --pipeline-stage-layers {','.join(map(str, self.chosen.counts))}",
            ]
        )


def choose_split(
    num_layers: int,
    pp: int,
    vp: int,
    m: int,
    schedule: str,
    costs: LayerCosts,
    max_simulations: int = 300,
    overlap_p2p: bool = False,
) -> BalancePlan:
    """The split of ``num_layers`` over pp*vp virtual stages with the lowest simulated step time.

    Deterministic given its arguments, and never slower in the simulator than
    the even split. ``max_simulations`` bounds the local search (a count, not a
    clock, so every rank stops at the same place); ``overlap_p2p`` simulates the
    action lists of --overlap-p2p-communication.
    """
    S = pp * vp
    if num_layers < S:
        raise ValueError(f"--num-layers={num_layers} cannot give each of the pp x vp = {S} virtual stages a layer")
    sim = _Simulator(schedule, pp, vp, m, costs, overlap_p2p)
    starts = [sim(c) for c in candidate_splits(num_layers, pp, vp, costs, sim.rank_stages)]
    baseline = starts[0]
    best = baseline
    for p in starts[1:]:
        if p.step_time < best.step_time * (1 - _MIN_GAIN):
            best = p
    full = S * (S - 1) <= 64
    while len(sim.cache) < max_simulations:
        step = None
        for c in _moves(best.counts, sim.rank_stages, best.busy, full):
            if c not in sim.cache and len(sim.cache) >= max_simulations:
                break
            p = sim(c)
            if p.step_time < (step or best).step_time * (1 - _MIN_GAIN):  # steepest descent
                step = p
        if step is None:
            break
        best = step
    return BalancePlan(schedule, pp, vp, m, costs, baseline, best, len(sim.cache))
