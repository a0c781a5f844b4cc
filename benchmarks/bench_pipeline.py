#!/usr/bin/env python
"""Pipeline schedules: megalite's executor vs torch.distributed.pipelining on pp gloo processes.

For every schedule (gpipe, 1f1b, interleaved_1f1b with vp=2, zb_h1, zbv with
vp=2, dualpipev with vp=2; a "+ov" suffix runs megalite with --overlap-p2p-communication against
the same torch schedule), pp (--pp, default 2) and micro-batch count m, both
implementations train the same model chunks (megalite's
GPTModel chunks, built twice with the same seed) on the same micro-batches,
in the same two processes, doing the same step: pipeline forward/backward
(loss / m), tied-embedding gradient sum over the first and last stage,
global-norm clipping, AdamW and the LR schedule.

* megalite: ``Trainer.train_step`` (as tests/helpers/parity.py drives it).
* torch: ``PipelineStage`` per chunk + ``ScheduleGPipe`` / ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B``; for zb_h1 ``ScheduleInterleavedZeroBubble``
  with one stage per rank (torch's closest to ZB-H1), for zbv
  ``ScheduleZBVZeroBubble`` on the same V placement (the same per-rank order whenever megalite picks the
  paper's ZB-V phases: every m > pp at pp <= 7), for dualpipev ``ScheduleDualPipeV`` (the last stage's module
  also lists the tied embedding it reads, or torch's split backward skips its
  gradient); loss_fn = the chunk's own ``loss`` (same math).

With ``--balanced`` a third implementation runs in the same loop: megalite
with the split ``--pipeline-balance measured`` chooses on these processes
(``measure.measure_layer_costs`` then ``measure.plan_for``, what the Trainer
does at startup); same model and micro-batches, only the layers per stage
differ. torch's pipelining has no balancer (its stages are what the user cuts),
so its rows keep the even split; the "same split" ratio is the like-for-like one.

Steps alternate between the implementations one by one (the order rotates
each step) so load from other processes hits all alike. A step's time is the slower
rank's, after a barrier; the table gives tokens/s from the median step time,
megalite's measured bubble (mean over ranks, Trainer.train_step's "bubble"),
the simulator's bubble (executor semantics) with b/f = 2 and with every
stage's measured forward, backward and W time (from the executor's per-action
events), and where megalite's time goes per rank (forward+backward compute, p2p wait; ms
per step) plus grad sync + clip + optimizer.

  python benchmarks/bench_pipeline.py            # pp 2, m in 2 4 8 16, a few minutes
  python benchmarks/bench_pipeline.py --quick    # 4 layers, m in 2 4, 2 steps (smoke run)
  python benchmarks/bench_pipeline.py --pp 2 4 --micro-batches 4 8 16 \
      --schedules 1f1b interleaved_1f1b zb_h1 zbv   # issue 12's table (pp=4 needs 4 cores)
  python benchmarks/bench_pipeline.py --balanced --num-layers 16 --vocab-size 16384 ...  # + balanced split
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from common import pipeline_config, run_distributed  # first: puts the repository on sys.path

from megalite.analysis.measure import measure_layer_costs, plan_for
from megalite.analysis.simulate import simulate_schedule
from megalite.config import Config
from megalite.config.settings import resolve_settings
from megalite.optim.clip_grads import clip_grad_norm_
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.optimizer import build_optimizer
from megalite.parallel.state import ParallelState
from megalite.pipeline.registry import layout_for
from megalite.tensor_parallel.random import RNGTracker
from megalite.training import Trainer, build_model_chunks
from megalite.training.mock import MockFeed

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2))
OVERLAP = "+ov"  # suffix: megalite with --overlap-p2p-communication
Batch = Dict[str, torch.Tensor]


def _split_name(schedule: str) -> Tuple[str, bool]:
    return schedule.replace(OVERLAP, ""), schedule.endswith(OVERLAP)


def make_config(a: argparse.Namespace, schedule: str, vp: int, m: int, pp: int) -> Config:
    """The benchmark model: GPT-2 style (tied embeddings), 4 heads, dropout 0.1, mock data."""
    name, overlap = _split_name(schedule)
    return pipeline_config(a, pp, name, vp, m, heads=4, overlap=overlap)


class TorchPipeline:
    """The same model chunks and training step, scheduled by torch.distributed.pipelining."""

    def __init__(self, cfg: Config, ps: ParallelState, schedule: str, m: int):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )
        from torch.distributed.pipelining.schedules import ScheduleDualPipeV

        self.cfg, self.ps = cfg, ps
        schedule = _split_name(schedule)[0]
        pp = ps.pp_size
        layout = layout_for(schedule, pp, cfg.parallel.vp)
        tracker = RNGTracker(cfg.train.seed, ps.tp_rank, ps.pp_rank, ps.device)
        self.chunks = build_model_chunks(cfg, ps, tracker, layout)
        self.params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, cfg.train.train_iters)
        stages = [
            PipelineStage(
                _torch_stage_module(c, self.chunks),
                stage_index=layout.stage(ps.pp_rank, i),
                num_stages=layout.num_stages,
                device=ps.device,
                group=ps.pp_group,
            )
            for i, c in enumerate(self.chunks)
        ]
        last = (
            next(c for c in self.chunks if c.post_process)
            if any(c.post_process for c in self.chunks)
            else self.chunks[-1]
        )
        mbs, s = cfg.train.micro_batch_size, cfg.model.seq_length
        mask = torch.ones(mbs, s)
        loss_fn = lambda logits, labels: last.loss(logits, labels, mask)  # noqa: E731
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
        elif schedule == "zb_h1":
            self.schedule = ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
        elif schedule == "zbv":
            self.schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
        elif schedule == "dualpipev":
            self.schedule = ScheduleDualPipeV(stages, m, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(stages[0], m, loss_fn=loss_fn)
        self.first = any(c.pre_process for c in self.chunks)
        self.last = any(c.post_process for c in self.chunks)

    def train_step(self, batches: List[Batch]) -> Dict[str, object]:
        """Pipeline forward/backward, tied-embedding sync, clip, AdamW, LR (as Trainer.train_step)."""
        for c in self.chunks:
            c.train()
        self.optimizer.zero_grad(set_to_none=True)
        args = (torch.cat([b["tokens"] for b in batches]),) if self.first else ()
        target = torch.cat([b["labels"] for b in batches]) if self.last else None
        losses: List[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses if self.last else None, return_outputs=False)
        if self.ps.embedding.size > 1:
            for c in self.chunks:
                w = c.shared_embedding_weight()
                if w is not None:
                    dist.all_reduce(w.grad, group=self.ps.embedding.group)
        if math.isfinite(clip_grad_norm_(self.params, self.cfg.optim.clip_grad, self.ps)):
            self.optimizer.step()
        self.scheduler.step()
        return {"loss": float(torch.stack(losses).detach().mean()) if losses else None}


class _TiedOutputStage(torch.nn.Module):
    """A V's last chunk as torch sees it: the output layer's weight, the first chunk's embedding, is one of its
    parameters.

    torch's split backward (stage_backward_input / stage_backward_weight) differentiates only the stage
    module's own parameters; without this it silently drops the output layer's weight gradient (the
    largest weight GEMM of the rank) and trains a wrong tied embedding, faster than a correct run.
    """

    def __init__(self, chunk: torch.nn.Module, tied_weight: torch.nn.Parameter):
        super().__init__()
        self.chunk, self.tied_weight = chunk, tied_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)


def _torch_stage_module(chunk, chunks) -> torch.nn.Module:
    """``chunk``, or for a last stage tied to a first stage on this rank, chunk plus the tied weight."""
    first = [c for c in chunks if c.pre_process and c is not chunk]
    if chunk.post_process and chunk.output_weight is None and first and chunk.cfg.tied_embeddings:
        return _TiedOutputStage(chunk, first[0].embedding.word_embeddings.weight)
    return chunk


def timed_step(ps: ParallelState, step: Callable[[], object]) -> Tuple[float, object]:
    """Barrier, run one step, return (this rank's seconds, the step's result)."""
    ps.barrier()
    t0 = time.perf_counter()
    out = step()
    return time.perf_counter() - t0, out


def run_row(ps: ParallelState, a: argparse.Namespace, schedule: str, vp: int, m: int) -> Dict:
    """Train both implementations on one (schedule, m); return this rank's per-step numbers."""
    cfg = make_config(a, schedule, vp, m, ps.pp_size)
    trainer = Trainer(cfg, ps)
    torch_pp = TorchPipeline(cfg, ps, schedule, m)
    feed = MockFeed(trainer, 4)  # ranks without the first or last stage read no data (neither pipeline needs it)
    batches = [feed.next() for _ in range(4)]
    impls = {"megalite": lambda b: trainer.train_step(b), "torch": lambda b: torch_pp.train_step(b)}
    res: Dict[str, object] = {"megalite": [], "torch": [], "stats": [], "first_loss": {}, "balanced": []}
    if a.balanced:
        settings = resolve_settings(cfg, ps.world_size)
        plan = plan_for(cfg, settings, measure_layer_costs(cfg, ps, settings))
        balanced = Trainer(cfg.with_(parallel=replace(cfg.parallel, pipeline_stage_layers=plan.chosen.counts)), ps)
        impls["balanced"] = lambda b: balanced.train_step(b)
        res["plan"] = plan
    for i in range(a.warmup):
        for name, step in impls.items():
            out = step(batches[i % 4])
            if i == 0 and name != "balanced":  # same weights, same batch: the losses must agree (up to dropout)
                res["first_loss"][name] = out["loss"]
    for i in range(a.steps):
        names = list(impls)
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            sec, out = timed_step(ps, lambda: impls[name](batches[i % 4]))
            res[name].append(sec)
            if name == "megalite":
                res["stats"].append({**out, "costs": chunk_costs(trainer.last_stats.events, m)})
    return res


