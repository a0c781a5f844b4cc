#!/usr/bin/env python
"""Memory of recomputation, sequence parallelism and the distributed optimizer, against theory.

Activations are counted as the bytes autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``; each storage once), in bf16, with
dropout 0.1 and the unfused attention path (the layer Korthikanti et al. 2022
account for: QK^T, softmax, dropout, x V). Per transformer layer they compare with

    no recompute, tp t:        sbh (10 + 24/t + 5as/(ht))      bytes
    + sequence parallel:       sbh/t (34 + 5as/h)
    selective recompute:       the 5as/h term removed
    full recompute:            2sbh (2sbh/t with SP): the layer's input only

Then the same per micro-batch, summed over the micro-batches a 1F1B pipeline
keeps in flight on each rank (measured forward by forward, replayed in the
schedule's order; theory adds the embedding dropout mask sbh on the first stage
and 4sbh + 4sbV for the final norm, output layer and fp32 softmax on the last), and the optimizer's bytes per rank (fp32 main weights + Adam
moments: 12 bytes per parameter, divided by dp with --use-distributed-optimizer).
A table times a training step of each option on CPU against the plain run.

The data-parallel sharding strategies (--data-parallel-sharding-strategy, issue 31): per-rank bytes of
weights + gradients + optimizer state kept between steps, measured on a real Trainer after a step
(FSDP's parameters and gradients by their local shards) beside the planner's figure
(analysis/planner.py: 18 bytes a parameter in bf16 for no_shard, 6 + 12/dp for optim, 16/dp for
optim_grads and optim_grads_params, whose fp32 shard is its own main weight), at dp 1, 2 and 4; then
the step time of each strategy against the distributed optimizer at dp 2 and 4.

  python benchmarks/bench_memory.py            # all tables, ~4 minutes on 2 cores
  python benchmarks/bench_memory.py --quick    # smaller model, fewer steps
  python benchmarks/bench_memory.py --tables sharding,sharding_time   # only the strategies
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Dict, List

import torch
from common import mock_config, run_distributed  # first: puts the repository on sys.path

from megalite.analysis.plan_check import (  # also what a run's predicted-vs-measured block counts
    SavedBytes,
    layout_of,
    resident_state_bytes,
)
from megalite.analysis.planner import memory_per_rank
from megalite.config import Config, ModelConfig, OptimConfig
from megalite.config.sections import SHARDING_STRATEGIES
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel.state import ParallelState
from megalite.pipeline.actions import Compute
from megalite.pipeline.registry import build_schedule
from megalite.training import Trainer
from megalite.training.mock import MockFeed

RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def make_config(a, tp=1, pp=1, dp=1, sp=False, dtype="bfloat16", backend="unfused", m=1, **model) -> Config:
    mdl = ModelConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        seq_length=a.seq,
        vocab_size=4096,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        params_dtype=dtype,
        attention_backend=backend,
        **model,
    )
    return mock_config(
        mdl,
        a.mbs,
        a.mbs * m * dp,
        seed=1,
        train_iters=10,
        optim=OptimConfig(accumulate_allreduce_grads_in_fp32=True),
        tp=tp,
        pp=pp,
        sequence_parallel=sp,
    )


def theory_per_layer(a, t: int, sp: bool, recompute: str) -> float:
    s, b, h, heads = a.seq, a.mbs, a.hidden, a.heads
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn = 5 * heads * s / h if recompute == "none" else 0.0
    if sp:
        return s * b * h / t * (34 + attn)
    return s * b * h * (10 + 24 / t + attn / t)


def _layer_bytes(ps: ParallelState, a, sp: bool, recompute: str, backend: str) -> Dict[str, float]:
    """Saved bytes per layer (decoder layers of one micro-batch forward / number of layers)."""
    cfg = make_config(a, tp=ps.tp_size, sp=sp, backend=backend, **RECOMPUTE[recompute])
    trainer = Trainer(cfg, ps)
    chunk = trainer.chunks[0]
    chunk.train()
    tokens = torch.from_numpy(MockGPTDataset(a.seq, 4096, 1, a.mbs)[0]["text"][:-1]).repeat(a.mbs, 1)
    run_layers, counter = chunk._run_layers, SavedBytes(trainer.params)

    def counted(x, rope):
        with counter:
            return run_layers(x, rope)

    chunk._run_layers = counted
    out = chunk(tokens)
    chunk.loss(out, tokens, torch.ones_like(tokens, dtype=torch.float32)).backward()
    return {"per_layer": counter.total / a.layers}


def table_per_layer(a) -> None:
    print(f"\n## Saved activations per layer (bf16, s={a.seq} b={a.mbs} h={a.hidden} a={a.heads}, dropout 0.1)")
    print("| attention | tp | SP | recompute | measured KiB | theory KiB | measured / theory |")
    print("|---|---|---|---|---|---|---|")
    rows = [("unfused", 1, False, r) for r in RECOMPUTE] + [("sdpa", 1, False, "none")]
    for tp in (2, 4):
        rows += [("unfused", tp, sp, r) for sp in (False, True) for r in ("none", "selective")]
    for backend, tp, sp, rec in rows:
        if tp == 1:
            got = _layer_bytes(ParallelState.single(), a, sp, rec, "auto" if backend == "sdpa" else backend)
        else:
            got = run_distributed(_layer_bytes, tp, a, sp, rec, backend, tp=tp)[0]
        theory = theory_per_layer(a, tp, sp, rec)
        print(
            f"| {backend} | {tp} | {'on' if sp else 'off'} | {rec} | {got['per_layer'] / 1024:.0f} | "
            f"{theory / 1024:.0f} | {got['per_layer'] / theory:.3f} |"
        )


def _in_flight(ps: ParallelState, a, recompute: str, m: int) -> Dict[str, float]:
    """Peak saved bytes over a 1F1B step: each forward's bytes, held until its backward."""
    cfg = make_config(a, pp=ps.pp_size, m=m, **RECOMPUTE[recompute])
    trainer = Trainer(cfg, ps)
    sizes: List[int] = []
    for chunk in trainer.chunks:
        forward, loss = chunk.forward, chunk.loss

        def counted_forward(x, forward=forward):
            with SavedBytes(trainer.params) as c:
                out = forward(x)
            sizes.append(c.total)
            return out

        def counted_loss(*args, loss=loss):
            with SavedBytes(trainer.params) as c:
                out = loss(*args)
            sizes[-1] += c.total
            return out

        chunk.forward, chunk.loss = counted_forward, counted_loss
    trainer.train_step(MockFeed(trainer, 1).next())
    actions = [x for x in build_schedule("1f1b", ps.pp_size, 1, m)[ps.pp_rank] if isinstance(x, Compute)]
    live, peak, held, it = 0, 0, {}, iter(sizes)
    for act in actions:
        if act.kind == "F":
            held[act.mb] = next(it)
            live += held[act.mb]
            peak = max(peak, live)
        else:
            live -= held.pop(act.mb)
    return {"peak": peak, "per_mb": statistics.mean(sizes), "rank": ps.pp_rank}


