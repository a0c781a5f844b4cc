#!/usr/bin/env python
"""Mixture of experts on CPU: dense vs MoE tokens/s, the token dispatchers, dispatch overlap, memory per rank.

Four tables, each from real Trainer steps on mock data (fp32, dropout 0, GPT-2 style, gloo ranks
forked by ``megalite.testing.run_distributed`` with one torch thread each):

1. dense vs MoE of equal *active* parameters, one process: a dense MLP of --ffn-hidden-size F
   against --num-experts experts of F / topk each, top-k routing (same hidden size and layers).
2. the allgather and alltoall dispatchers (--moe-token-dispatcher-type) at every --eps value
   (world = ep = dp, tp 1): tokens/s and the time per step inside the dispatch collectives.
3. pp 2 x ep 2 (world 4) under DualPipeV (vp 2, --pp-micro-batches >= 4) with
   --overlap-moe-expert-parallel-comm off and on: step time, dispatch time and share, and the
   time the overlap hid (step off - step on; what stays exposed ~ dispatch off - hidden).
4. memory per rank at every --memory-eps value (world = ep = dp), plain and distributed optimizer:
   parameters + gradient buffers + optimizer state after one step, against the planner
   (``megalite.analysis.planner.memory_per_rank`` for the run's layout, device "cpu"). Also the
   saved activations (plan_check's ActivationMeter replayed over the schedule) against the
   planner's activation term minus its dispatch buffers (transients no saved-tensor hook sees).

Dispatch time is measured here only, by timing wrappers put around the collective entry points
``megalite.moe.dispatch`` calls (``all_to_all``, ``gather_from_sequence_parallel_region``,
``reduce_scatter_to_sequence_parallel_region``, ``all_gather_first``) and, for the allgather
path's backward, ``megalite.tensor_parallel.comms.all_gather_first`` / ``reduce_scatter_first``
on groups larger than one (tp is 1 in every run, so those are the expert-parallel group's). The
outermost call of each thread counts, so nothing is timed twice; the time includes waiting for the
other ranks to arrive (load skew), and under overlap it is summed over both threads.

    python benchmarks/bench_moe.py                  # hidden 256, 4 layers, seq 256, 8 experts: ~2 min on 2 cores
    python benchmarks/bench_moe.py --quick          # hidden 128, seq 128, ep 2 only: ~20 s
    python benchmarks/bench_moe.py --tables 2,3 --eps 2 4 --steps 8
    python benchmarks/bench_moe.py --gpu            # one GPU instead: bench_moe_gpu.py (MoE vs dense, grouped vs loop)

The ranks share this machine's cores: at ep 4 or pp 2 x ep 2 on 2 cores, 4 ranks take turns, so
read tokens/s there as relative, and overlap gains as what this host allows (they may be negative).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import common  # noqa: F401  (repository on sys.path)
import torch
import torch.distributed as dist

from megalite.analysis.moe_plan import dispatch_buffer_bytes
from megalite.analysis.plan_check import ActivationMeter, layout_of
from megalite.analysis.planner import memory_per_rank
from megalite.config import Config, ModelConfig, OptimConfig
from megalite.moe import dispatch
from megalite.tensor_parallel import comms
from megalite.training.mock import MockFeed
from megalite.training.trainer import Trainer

MiB = float(1 << 20)
QUICK = dict(hidden_size=128, seq_length=128, ffn_hidden_size=512, steps=3, eps=[2], memory_eps=[1, 2])


# -- dispatch timing ----------------------------------------------------------------------------------
class DispatchTimer:
    """Seconds spent inside the MoE dispatch collectives, all threads together (see the module doc)."""

    FORWARD = (
        "all_to_all",
        "gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
        "all_gather_first",
    )  # names in megalite.moe.dispatch
    BACKWARD = ("all_gather_first", "reduce_scatter_first")  # names in comms: the allgather path's backward

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self._lock, self._local = threading.Lock(), threading.local()
        self._saved: List[tuple] = []

    def install(self) -> "DispatchTimer":
        for mod, names in ((dispatch, self.FORWARD), (comms, self.BACKWARD)):
            for name in names:
                fn = getattr(mod, name)
                self._saved.append((mod, name, fn))
                setattr(mod, name, self._wrap(fn))
        return self

    def remove(self) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()

    def _wrap(self, fn):
        def timed(x, g, *rest):
            if g.size == 1 or getattr(self._local, "busy", False):  # trivial, or inside a timed call
                return fn(x, g, *rest)
            self._local.busy = True
            t0 = time.perf_counter()
            try:
                return fn(x, g, *rest)
            finally:
                dt = time.perf_counter() - t0
                self._local.busy = False
                with self._lock:
                    self.seconds += dt
                    self.calls += 1

        return timed


# -- configs ------------------------------------------------------------------------------------------
def model_config(a: argparse.Namespace, moe: bool) -> ModelConfig:
    """GPT-2 style, dropout 0 (DualPipeV's pairs need it); MoE: E experts of F / topk, top-k routing."""
    extra = (
        dict(
            num_experts=a.num_experts,
            moe_ffn_hidden_size=a.ffn_hidden_size // a.topk,
            moe_router_topk=a.topk,
            moe_aux_loss_coeff=a.aux_loss_coeff,
        )
        if moe
        else {}
    )
    return ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.heads,
        seq_length=a.seq_length,
        vocab_size=a.vocab_size,
        ffn_hidden_size=a.ffn_hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )


