"""Stragglers: the ranks whose compute is markedly slower than their peers', named at each log line.

Each rank keeps the time its schedule spent computing (the executor's measured F, B and W actions;
p2p waits and gradient reduction excluded). At each log line every rank gives one ``all_gather`` over
the world a few numbers (its compute per iteration, its F/B/W sums, its grid coordinates and expected
work) and the logging rank compares:

- *same work*: the ranks of one pipeline stage (same pp and tp coordinate) across the data- and
  context-parallel replicas. A rank's baseline is the median of its peers' values, the rank itself
  left out (so two replicas compare with each other and one slow rank does not move its baseline);
- *one replica per stage*: the stages against each other, each rank's compute divided by the model
  FLOPs of the layers (and output layer) it holds (throughput.py's count).

A rank at ``--straggler-threshold`` times its baseline or more, at this log line and the one before,
is named with its host (users look for the bad node)::

    straggler: rank 5 (host node07, stage 2, dp 1) compute 1.8x the median of its stage (41.2 ms vs 22.9 ms per iteration)

A rank's compute per iteration is the sum, over its schedule's actions, of each action's *fastest*
time in the interval (an action is F/B/W of one micro-batch and chunk): waits for the CPU, a page-fault
storm or a collector pause only ever add time, and rarely to the same action in every iteration; and
a rank must be slow in two intervals running (the first one also holds the warm-up). So noise names
nobody, while a rank that is slower throughout (a slow device, a throttled or oversubscribed node) is
named from the second log line on. Tensor- and context-parallel peers wait for a slow member inside
their own collectives, so a slow rank can bring its tp/cp group with it: the named group holds it.
Iterations traced by --profile are left out (the profiler slows only the ranks it traces).

TensorBoard gets the spread over ranks (``straggler/compute-min``, ``-median``, ``-max``, ms per
iteration) and the largest slowdown. On CUDA the executor's action times are host times, so the
iterations used are the last few of each interval, which the trainer runs with a device sync around
each action.
"""

from __future__ import annotations

import logging
import socket
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.observability.throughput import flops_per_iteration
from megalite.parallel.state import ParallelState

logger = logging.getLogger("megalite")
KINDS = ("F", "B", "W")
_SYNCED_PER_INTERVAL = 3  # on CUDA: the iterations of each interval timed with a sync per action
_MIN_SECONDS = 1e-4  # a baseline below this (a rank with nothing to compute) compares with nothing


def rank_work(chunks: Sequence[torch.nn.Module], model: ModelConfig) -> float:
    """Model FLOPs per sample of this rank's chunks: their layers, and the output layer on the last stage."""
    layer = flops_per_iteration(model, 1, 0) / model.num_layers
    head = 6.0 * model.hidden_size * model.seq_length
    return sum(len(c.decoder.layers) * layer + (head * c.padded_vocab if c.post_process else 0.0) for c in chunks)


@dataclass
class RankRow:
    """One rank's numbers for an interval (what the all_gather carries)."""

    rank: int
    pp: int
    tp: int
    dp: int
    cp: int
    value: float  # compute per iteration (s): each action at its fastest in the interval
    work: float  # expected relative work (rank_work)
    sums: Sequence[float] = (0.0, 0.0, 0.0)  # F, B, W seconds summed over the interval
    n: int = 0  # iterations counted


@dataclass
class Straggler:
    row: RankRow
    ratio: float
    baseline: float  # in the units of value (same stage) or value scaled to this rank's work (other stages)
    basis: str  # "its stage" or "the other stages (per model FLOP)"


def find_stragglers(rows: Sequence[RankRow], threshold: float) -> List[Straggler]:
    """Ranks at ``threshold`` x their peers' median or more, slowest first (pure: the unit tests call it)."""
    rows = [r for r in rows if r.n > 0]
    out: List[Straggler] = []
    for r in rows:
        peers = [p for p in rows if p.rank != r.rank and (p.pp, p.tp) == (r.pp, r.tp)]
        if peers:
            baseline, basis = statistics.median(p.value for p in peers), "its stage"
        else:  # one replica per stage: against the other stages, per unit of expected work
            peers = [p for p in rows if p.tp == r.tp and p.pp != r.pp and p.work > 0]
            if not peers or r.work <= 0:
                continue
            baseline = statistics.median(p.value / p.work for p in peers) * r.work
            basis = "the other stages (per model FLOP)"
        if baseline >= _MIN_SECONDS and r.value >= threshold * baseline:
            out.append(Straggler(r, r.value / baseline, baseline, basis))
    return sorted(out, key=lambda s: -s.ratio)