def chunk_costs(events: List[dict], m: int) -> Dict[int, Tuple[float, float, float]]:
    """Per local chunk: (forward, backward incl. W, W) seconds per micro-batch from the executor's events.

    Timed per action, so the simulator sees what each stage really costs: W is not half the
    backward (the output layer's weight GEMM makes it most of the last stage's), and the two
    chunks of a V rank differ (one holds the embedding, the other the output layer and loss).
    """
    total: Dict[Tuple[int, str], float] = {}
    for e in events:
        key = (e["chunk"], e["kind"])
        total[key] = total.get(key, 0.0) + e["end"] - e["start"]
    chunks = sorted({c for c, _ in total})
    return {
        c: (total[(c, "F")] / m, (total[(c, "B")] + total.get((c, "W"), 0.0)) / m, total.get((c, "W"), 0.0) / m)
        for c in chunks
    }


def run_rows(ps: ParallelState, a: argparse.Namespace, rows: List[Tuple[str, int, int]]) -> List[Dict]:
    """One rank (one thread, a gloo group from megalite.testing.run_distributed): every row in turn."""
    results = []
    for schedule, vp, m in rows:
        results.append(run_row(ps, a, schedule, vp, m))
        if ps.rank == 0:
            print(f"  done {schedule} m={m}", file=sys.stderr, flush=True)
    return results


