"""Stragglers: the ranks that make the others wait, named at each log line.

A rank makes the others wait in two ways: it computes slowly, or it stalls (stopped, descheduled, paging)
between or inside its actions. Either way the time it spends on its own grows, and its peers spend the
difference waiting for it. So each rank splits every iteration's wall time in two with the flight recorder:
the time blocked in waits on other ranks (the recorder's ``waited``: receives, sends, every recorded
collective: the model's, the gradients', the grad norm's, the log line's) and the rest, its *own* time. At
each log line every rank gives one ``all_gather`` over the world a few numbers (own and wait seconds per
iteration, grid coordinates, expected work) and the logging rank compares each rank with its peers:

- *same work*: the replicas of its shard of its pipeline stage (same pp and tp coordinate: the other dp
  and cp ranks), against the median of their own time (the rank itself left out, so two replicas compare
  with each other and one slow rank does not move its baseline); a stage alone, its tp peers;
- *one replica per stage*: the other stages, against the larger of their median own time and their median
  own time per model FLOP of the layers (and output layer) each holds (throughput.py's count), scaled to
  the rank's: a stage is slow when it takes longer than the others and longer than its FLOPs explain.

A rank is over the line when its own time is ``--straggler-threshold`` (above 1; default 1.5) times the
baseline or more *and* its peers wait on it: their median wait exceeds its own wait by at least
``_MIN_SHARE`` of its iteration time. Both margins are relative (to the peers' own time and to the step),
so neither a fast model's few milliseconds nor a loaded machine's noise decides; the second keeps a rank
silent that nobody waits on, whatever its own time. A stall on any stage is named on that stage: the ranks
it holds up, earlier or later in its pipeline, spend the stall waiting, not on their own. Over the line at
two verdicts running (log lines), a rank is named with its host (users look for the bad node)::

    straggler: rank 5 (host node07, stage 2, dp 1) makes the others wait: 2.4x the median of its stage (own time 41.2 ms vs 17.1 ms per iteration; they wait 23.9 ms more than it does)

The first iteration (warm-up), evaluation, saving and the log line itself are left out, and so are
iterations traced by --profile (the profiler slows only the ranks it traces); a verdict needs at least
``_MIN_ITERATIONS`` iterations (with a shorter --log-interval the interval spans several log lines). With the flight recorder off
(``--flight-recorder-size 0``) no wait is seen: every rank's own time is its iteration and nobody is named.

TensorBoard gets the spread of own time over ranks (``straggler/compute-min``, ``-median``, ``-max``, ms
per iteration; the names kept from when it counted compute only) and the largest slowdown. On CUDA the
host's clock sees a kernel only at a sync, so the iterations used are the last few of each interval, which
the trainer runs with a device sync around each action. Not yet right on NCCL: a transfer's or collective's
``wait()`` returns once the stream waits, so the time blocked on another rank shows up at the next sync, in
the waiting rank's own time; the split is exact on gloo (CPU), where waits block the host.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.observability.throughput import flops_per_iteration
from megalite.parallel.state import ParallelState

logger = logging.getLogger("megalite")
_SYNCED_PER_INTERVAL = 3  # on CUDA: the iterations of each interval timed with a sync per action
_MIN_SECONDS = 1e-4  # a baseline below this (a rank with nothing to compute) compares with nothing
# the peers must wait on a rank this share of its iteration or more: below it, 2x of almost nothing (a rank
# that mostly waits) or a loaded machine's jitter; a rank slowed 2x or stopped half the time is far above
_MIN_SHARE = 0.1
# a judgement needs this many iterations: a log line after fewer (--log-interval 1, or a traced interval) adds
# to the next one instead, so one noisy iteration is never a verdict (a short even run logging every
# iteration named a rank)
_MIN_ITERATIONS = 5


def rank_work(chunks: Sequence[torch.nn.Module], model: ModelConfig) -> float:
    """Model FLOPs per sample of this rank's chunks: their layers, and the output layer on the last stage."""
    layer = flops_per_iteration(model, 1, 0) / model.num_layers
    head = 6.0 * model.hidden_size * model.seq_length
    return sum(len(c.decoder.layers) * layer + (head * c.padded_vocab if c.post_process else 0.0) for c in chunks)


@dataclass
class RankRow:
    """One rank's numbers for an interval (what the all_gather carries), in seconds per iteration."""

    rank: int
    pp: int
    tp: int
    dp: int
    cp: int
    own: float  # the iteration's wall time outside waits on other ranks
    wait: float  # blocked on other ranks (the flight recorder's waits)
    work: float = 1.0  # expected relative work (rank_work)
    n: int = 1  # iterations counted


@dataclass
class Straggler:
    row: RankRow
    ratio: float  # own time over the baseline
    baseline: float  # the peers' median own time (other stages: scaled to this rank's work)
    basis: str  # "its stage" or "the other stages (per model FLOP)"
    held: float  # how much longer its peers wait than it does (median, s per iteration)


def compare(rows: Sequence[RankRow]) -> List[Straggler]:
    """Every comparable rank against its peers (pure: the unit tests call it)."""
    rows = [r for r in rows if r.n > 0]
    out: List[Straggler] = []
    for r in rows:
        found = _peers(r, rows)
        if found is None:
            continue
        peers, baseline, basis = found
        if baseline >= _MIN_SECONDS:
            held = statistics.median(p.wait for p in peers) - r.wait
            out.append(Straggler(r, r.own / baseline, baseline, basis, held))
    return out