def table_in_flight(a, pp: int = 4, m: int = 8) -> None:
    print(f"\n## Saved activations in flight, 1F1B pp={pp} m={m} ({a.layers // pp} layers per stage), per rank, MiB")
    print("| recompute | rank | micro-batches in flight | measured peak | theory | measured / theory |")
    print("|---|---|---|---|---|---|")
    sbh, vocab = a.seq * a.mbs * a.hidden, 4096
    for rec in RECOMPUTE:
        res = run_distributed(_in_flight, pp, a, rec, m, pp=pp)
        for r in res:
            n = min(pp - r["rank"], m)
            per_mb = (a.layers // pp) * theory_per_layer(a, 1, False, rec)
            if r["rank"] == 0:  # embedding dropout mask
                per_mb += sbh
            if r["rank"] == pp - 1:  # final norm input, output layer input (bf16), fp32 softmax of the loss
                per_mb += 4 * sbh + 4 * a.seq * a.mbs * vocab
            theory = n * per_mb
            print(
                f"| {rec} | {r['rank']} | {n} | {r['peak'] / 2**20:.2f} | {theory / 2**20:.2f} | "
                f"{r['peak'] / theory:.3f} |"
            )


def _optimizer_bytes(ps: ParallelState, a, dist_opt: bool) -> Dict[str, float]:
    cfg = make_config(a, dp=ps.dp_size)
    cfg = cfg.with_(optim=replace(cfg.optim, use_distributed_optimizer=dist_opt))
    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())  # Adam state exists after a step
    n = sum(p.numel() for p in trainer.params)
    return {
        "state": trainer.optimizer.state_bytes(),
        "params": n,
        "grad_buffer": sum(part.grad_data.numel() * 4 for part in trainer.optimizer.grads.parts),
    }