def run_config(a: argparse.Namespace, moe: bool, dp: int, m: int, dist_opt: bool = False, **parallel) -> Config:
    """``m`` micro-batches of --micro-batch-size per data-parallel rank; ``parallel``: ParallelConfig fields."""
    return common.mock_config(
        model_config(a, moe),
        a.micro_batch_size,
        a.micro_batch_size * m * dp,
        seed=1234,
        train_iters=10_000,
        optim=OptimConfig(lr=1e-4, clip_grad=1.0, use_distributed_optimizer=dist_opt),
        **parallel,
    )


# -- per-rank workers (module level: run_distributed forks them) -------------------------------------------
def _barrier(ps) -> None:
    if ps.world_size > 1:
        dist.barrier()


def _timed(ps, cfgs: Sequence[Config], warmup: int, steps: int) -> List[dict]:
    """Train every config on this rank grid, steps interleaved (A B, then B A, ...); per config this
    rank's step seconds, dispatch seconds and dispatch calls of each timed step, and its parameters."""
    torch.set_num_threads(1)
    timer = DispatchTimer().install()
    trainers = [Trainer(cfg, ps) for cfg in cfgs]
    feeds = [MockFeed(t, warmup + steps) for t in trainers]
    for _ in range(warmup):  # allocations, first-call costs
        for t, f in zip(trainers, feeds):
            t.train_step(f.next())
    out = [dict(step=[], dispatch=[], calls=[], paired=0) for _ in cfgs]
    for i in range(steps):
        order = range(len(cfgs)) if i % 2 == 0 else reversed(range(len(cfgs)))
        for k in order:
            _barrier(ps)
            d0, c0, t0 = timer.seconds, timer.calls, time.perf_counter()
            trainers[k].train_step(feeds[k].next())
            _barrier(ps)
            out[k]["step"].append(time.perf_counter() - t0)
            out[k]["dispatch"].append(timer.seconds - d0)
            out[k]["calls"].append(timer.calls - c0)
    timer.remove()
    for k, t in enumerate(trainers):
        out[k]["paired"] = sum(bool(e.get("paired")) for e in t.last_stats.events)  # F/B pairs side by side
        out[k]["params"] = sum(p.numel() for p in t.params)
        out[k]["expert_params"] = sum(p.numel() for p in t.params if getattr(p, "expert_parallel", False))
    return out