def summarize(a: argparse.Namespace, row: Tuple[str, int, int], per_rank: List[Dict], pp: int) -> Dict:
    """Per-step times are the slower rank's; stats are megalite's, averaged over ranks and steps."""
    schedule, vp, m = row
    name = _split_name(schedule)[0]
    layout = layout_for(name, pp, vp)
    tokens = m * a.micro_batch_size * a.seq_length
    step = {k: [max(ts) for ts in zip(*(r[k] for r in per_rank))] for k in ("megalite", "torch", "balanced")}
    stats = [s for r in per_rank for s in r["stats"]]
    mean = {
        k: statistics.mean(s[k] for s in stats)
        for k in ("forward", "backward", "p2p", "grads_sync", "optimizer", "bubble")
    }
    # Per rank: the pipeline is as fast as its slowest stage, and p2p wait is mostly imbalance.
    compute = [1e3 * statistics.mean(s["forward"] + s["backward"] for s in r["stats"]) for r in per_rank]
    p2p = [1e3 * statistics.mean(s["p2p"] for s in r["stats"]) for r in per_rank]
    ratio_bf = mean["backward"] / mean["forward"]
    sim2 = statistics.mean(simulate_schedule(name, pp, vp, m, 1.0, 2.0, mode="executor").bubble_fraction)
    # The simulator fed with every stage's measured forward, backward and W time per micro-batch:
    # it then sees the last stage's extra output layer and loss and the real B/W split.
    costs = [
        tuple(
            statistics.mean(s["costs"][layout.chunk_of(stage)][i] for s in per_rank[layout.rank_of(stage)]["stats"])
            for i in range(3)
        )
        for stage in range(pp * vp)
    ]
    sim_meas = statistics.mean(
        simulate_schedule(
            name, pp, vp, m, mode="executor", stage_costs=[c if c[2] > 0 else c[:2] for c in costs]
        ).bubble_fraction
    )
    pair = statistics.median(x / y for x, y in zip(step["torch"], step["megalite"]))
    # the first-step loss of each implementation, from a rank that has it (a V reports it on every rank)
    first = {
        k: next(r["first_loss"][k] for r in per_rank if r["first_loss"].get(k) is not None)
        for k in ("megalite", "torch")
    }
    loss_diff = abs(first["megalite"] - first["torch"]) / abs(first["torch"])
    ml_s, tt_s = statistics.median(step["megalite"]), statistics.median(step["torch"])
    out = {
        "schedule": schedule,
        "pp": pp,
        "m": m,
        "loss_diff": loss_diff,
        "ml": tokens / ml_s,
        "tt": tokens / tt_s,
        "pair": pair,
        "bf": ratio_bf,
        "sim2": sim2,
        "sim_meas": sim_meas,
        "compute": compute,
        "p2p_rank": p2p,
        **mean,
    }
    if step["balanced"]:
        out.update(
            bal=tokens / statistics.median(step["balanced"]),
            plan=per_rank[0]["plan"],
            pair_bal=statistics.median(x / y for x, y in zip(step["torch"], step["balanced"])),
        )
    return out