def _peers(r: RankRow, rows: Sequence[RankRow]) -> Optional[Tuple[List[RankRow], float, str]]:
    """The ranks ``r`` is compared with, their baseline and its name (None: nobody to compare with). Best the
    replicas of its shard (same pp and tp: the other dp and cp ranks, usually on other nodes); else the other
    stages of its tp rank; else, one stage alone, its tp peers (on its own node: a slow node slows them all)."""
    peers = [p for p in rows if p.rank != r.rank and (p.pp, p.tp) == (r.pp, r.tp)]
    if peers:
        return peers, statistics.median(p.own for p in peers), "its stage"
    peers = [p for p in rows if p.tp == r.tp and p.pp != r.pp and p.work > 0]
    if peers and r.work > 0:
        return (peers, *_stage_baseline(r, peers))
    peers = [p for p in rows if p.rank != r.rank and p.pp == r.pp]
    if peers:
        return peers, statistics.median(p.own for p in peers), "its stage"
    return None


def _stage_baseline(r: RankRow, others: Sequence[RankRow]) -> Tuple[float, str]:
    """The other stages' median own time, or their median per model FLOP scaled to ``r``'s work, whichever is
    larger: a stage is slow only when it takes longer than the others *and* longer than its FLOPs explain. A
    small model's time is not its FLOPs (a stage of cheap layers looked 2.3x per FLOP while taking no longer
    than the stage after it), and a stage given more layers by design is on time when in proportion."""
    plain = statistics.median(p.own for p in others)
    per_flop = statistics.median(p.own / p.work for p in others) * r.work
    return (per_flop, "the other stages (per model FLOP)") if per_flop >= plain else (plain, "the other stages")


def find_stragglers(rows: Sequence[RankRow], threshold: float) -> List[Straggler]:
    """Ranks over the line, slowest first: own time ``threshold`` x their baseline or more, and their peers
    waiting on them at least _MIN_SHARE of their iteration (own + wait)."""
    over = [s for s in compare(rows) if s.ratio >= threshold and s.held >= _MIN_SHARE * (s.row.own + s.row.wait)]
    return sorted(over, key=lambda s: -s.ratio)


def slowdowns(rows: Sequence[RankRow]) -> List[float]:
    """Every comparable rank's ratio of own time to its baseline."""
    return [s.ratio for s in compare(rows)]


class StragglerMonitor:
    """One rank's side: ``record`` each iteration, ``check`` at each log line (a collective on every rank).

    The time between two marks (the end of the last iteration, of an evaluation or a save, of the log
    line) is the iteration's; the flight recorder's ``waited``, read at the same marks, is the part of it
    spent waiting on other ranks.
    """

    def __init__(self, threshold: float, ps: ParallelState, work: float, log_interval: int, train_iters: int):
        self.threshold, self.ps, self.work = threshold, ps, work
        self.log_interval, self.train_iters = log_interval, train_iters
        self.enabled = threshold > 0 and ps.world_size > 1 and dist.is_initialized()
        self.cuda = ps.device.type == "cuda"
        self._reset()
        self.suspects: set = set()  # ranks over the line at the last log line
        self.hosts: List[str] = [socket.gethostname()] * ps.world_size
        if self.enabled:  # once, at the same point on every rank (the Reporter is built there)
            ps.recorder.call("world", dist.all_gather_object, self.hosts, socket.gethostname())
        self.warm = False  # the first iteration (allocation, lazy initialisation) is not counted
        self.pause()

    def _reset(self) -> None:
        self.own = self.wait = 0.0  # seconds this interval
        self.n = 0

    def pause(self) -> None:
        """Time not spent in iterations (evaluation, a save, the log line) ends here: the next one starts now."""
        self._mark = (time.perf_counter(), self.ps.recorder.waited)

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
        """Iteration ``iteration`` just ended (no collective; ``events``, its executor actions, are not needed:
        the marks and the recorder's waits say it all)."""
        (t0, w0), now, waited = self._mark, time.perf_counter(), self.ps.recorder.waited
        self._mark = (now, waited)
        warm, self.warm = self.warm, True
        if not warm or not self.timed(iteration):
            return
        self.n += 1
        self.wait += waited - w0
        self.own += max(0.0, (now - t0) - (waited - w0))

    def check(self) -> Optional[List[RankRow]]:
        """Gather every rank's interval (collective); the rows, and the next interval starts. None when disabled
        or when a rank counted fewer than _MIN_ITERATIONS iterations: the interval goes on (every rank sees the
        same rows, so every rank decides alike)."""
        if not self.enabled:
            return None
        ps, n = self.ps, max(self.n, 1)
        mine = torch.tensor(
            [ps.pp_rank, ps.tp_rank, ps.dp_rank, ps.cp_rank, self.own / n, self.wait / n, self.work, self.n],
            dtype=torch.float64,
            device=ps.device if ps.backend == "nccl" else "cpu",
        )
        parts = [torch.empty_like(mine) for _ in range(ps.world_size)]
        ps.recorder.call("world", dist.all_gather, parts, mine)
        rows = []
        for rank, t in enumerate(parts):
            v = t.cpu().tolist()
            rows.append(RankRow(rank, *(int(x) for x in v[:4]), v[4], v[5], v[6], int(v[7])))
        if min(r.n for r in rows) < _MIN_ITERATIONS:
            return None
        self._reset()
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
            f"straggler: rank {r.rank} ({', '.join(where)}) makes the others wait: {s.ratio:.1f}x the median of "
            f"{s.basis} (own time {1e3 * r.own:.1f} ms vs {1e3 * s.baseline:.1f} ms per iteration; they wait "
            f"{1e3 * s.held:.1f} ms more than it does)"
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
        values = sorted(1e3 * r.own for r in rows if r.n > 0)
        ratios = slowdowns(rows)
        if not values:
            return {}
        return {
            "straggler/compute-min": values[0],
            "straggler/compute-median": statistics.median(values),
            "straggler/compute-max": values[-1],
            "straggler/max-slowdown": max(ratios) if ratios else None,
        }