def _memory(ps, cfgs: Sequence[Config]) -> List[dict]:
    """Measured and planned bytes of this rank after one step of every config."""
    torch.set_num_threads(1)
    rows = []
    for cfg in cfgs:
        trainer = Trainer(cfg, ps)
        meter = ActivationMeter(trainer)
        trainer.train_step(MockFeed(trainer, 1).next())
        acts = meter.peak(trainer.actions)
        meter.remove()
        opt = trainer.optimizer
        got = dict(
            weights=sum(p.numel() * p.element_size() for p in trainer.params),
            grads=sum(b.grad_data.numel() * b.grad_data.element_size() for b in opt.grads.parts),
            optimizer=opt.state_bytes(),
            activations=acts,
        )
        layout = layout_of(cfg, trainer.settings)
        plan = memory_per_rank(cfg.model, layout, cfg.train.global_batch_size, "cpu")[ps.pp_rank]
        tokens = cfg.model.seq_length * cfg.train.micro_batch_size
        buffers = dispatch_buffer_bytes(cfg.model, tokens, layout.ep, layout.expert_tp, layout.moe_dispatcher, 4)
        est = dict(
            weights=plan.weights, grads=plan.grads, optimizer=plan.optimizer, activations=plan.activations - buffers
        )
        rows.append(dict(got=got, est=est, buffers=buffers, rank=ps.rank, edp=ps.edp_size))
        del trainer, meter
    return rows


# -- summaries --------------------------------------------------------------------------------------
def summarize(per_rank: List[List[dict]], k: int) -> Dict[str, float]:
    """Config ``k`` over the ranks: median over steps of the slowest rank's step; dispatch seconds
    and calls per step, the median step of each rank averaged over the ranks."""
    ranks = [r[k] for r in per_rank]
    steps = [max(r["step"][i] for r in ranks) for i in range(len(ranks[0]["step"]))]
    return dict(
        step=statistics.median(steps),
        dispatch=statistics.mean(statistics.median(r["dispatch"]) for r in ranks),
        calls=statistics.mean(statistics.median(r["calls"]) for r in ranks),
        paired=statistics.mean(r["paired"] for r in ranks),
        params=ranks[0]["params"],
        expert_params=ranks[0]["expert_params"],
    )


def _pct(x: float) -> str:
    return f"{x:6.1%}"


def table_dense_vs_moe(a: argparse.Namespace) -> None:
    m = a.micro_batches
    cfgs = [run_config(a, False, 1, m), run_config(a, True, 1, m)]
    res = common.run_distributed(_timed, 1, cfgs, a.warmup, a.steps, timeout=3600)
    tokens = a.micro_batch_size * m * a.seq_length
    print(
        f"\n[1] dense vs MoE of equal active parameters, one process (1 thread): {a.num_layers} layers, hidden "
        f"{a.hidden_size}, seq {a.seq_length}, {m} micro-batches of {a.micro_batch_size} = {tokens} tokens/step, "
        f"median of {a.steps} steps after {a.warmup} warm-up"
    )
    print(f"{'model':<34} {'params':>9} {'active':>9} {'step ms':>9} {'tokens/s':>9} {'vs dense':>9}")
    base = None
    for k, label in enumerate(
        [f"dense, ffn {a.ffn_hidden_size}", f"MoE {a.num_experts} x ffn {a.ffn_hidden_size // a.topk}, top-{a.topk}"]
    ):
        s = summarize(res, k)
        active = s["params"] - s["expert_params"] * (1 - a.topk / a.num_experts)
        rate = tokens / s["step"]
        base = base or rate
        print(
            f"{label:<34} {s['params'] / 1e6:8.2f}M {active / 1e6:8.2f}M {s['step'] * 1e3:9.0f} {rate:9.0f} "
            f"{rate / base:9.2f}"
        )