def table_optimizer(a) -> None:
    print("\n## Optimizer state per rank (bf16 weights, fp32 grads, fp32 main weights + Adam moments)")
    print(
        "| dp | distributed optimizer | parameters | weights MiB | grad buffer MiB | optimizer state MiB | "
        "theory 12 x params / dp MiB | measured / theory |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dp in (1, 2, 4):
        r = (
            _optimizer_bytes(ParallelState.single(), a, False)
            if dp == 1
            else run_distributed(_optimizer_bytes, dp, a, True)[0]
        )
        theory = 12 * r["params"] / dp
        print(
            f"| {dp} | {'yes' if dp > 1 else 'no'} | {r['params']:,} | {2 * r['params'] / 2**20:.2f} | "
            f"{r['grad_buffer'] / 2**20:.2f} | {r['state'] / 2**20:.2f} | {theory / 2**20:.2f} | "
            f"{r['state'] / theory:.3f} |"
        )


def _step_times(ps: ParallelState, a, variants: Dict[str, dict], steps: int) -> Dict[str, float]:
    torch.set_num_threads(1)
    out = {}
    for name, v in variants.items():
        cfg = make_config(
            a,
            tp=ps.tp_size,
            dp=ps.dp_size,
            m=2,
            sp=v.get("sp", False),
            dtype=v.get("dtype", "float32"),
            backend=v.get("backend", "auto"),
            **{k: x for k, x in v.items() if k.startswith("recompute")},
        )
        cfg = cfg.with_(optim=replace(cfg.optim, use_distributed_optimizer=v.get("dist_opt", False)))
        trainer = Trainer(cfg, ps)
        feed = MockFeed(trainer, steps + 1)
        batches = [feed.next() for _ in range(steps + 1)]
        trainer.train_step(batches[0])
        times = []
        for b in batches[1:]:
            ps.barrier()
            t0 = time.perf_counter()
            trainer.train_step(b)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def table_step_time(a) -> None:
    print(f"\n## Step time on CPU (fp32 unless noted, 1 thread per rank, median of {a.steps} steps, ms)")
    print("| layout | option | ms per step | vs plain |")
    print("|---|---|---|---|")
    one = {
        "plain": {},
        "selective recompute": RECOMPUTE["selective"],
        "full recompute": RECOMPUTE["full"],
        "unfused attention": {"backend": "unfused"},
        "bf16": {"dtype": "bfloat16"},
    }
    groups = [
        ("1 process", 1, {}, one),
        ("tp=2", 2, dict(tp=2), {"plain": {}, "sequence parallel": {"sp": True}}),
        ("dp=2", 2, {}, {"plain": {}, "distributed optimizer": {"dist_opt": True}}),
    ]
    for layout, world, kw, variants in groups:
        if world == 1:
            res = _step_times(ParallelState.single(), a, variants, a.steps)
        else:
            res = run_distributed(_step_times, world, a, variants, a.steps, **kw)[0]
        for name, ms in res.items():
            print(f"| {layout} | {name} | {ms:.1f} | {ms / res['plain']:.2f} |")


def sharded_config(a, dp: int, strategy: str, reshard: bool = True, dtype: str = "bfloat16") -> Config:
    """The benchmark's model at ``dp`` under one --data-parallel-sharding-strategy."""
    cfg = make_config(a, dp=dp, m=2, dtype=dtype)
    optim = replace(
        cfg.optim,
        data_parallel_sharding_strategy=strategy,
        use_distributed_optimizer=strategy == "optim",
        reshard_after_forward=reshard,
    )
    return cfg.with_(optim=optim)


def _sharded_bytes(ps: ParallelState, a, strategy: str) -> Dict[str, float]:
    """This rank's resident weights, gradients and optimizer state after one step, and the planner's."""
    cfg = sharded_config(a, ps.dp_size, strategy)
    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())  # gradients and Adam state exist after a step
    weights, grads, optimizer = resident_state_bytes(trainer)
    layout = layout_of(cfg, trainer.settings)
    plan = memory_per_rank(cfg.model, layout, cfg.train.global_batch_size, "cpu")[ps.pp_rank]
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "measured": weights + grads + optimizer,
        "planner": plan.state,
        "gathered": plan.gathered,
    }


