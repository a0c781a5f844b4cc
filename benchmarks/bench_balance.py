#!/usr/bin/env python
"""Even vs balanced pipeline stages on a model with a large output layer (vocabulary 32k), gloo on CPU.

For every (pp, schedule, m) row, the same processes build two trainers of the
same model: one with the even split of layers, one with the split
``--pipeline-balance measured`` chooses (``measure.measure_layer_costs`` on
these processes, then ``balance.choose_split``: exactly what the Trainer does
at startup). Steps alternate even / balanced one by one (order flipped each
step) so load from other processes hits both alike; a step's time is the
slower rank's after a barrier, tokens/s comes from the median step. The table
gives both splits, tokens/s, the measured bubble (Trainer's "bubble", mean over
ranks) and what the simulator predicted from the measured layer costs.

  python benchmarks/bench_balance.py                     # pp 2 and 4, m 4 and 8 (minutes on 2 cores)
  python benchmarks/bench_balance.py --quick             # pp 2, m 4, hidden 256, 2 timed steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch
from common import pipeline_config, run_distributed  # first: puts the repository on sys.path

from megalite.analysis.measure import measure_layer_costs, plan_for
from megalite.config import Config
from megalite.config.settings import resolve_settings
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed

Row = Tuple[int, str, int, int]  # (pp, schedule, vp, m)


def make_config(a: argparse.Namespace, pp: int, schedule: str, vp: int, m: int, split=None) -> Config:
    """GPT-2 style (tied embeddings), dropout 0.1, mock data with the large vocabulary."""
    return pipeline_config(a, pp, schedule, vp, m, heads=a.num_attention_heads, split=split)


def run_row(ps: ParallelState, a: argparse.Namespace, row: Row) -> Dict:
    """Measure, plan, build both trainers, alternate their steps; this rank's numbers."""
    pp, schedule, vp, m = row
    cfg = make_config(a, pp, schedule, vp, m)
    t0 = time.perf_counter()
    settings = resolve_settings(cfg, ps.world_size)
    costs = measure_layer_costs(cfg, ps, settings)
    plan = plan_for(cfg, settings, costs)
    plan_s = time.perf_counter() - t0
    trainers = {
        "even": Trainer(make_config(a, pp, schedule, vp, m, plan.baseline.counts), ps),
        "balanced": Trainer(make_config(a, pp, schedule, vp, m, plan.chosen.counts), ps),
    }
    feed = MockFeed(trainers["even"], 4)  # both trainers read the same micro-batches
    batches = [feed.next() for _ in range(4)]
    res: Dict[str, List] = {
        k: [] for name in trainers for k in (name, f"bubble_{name}", f"compute_{name}", f"other_{name}")
    }
    for i in range(a.warmup + a.steps):
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for name in order:
            ps.barrier()
            start = time.perf_counter()
            out = trainers[name].train_step(batches[i % 4])
            if i >= a.warmup:
                res[name].append(time.perf_counter() - start)
                res[f"bubble_{name}"].append(out["bubble"])
                res[f"compute_{name}"].append(out["forward"] + out["backward"])
                res[f"other_{name}"].append(out["grads_sync"] + out["optimizer"])
    res.update(plan=plan, plan_s=plan_s)
    return res


def run_rows(ps: ParallelState, a: argparse.Namespace, rows: List[Row]) -> List[Dict]:
    out = []
    for row in rows:
        out.append(run_row(ps, a, row))
        if ps.rank == 0:
            print(f"  done pp={row[0]} {row[1]} m={row[3]}", file=sys.stderr, flush=True)
    return out