def table_dispatchers(a: argparse.Namespace) -> None:
    m = a.micro_batches
    print(
        f"\n[2] token dispatchers, world = ep = dp, tp 1 ({os.cpu_count()} cores shared by all ranks): "
        f"{m} micro-batches of {a.micro_batch_size} per rank, median of {a.steps} steps (slowest rank)"
    )
    print(
        f"{'ep':>3} {'dispatcher':>10} {'tokens/s':>9} {'step ms':>9} {'dispatch ms':>12} {'share':>6} "
        f"{'calls/step':>10}"
    )
    for ep in a.eps:
        kinds = ("allgather", "alltoall")
        cfgs = [run_config(a, True, ep, m, ep=ep, moe_token_dispatcher_type=d) for d in kinds]
        res = common.run_distributed(_timed, ep, cfgs, a.warmup, a.steps, ep=ep, timeout=3600)
        tokens = a.micro_batch_size * m * ep * a.seq_length
        for k, d in enumerate(kinds):
            s = summarize(res, k)
            print(
                f"{ep:>3} {d:>10} {tokens / s['step']:9.0f} {s['step'] * 1e3:9.0f} {s['dispatch'] * 1e3:12.1f} "
                f"{_pct(s['dispatch'] / s['step'])} {s['calls']:10.0f}"
            )


def table_overlap(a: argparse.Namespace) -> None:
    m = a.pp_micro_batches
    base = dict(pp=2, vp=2, ep=2, pipeline_schedule="dualpipev", moe_token_dispatcher_type=a.overlap_dispatcher)
    cfgs = [run_config(a, True, 2, m, overlap_moe_expert_parallel_comm=ov, **base) for ov in (False, True)]
    res = common.run_distributed(_timed, 4, cfgs, a.warmup, a.steps, pp=2, ep=2, timeout=3600)
    tokens = a.micro_batch_size * m * 2 * a.seq_length
    print(
        f"\n[3] dispatch overlap: pp 2 x ep 2 (dp 2, world 4 on {os.cpu_count()} cores), dualpipev vp 2, "
        f"{m} micro-batches of {a.micro_batch_size} per pipeline, {a.overlap_dispatcher}; median of {a.steps} steps"
    )
    print(f"{'overlap':>8} {'tokens/s':>9} {'step ms':>9} {'dispatch ms':>12} {'share':>6} {'pairs':>6}")
    s = [summarize(res, k) for k in range(2)]
    for ov, r in zip(("off", "on"), s):
        print(
            f"{ov:>8} {tokens / r['step']:9.0f} {r['step'] * 1e3:9.0f} {r['dispatch'] * 1e3:12.1f} "
            f"{_pct(r['dispatch'] / r['step'])} {r['paired']:6.0f}"
        )
    hidden = s[0]["step"] - s[1]["step"]
    print(
        f"hidden by overlap = step(off) - step(on) = {hidden * 1e3:.1f} ms/step "
        f"({hidden / s[0]['dispatch']:.0%} of the dispatch time without overlap); exposed dispatch with "
        f"overlap ~ dispatch(off) - hidden = {(s[0]['dispatch'] - hidden) * 1e3:.1f} ms/step"
        + ("  [negative hidden: overlap cost more than it hid on this host]" if hidden < 0 else "")
    )
    print(
        "(pairs: forward/backward pairs run side by side per rank per step; dispatch ms with overlap sums both "
        "threads, part of it running under the other micro-batch's compute)"
    )