def slowdowns(rows: Sequence[RankRow]) -> List[float]:
    """Every comparable rank's ratio to its baseline (threshold 0 finds them all)."""
    return [s.ratio for s in find_stragglers(rows, 0.0)]


class StragglerMonitor:
    """One rank's side: ``record`` each iteration, ``check`` at each log line (a collective on every rank)."""

    def __init__(self, threshold: float, ps: ParallelState, work: float, log_interval: int, train_iters: int):
        self.threshold, self.ps, self.work = threshold, ps, work
        self.log_interval, self.train_iters = log_interval, train_iters
        self.enabled = threshold > 0 and ps.world_size > 1 and dist.is_initialized()
        self.cuda = ps.device.type == "cuda"
        self._reset()
        self.suspects: set = set()  # ranks over the threshold at the last log line
        self.hosts: List[str] = [socket.gethostname()] * ps.world_size
        if self.enabled:  # once, at the same point on every rank (the Reporter is built there)
            dist.all_gather_object(self.hosts, socket.gethostname())

    def _reset(self) -> None:
        self.fastest: Dict[tuple, float] = {}  # (kind, mb, chunk) -> its shortest time this interval
        self.sums = dict.fromkeys(KINDS, 0.0)  # seconds per action kind this interval
        self.n = 0

    def timed(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` counts (on CUDA: run with a sync per action; the last few of an interval)."""
        if not self.enabled:
            return False
        if not self.cuda:
            return True
        return (
            -iteration
        ) % self.log_interval < _SYNCED_PER_INTERVAL or iteration > self.train_iters - _SYNCED_PER_INTERVAL

    def record(self, events: Sequence[dict], iteration: int) -> None:
        """The executor's events of iteration ``iteration`` (no collective)."""
        if not self.timed(iteration):
            return
        self.n += 1
        fastest, sums = self.fastest, self.sums
        for e in events:
            key, d = (e["kind"], e["mb"], e["chunk"]), e["end"] - e["start"]
            if d < fastest.get(key, float("inf")):
                fastest[key] = d
            sums[e["kind"]] += d

    def check(self) -> Optional[List[RankRow]]:
        """Gather every rank's interval (collective); the rows (None when disabled). Starts the next interval."""
        if not self.enabled:
            return None
        ps = self.ps
        mine = torch.tensor(
            [
                ps.pp_rank,
                ps.tp_rank,
                ps.dp_rank,
                ps.cp_rank,
                sum(self.fastest.values()),
                self.work,
                *self.sums.values(),
                self.n,
            ],
            dtype=torch.float64,
            device=ps.device if ps.backend == "nccl" else "cpu",
        )
        parts = [torch.empty_like(mine) for _ in range(ps.world_size)]
        dist.all_gather(parts, mine)
        self._reset()
        rows = []
        for rank, t in enumerate(parts):
            v = t.cpu().tolist()
            rows.append(RankRow(rank, int(v[0]), int(v[1]), int(v[2]), int(v[3]), v[4], v[5], v[6:9], int(v[9])))
        return rows

    def describe(self, s: Straggler) -> str:
        """The log line naming one straggler."""
        r, ps = s.row, self.ps
        host = self.hosts[r.rank] if r.rank < len(self.hosts) else "?"
        where = [f"host {host}", f"stage {r.pp}"]
        where += [
            f"{axis} {getattr(r, axis)}"
            for axis, size in (("dp", ps.dp_size), ("cp", ps.cp_size), ("tp", ps.tp_size))
            if size > 1
        ]
        return (
            f"straggler: rank {r.rank} ({', '.join(where)}) compute {s.ratio:.1f}x the median of {s.basis} "
            f"({1e3 * r.value:.1f} ms vs {1e3 * s.baseline:.1f} ms per iteration)"
        )

    def report(self, rows: Optional[List[RankRow]]) -> Dict[str, Optional[float]]:
        """Log the stragglers (logging rank) and return the TensorBoard spread."""
        if rows is None:
            return {}
        slow = find_stragglers(rows, self.threshold)
        for s in slow:
            if s.row.rank in self.suspects:
                logger.warning(self.describe(s))
        self.suspects = {s.row.rank for s in slow}
        values = sorted(1e3 * r.value for r in rows if r.n > 0)
        ratios = slowdowns(rows)
        if not values:
            return {}
        return {
            "straggler/compute-min": values[0],
            "straggler/compute-median": statistics.median(values),
            "straggler/compute-max": values[-1],
            "straggler/max-slowdown": max(ratios) if ratios else None,
        }
