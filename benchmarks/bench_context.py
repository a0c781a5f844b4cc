"""Context parallelism on CPU: activation memory per rank, tokens/s per comm type, the longest sequence
that fits a memory budget, and how much of the ring's communication hides behind attention.

A tiny GPT (hidden 64, 2 layers, 4 heads, RoPE, batch 1, dropout 0) trains real steps through the
Trainer (mock data) on CP gloo ranks (dp 1, so the CP ranks share one sequence at a time).
Memory is what autograd keeps for the backward, counted through saved-tensor hooks (each storage
once, weights excluded; live bytes, peak over the step) -- the attention and layer activations the
issue asks about; the theory column is cp 1's figure / CP (all_gather keeps the whole sequence's K/V
on every rank: above it, less so with --num-query-groups). The ring's exposed communication is the
time its wait() calls took (ring.timing), against the ring's time and against the same transfers
timed alone: hidden = 1 - wait / alone (0% where ranks waiting for each other's compute -- skew on
shared cores -- make the waits longer than the transfers).

    python benchmarks/bench_context.py                       # 2k..16k, cp 1/2/4, every comm type
    python benchmarks/bench_context.py --quick               # 1k and 2k tokens, cp 1/2: ~1 min
    python benchmarks/bench_context.py --seq-lengths 2048 4096 --cps 1 2 --comm-types p2p

The ranks share this machine's cores (tokens/s at cp 4 on 2 cores is not a speed-up measurement).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List

import common  # noqa: F401  (repository on sys.path)
import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.context_parallel import ring
from megalite.training.mock import MockFeed
from megalite.training.trainer import Trainer

MiB = float(1 << 20)


class SavedBytes:
    """Live bytes of the storages autograd saved for the backward (each storage once); the peak."""

    def __init__(self, exclude: List[torch.Tensor]):
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.live: Dict[int, list] = {}
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude or ptr == 0:
            return t
        entry = self.live.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Held(t, self, ptr)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]


class _Held:
    __slots__ = ("t", "owner", "ptr")

    def __init__(self, t, owner, ptr):
        self.t, self.owner, self.ptr = t, owner, ptr

    def __del__(self):
        self.owner.release(self.ptr)


def _barrier(ps) -> None:
    if ps.cp.size > 1:
        dist.barrier(group=ps.cp.group)


def _exchange_seconds(ps, shape, reps: int = 5) -> float:
    """One ring hop of a K/V-sized fp32 block, timed without compute (the fastest of ``reps``)."""
    send, recv = torch.randn(shape), torch.empty(shape)
    best = float("inf")
    for _ in range(reps):
        _barrier(ps)
        t0 = time.perf_counter()
        ring.exchange(ps.cp, send, recv, 0).wait()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(ps, comm: str, seqs: List[int], a: argparse.Namespace) -> List[dict]:
    cp = ps.cp.size
    rows = []
    for s in seqs:
        model = ModelConfig(
            num_layers=a.num_layers,
            hidden_size=a.hidden_size,
            num_attention_heads=a.heads,
            num_query_groups=a.num_query_groups,
            seq_length=s,
            max_position_embeddings=s,
            vocab_size=a.vocab_size,
            position_embedding_type="rope",
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        cfg = common.mock_config(model, 1, 1, seed=1, train_iters=a.steps + 1, cp=cp, cp_comm_type=comm)
        trainer = Trainer(cfg, ps)
        feed = MockFeed(trainer, a.steps + 1)
        trainer.train_step(feed.next())  # warm-up (allocations, first-call costs)
        saved = SavedBytes(trainer.params)
        timing = ring.timing = ring.RingTiming()
        steps = []  # (seconds, ring seconds, ring wait seconds) of each step
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            for _ in range(a.steps):
                before = (timing.total_s, timing.wait_s)
                _barrier(ps)
                t0 = time.perf_counter()
                trainer.train_step(feed.next())
                _barrier(ps)
                steps.append((time.perf_counter() - t0, timing.total_s - before[0], timing.wait_s - before[1]))
        ring.timing = None
        step_s, ring_s, wait_s = sorted(steps)[len(steps) // 2]  # the median step
        row = dict(s=s, cp=cp, comm=comm, peak=saved.peak, step_s=step_s, wait_s=wait_s, ring_s=ring_s, alone_s=0.0)
        if comm == "p2p" and cp > 1:
            hop = _exchange_seconds(ps, (2, 1, a.num_query_groups or a.heads, s // cp, a.hidden_size // a.heads))
            row["alone_s"] = hop * a.num_layers * (3 * cp - 2)  # forward CP-1 hops, backward CP-1 K/V + CP dK/dV
        rows.append(row)
        del trainer, feed
    return rows


def _fit_longest(rows: List[dict], budget: float, cp: int) -> int:
    """The longest sequence (a multiple of 256 x CP) whose peak fits ``budget``, from a least-squares
    line through the measured (s, peak) points."""
    xs = torch.tensor([float(r["s"]) for r in rows])
    ys = torch.tensor([float(r["peak"]) for r in rows])
    slope = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
    icpt = float(ys.mean()) - slope * float(xs.mean())
    step = 256 * cp
    return int((budget - icpt) / slope) // step * step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--comm-types", nargs="+", default=["p2p", "all_gather", "a2a"])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention (default: heads)")
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (the median is shown)")
    p.add_argument("--budget-mib", type=float, default=256.0, help="memory budget per rank for the longest sequence")
    p.add_argument("--quick", action="store_true", help="1k and 2k tokens at cp 1 and 2 (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.seq_lengths, a.cps = [1024, 2048], [1, 2]
    rows: List[dict] = []
    for cp in a.cps:
        for comm in ["p2p"] if cp == 1 else a.comm_types:
            per_rank = common.run_distributed(_measure, cp, comm, a.seq_lengths, a, cp=cp, timeout=3600)
            for i, row in enumerate(per_rank[0]):  # the peak is the largest rank's; times agree (collectives)
                row["peak"] = max(r[i]["peak"] for r in per_rank)
                rows.append(row)
    base = {r["s"]: r["peak"] for r in rows if r["cp"] == 1}
    print(
        f"context parallelism on CPU ({os.cpu_count()} cores shared by all ranks): hidden {a.hidden_size}, "
        f"{a.num_layers} layers, {a.heads} heads ({a.num_query_groups or a.heads} K/V groups), RoPE, batch 1, fp32; memory = bytes saved for the backward "
        f"per rank (peak)"
    )
    print(
        f"{'seq':>6} {'cp':>3} {'comm':>10} {'MiB/rank':>9} {'cp1/CP':>8} {'ratio':>6} {'tokens/s':>9} "
        f"{'ring s':>7} {'wait s':>7} {'alone s':>8} {'wait/ring':>9} {'hidden':>7}"
    )
    for r in rows:
        theory = base[r["s"]] / r["cp"] if r["s"] in base else float("nan")
        ring_cols = f"{'':>7} {'':>7} {'':>8} {'':>9} {'':>7}"
        if r["alone_s"]:
            ring_cols = (
                f"{r['ring_s']:7.2f} {r['wait_s']:7.3f} {r['alone_s']:8.3f} {r['wait_s'] / r['ring_s']:9.1%} "
                f"{max(0.0, 1 - r['wait_s'] / r['alone_s']):7.0%}"
            )
        comm = r["comm"] if r["cp"] > 1 else "(none)"
        print(
            f"{r['s']:>6} {r['cp']:>3} {comm:>10} {r['peak'] / MiB:9.1f} {theory / MiB:8.1f} "
            f"{r['peak'] / theory:6.2f} {r['s'] / r['step_s']:9.0f} {ring_cols}"
        )
    print(
        f"\nlongest sequence within {a.budget_mib:.0f} MiB of saved activations per rank (line through the "
        f"measured points):"
    )
    for cp, comm in dict.fromkeys((r["cp"], r["comm"]) for r in rows):
        pts = [r for r in rows if (r["cp"], r["comm"]) == (cp, comm)]
        if len(pts) >= 2:
            label = comm if cp > 1 else "(none)"
            print(f"  cp {cp} {label:>10}: {_fit_longest(pts, a.budget_mib * MiB, cp):>8} tokens")


if __name__ == "__main__":
    main()