def table_memory(a: argparse.Namespace) -> None:
    m = a.micro_batches
    print(
        "\n[4] memory per rank (MiB) after one step, world = ep = dp, fp32, allgather: measured vs planner "
        "(memory_per_rank, device cpu); static = weights + grads + optimizer"
    )
    print(
        f"{'ep':>3} {'optim':>7} {'edp':>3} {'weights':>15} {'grads':>15} {'optimizer':>15} {'static':>15} "
        f"{'err':>6} {'activations':>15} {'err':>6} {'acts by rank':>13}"
    )
    for ep in a.memory_eps:
        cfgs = [run_config(a, True, ep, m, dist_opt=d, ep=ep) for d in ((False, True) if ep > 1 else (False,))]
        res = common.run_distributed(_memory, ep, cfgs, ep=ep, timeout=3600)
        for k, cfg in enumerate(cfgs):
            # the rank that needs the most (static bytes agree; activations follow the routing)
            r = max((rank[k] for rank in res), key=lambda x: sum(x["got"].values()))
            acts = [rank[k]["got"]["activations"] / MiB for rank in res]
            got, est = r["got"], r["est"]
            cols = []
            for part in ("weights", "grads", "optimizer"):
                cols.append(f"{got[part] / MiB:7.2f}/{est[part] / MiB:<7.2f}")
            g_static = sum(got[p] for p in ("weights", "grads", "optimizer"))
            e_static = sum(est[p] for p in ("weights", "grads", "optimizer"))
            name = "zero1" if cfg.optim.use_distributed_optimizer else "adam"
            print(
                f"{ep:>3} {name:>7} {r['edp']:>3} {' '.join(cols)} {g_static / MiB:7.2f}/{e_static / MiB:<7.2f} "
                f"{_pct(e_static / g_static - 1)} {got['activations'] / MiB:7.2f}/{est['activations'] / MiB:<7.2f} "
                f"{_pct(est['activations'] / got['activations'] - 1)} {min(acts):6.2f}-{max(acts):<6.2f}"
            )
    print(
        "(measured/planned of the rank that holds the most; err = planned / measured - 1. Activations: saved "
        "tensors replayed over the schedule vs the planner's term without its dispatch buffers (transients no hook "
        "sees); the planner assumes balanced routing, the ranks' experts get uneven rows: their range is shown)"
    )


TABLES = {"1": table_dense_vs_moe, "2": table_dispatchers, "3": table_overlap, "4": table_memory}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--gpu" in argv:  # the one-GPU tables (MoE vs dense, grouped vs loop): bench_moe_gpu.py
        import bench_moe_gpu

        return bench_moe_gpu.main([x for x in argv if x != "--gpu"])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="run bench_moe_gpu.py's one-GPU tables instead")
    p.add_argument(
        "--tables",
        default="1,2,3,4",
        help="which tables, comma separated (1 dense/MoE, 2 dispatchers, 3 overlap, 4 memory)",
    )
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=1024, help="the dense MLP's F; experts get F / topk")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2, help="per data-parallel rank (tables 1, 2, 4)")
    p.add_argument("--pp-micro-batches", type=int, default=4, help="per pipeline in table 3 (dualpipev: >= 4)")
    p.add_argument("--overlap-dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    p.add_argument("--eps", type=int, nargs="+", default=[2, 4], help="expert-parallel sizes of table 2")
    p.add_argument("--memory-eps", type=int, nargs="+", default=[1, 2, 4], help="expert-parallel sizes of table 4")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration (the median is shown)")
    p.add_argument("--quick", action="store_true", help="hidden 128, seq 128, 3 steps, ep 2 (a smoke run)")
    a = p.parse_args(argv)
    if a.quick:  # quick's sizes, except where the command line set a value
        for key, value in QUICK.items():
            if getattr(a, key) == p.get_default(key):
                setattr(a, key, value)
    if a.num_experts % max(a.eps + a.memory_eps + [2]) or a.ffn_hidden_size % a.topk:
        p.error("--num-experts must divide by every ep and --ffn-hidden-size by --topk")
    print("$ python benchmarks/bench_moe.py " + " ".join(shlex.quote(x) for x in argv))
    print(
        f"({os.cpu_count()} cores; GPT-2 style, fp32, dropout 0, vocab {a.vocab_size}, {a.heads} heads, "
        f"{a.num_experts} experts, top-{a.topk}, aux-loss {a.aux_loss_coeff}, torch {torch.__version__})"
    )
    for key in a.tables.split(","):
        t0 = time.perf_counter()
        TABLES[key.strip()](a)
        print(f"(table {key.strip()}: {time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