def _sharded_bytes_each(ps: ParallelState, a) -> Dict[str, Dict[str, float]]:
    return {strategy: _sharded_bytes(ps, a, strategy) for strategy in SHARDING_STRATEGIES}


def sharding_rows(a, dps=(1, 2, 4)) -> List[Dict[str, float]]:
    """One row per (dp, strategy): the most loaded rank's measured bytes beside the planner's."""
    rows = []
    for dp in dps:
        if dp == 1:
            res = [_sharded_bytes_each(ParallelState.single(), a)]
        else:
            res = run_distributed(_sharded_bytes_each, dp, a)
        for strategy in SHARDING_STRATEGIES:
            top = max((r[strategy] for r in res), key=lambda r: r["measured"])
            rows.append({"dp": dp, "strategy": strategy, **top})
    return rows


def table_sharding(a) -> List[Dict[str, float]]:
    mib = 2**20
    print("\n## Data-parallel sharding: weights + gradients + optimizer state per rank (bf16, MiB, after a step)")
    print(
        "| dp | strategy | weights | gradients | optimizer | measured total | planner | measured / planner | "
        "vs no_shard | planner's transient gathered |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = sharding_rows(a)
    plain = {r["dp"]: r["measured"] for r in rows if r["strategy"] == "no_shard"}
    for r in rows:
        print(
            f"| {r['dp']} | {r['strategy']} | {r['weights'] / mib:.2f} | {r['grads'] / mib:.2f} | "
            f"{r['optimizer'] / mib:.2f} | {r['measured'] / mib:.2f} | {r['planner'] / mib:.2f} | "
            f"{r['measured'] / r['planner']:.3f} | {r['measured'] / plain[r['dp']]:.3f} | {r['gathered'] / mib:.2f} |"
        )
    return rows


STRATEGY_RUNS = {  # name: (strategy, reshard after forward)
    "optim (distributed optimizer)": ("optim", True),
    "no_shard": ("no_shard", True),
    "optim_grads": ("optim_grads", True),
    "optim_grads_params": ("optim_grads_params", True),
    "optim_grads_params, no reshard": ("optim_grads_params", False),
}


def _strategy_times(ps: ParallelState, a, steps: int) -> Dict[str, float]:
    """Median ms of a 2-micro-batch fp32 step under each strategy (one thread per rank)."""
    torch.set_num_threads(1)
    out = {}
    for name, (strategy, reshard) in STRATEGY_RUNS.items():
        trainer = Trainer(sharded_config(a, ps.dp_size, strategy, reshard, dtype="float32"), ps)
        feed = MockFeed(trainer, steps + 1)
        batches = [feed.next() for _ in range(steps + 1)]
        trainer.train_step(batches[0])
        times = []
        for b in batches[1:]:
            ps.barrier()
            t0 = time.perf_counter()
            trainer.train_step(b)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def table_sharding_time(a) -> Dict[int, Dict[str, float]]:
    print(f"\n## Step time of each strategy on CPU (fp32, 2 micro-batches, 1 thread per rank, median of {a.steps}, ms)")
    print("| dp | strategy | ms per step | vs optim |")
    print("|---|---|---|---|")
    out = {}
    for dp in (2, 4):
        res = run_distributed(_strategy_times, dp, a, a.steps)[0]
        base = res["optim (distributed optimizer)"]
        for name, ms in res.items():
            print(f"| {dp} | {name} | {ms:.1f} | {ms / base:.2f} |")
        out[dp] = res
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tables", default="layer,flight,optimizer,time,sharding,sharding_time")
    p.add_argument("--steps", type=int, help="timed steps per variant (default 5, --quick 3)")
    a = p.parse_args(argv)
    a.layers, a.hidden, a.heads, a.seq, a.mbs, a.steps = (
        (4, 128, 4, 128, 2, a.steps or 3) if a.quick else (8, 256, 8, 256, 2, a.steps or 5)
    )
    print(
        f"model: GPT-2 style, {a.layers} layers, hidden {a.hidden}, heads {a.heads}, seq {a.seq}, "
        f"micro-batch {a.mbs}, vocab 4096; torch {torch.__version__}"
    )
    tables = a.tables.split(",")
    for name, table in (
        ("layer", table_per_layer),
        ("flight", table_in_flight),
        ("optimizer", table_optimizer),
        ("time", table_step_time),
        ("sharding", table_sharding),
        ("sharding_time", table_sharding_time),
    ):
        if name in tables:
            table(a)
    return 0


if __name__ == "__main__":
    main()