def summarize(a: argparse.Namespace, row: Row, per_rank: List[Dict]) -> Dict:
    """Step time = the slower rank's; bubbles are means over ranks and steps."""
    pp, schedule, vp, m = row
    tokens = m * a.micro_batch_size * a.seq_length
    out = {
        "pp": pp,
        "schedule": schedule,
        "m": m,
        "plan": per_rank[0]["plan"],
        "plan_s": max(r["plan_s"] for r in per_rank),
    }
    for name in ("even", "balanced"):
        steps = [max(ts) for ts in zip(*(r[name] for r in per_rank))]
        out[f"tok_{name}"] = tokens / statistics.median(steps)
        out[f"bubble_{name}"] = statistics.mean(b for r in per_rank for b in r[f"bubble_{name}"])
        # where the time goes: each rank's forward+backward, and grad sync + optimizer (slower rank)
        out[f"compute_{name}"] = [1e3 * statistics.median(r[f"compute_{name}"]) for r in per_rank]
        out[f"other_{name}"] = max(1e3 * statistics.median(r[f"other_{name}"]) for r in per_rank)
    return out


def print_table(a: argparse.Namespace, summaries: List[Dict]) -> None:
    print(
        f"gloo on CPU, 1 thread per rank; GPT-2 style {a.num_layers} layers, hidden {a.hidden_size}, heads "
        f"{a.num_attention_heads}, seq "
        f"{a.seq_length}, micro-batch {a.micro_batch_size}, vocab {a.vocab_size} (tied), dropout 0.1; "
        f"{a.steps} timed steps per split after {a.warmup} warmup, alternating even/balanced"
    )
    print(
        "split: layers per stage; tok/s from the median step (slower rank); bubble: measured (Trainer, mean "
        "over ranks) / predicted by the simulator from the measured layer costs"
    )
    head = (
        f"{'pp':>2} |{'schedule':<17}|{'m':>3} |{'even split':>12} |{'balanced':>12} |{'even tok/s':>11} |"
        f"{'bal tok/s':>10} |{'speedup':>8} |{'predicted':>9} |{'even bubble':>14} |{'bal bubble':>14} |"
        f"{'plan s':>7}"
    )
    print(head)
    print("-" * len(head))
    for s in summaries:
        p = s["plan"]
        fmt = lambda c: ",".join(map(str, c))  # noqa: E731
        print(
            f"{s['pp']:>2} |{s['schedule']:<17}|{s['m']:>3} |{fmt(p.baseline.counts):>12} |"
            f"{fmt(p.chosen.counts):>12} |{s['tok_even']:>11.0f} |{s['tok_balanced']:>10.0f} |"
            f"{s['tok_balanced'] / s['tok_even']:>7.2f}x |{p.speedup:>8.2f}x |"
            f"{100 * s['bubble_even']:>5.0f}% / {100 * p.baseline.bubble:>4.0f}% |"
            f"{100 * s['bubble_balanced']:>5.0f}% / {100 * p.chosen.bubble:>4.0f}% |{s['plan_s']:>7.1f}"
        )
    for s in summaries:
        print(
            f"  pp={s['pp']} {s['schedule']} m={s['m']}: measured ms per micro-batch (forward/backward, max "
            f"over ranks): {s['plan'].costs.describe()}"
        )
        for name in ("even", "balanced"):
            print(
                f"    {name:<8} ms per step: forward+backward per rank "
                f"{' / '.join(f'{c:.0f}' for c in s[f'compute_{name}'])}, grad sync + optimizer "
                f"{s[f'other_{name}']:.0f}; predicted step {1e3 * getattr(s['plan'], 'baseline' if name == 'even' else 'chosen').step_time:.0f}"
            )


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "gpipe", "interleaved_1f1b"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per row and split")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--quick", action="store_true", help="smoke run: pp 2, m 4, hidden 256, 2 timed steps")
    a = p.parse_args(argv)
    if a.quick:
        a.pp, a.micro_batches, a.hidden_size, a.num_attention_heads, a.steps = [2], [4], 256, 4, 2
    torch.set_num_threads(1)
    summaries = []
    for pp in a.pp:
        rows = [
            (pp, s, 2 if s == "interleaved_1f1b" else 1, m)
            for s in a.schedules
            for m in a.micro_batches
            if not (s == "interleaved_1f1b" and m % pp)
        ]
        per_rank = run_distributed(run_rows, pp, a, rows, pp=pp, timeout=3600)
        summaries += [summarize(a, row, [per_rank[r][i] for r in range(pp)]) for i, row in enumerate(rows)]
    print_table(a, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