def print_table(a: argparse.Namespace, summaries: List[Dict]) -> None:
    """One line per (pp, schedule, m), plus a sanity line on the first-step losses."""
    print(
        f"pp in {a.pp} gloo processes (1 thread each) on {os.cpu_count()} cores, GPT-2 style {a.num_layers} "
        f"layers, hidden {a.hidden_size}, seq {a.seq_length}, micro-batch {a.micro_batch_size}, vocab {a.vocab_size}, "
        f"dropout 0.1; {a.steps} timed steps per row after {a.warmup} warmup, alternating the implementations"
    )
    print(
        "tok/s from the median step time (slower rank); ratio = megalite/torch tok/s (median of "
        "per-step pairs);\nbubble: measured (megalite, mean over ranks) vs simulated (executor semantics) "
        "with b/f=2 and with every stage's measured F, B, W costs;\nmegalite ms per step: compute and "
        "p2p wait, min/max over ranks; grad sync + clip + optimizer (mean of ranks)"
    )
    head = (
        f"{'pp':>2} |{'schedule':<19}|{'m':>3} |{'megalite tok/s':>15} |{'torch tok/s':>12} |{'ratio':>6} |"
        f"{'meas bubble':>12} |{'sim b/f=2':>10} |{'sim measured':>13} |{'b/f':>5} |"
        f"{'compute min/max':>15}|{'p2p min/max':>12}|{'opt ms':>7}"
    )
    print(head)
    print("-" * len(head))
    for s in summaries:
        print(
            f"{s['pp']:>2} |{s['schedule']:<19}|{s['m']:>3} |{s['ml']:>15.0f} |{s['tt']:>12.0f} |"
            f"{s['pair']:>6.2f} |{100 * s['bubble']:>11.1f}% |{100 * s['sim2']:>9.1f}% |"
            f"{100 * s['sim_meas']:>12.1f}% |{s['bf']:>5.2f} |"
            f"{min(s['compute']):>7.0f}/{max(s['compute']):<7.0f}|"
            f"{min(s['p2p_rank']):>5.0f}/{max(s['p2p_rank']):<6.0f}|"
            f"{1e3 * (s['grads_sync'] + s['optimizer']):>7.0f}"
        )
    if any("bal" in s for s in summaries):
        print("\nmegalite with --pipeline-balance measured (same model and micro-batches; torch keeps the even split):")
        head = (
            f"{'pp':>2} |{'schedule':<19}|{'m':>3} |{'even split':>12} |{'balanced':>12} |{'torch tok/s':>12} |"
            f"{'megalite even':>14} |{'balanced tok/s':>15} |{'ratio even':>11} |{'ratio balanced':>15} |"
            f"{'predicted':>10}"
        )
        print(head)
        print("-" * len(head))
        for s in summaries:
            p = s["plan"]
            print(
                f"{s['pp']:>2} |{s['schedule']:<19}|{s['m']:>3} |{','.join(map(str, p.baseline.counts)):>12} |"
                f"{','.join(map(str, p.chosen.counts)):>12} |{s['tt']:>12.0f} |{s['ml']:>14.0f} |{s['bal']:>15.0f} |"
                f"{s['pair']:>11.2f} |{s['pair_bal']:>15.2f} |{p.speedup:>9.2f}x"
            )
    worst = max(s["loss_diff"] for s in summaries)
    print(
        f"sanity: first-step loss, megalite vs torch (same weights and batch, different dropout "
        f"masks): max relative difference {100 * worst:.2f}%"
    )


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [s for s, _ in SCHEDULES]
    p.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline sizes (one process each)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--schedules", nargs="+", default=names, choices=names + [n + OVERLAP for n in names])
    p.add_argument("--steps", type=int, default=4, help="timed steps per row and implementation")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--balanced", action="store_true", help="also run megalite with the split --pipeline-balance measured chooses"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 4 layers, m in 2 4, 2 timed steps")
    a = p.parse_args(argv)
    if a.quick:
        a.micro_batches, a.steps, a.warmup, a.num_layers = [2, 4], 2, 1, 4
    vps = dict(SCHEDULES)
    summaries = []
    for pp in a.pp:
        rows = [
            (s, vps[_split_name(s)[0]], m)
            for s in a.schedules
            for m in a.micro_batches
            if not (_split_name(s)[0] == "interleaved_1f1b" and m % pp)  # needs m % pp == 0
            and not (_split_name(s)[0] == "dualpipev" and m < 2 * pp)
            and a.num_layers % (pp * vps[_split_name(s)[0]]) == 0
        ]
        per_rank = run_distributed(run_rows, pp, a, rows, pp=pp, timeout=3600)
        summaries += [summarize(a, row, [per_rank[r][i] for r in range(pp)], pp) for i, row in enumerate(rows)]
    print_table(a, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
