#!/usr/bin/env python
"""Checkpoint save/load time and size, both formats, against one torch.save / torch.load.

A GPT-2 style model of about 110 M parameters (12 layers, hidden 768, vocab 32000,
fp32, AdamW state after one step) is saved and loaded:

* in one process: the sharded (layout-free) and torch (Megatron legacy) formats, and a
  single ``torch.save`` of the same state (model state dict + Adam moments) / ``torch.load``;
* on 4 gloo processes at tp=2 x pp=2: per-rank and total time and bytes for both formats;
* the layout change: the one-process sharded checkpoint loaded at tp=2 x pp=2, next to
  loading the tp=2 x pp=2 checkpoint into its own layout.

Times are wall seconds (slowest rank for the 4-process rows), on this machine's disk.

  python benchmarks/bench_checkpoint.py            # ~3 minutes on 2 cores, ~3 GB of disk in a temp dir
  python benchmarks/bench_checkpoint.py --quick    # 4 layers, hidden 256
  python benchmarks/bench_checkpoint.py --only-save [--quick]   # only the save rows below

Save rows: the time a save blocks training with --async-save against a synchronous save (both
formats), and at dp 1/2/4 with --use-distributed-optimizer (tp 1, pp 1) the save time, the peak
extra resident memory per rank (sampled every 2 ms) and the bytes each rank writes: the sharded
format's owners write their own shards, the torch format gathers over DP to rank 0.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import tempfile
import threading
import time
from typing import Dict

import torch
from common import mock_config, run_distributed  # first: puts the repository on sys.path

from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.checkpointing.run import RunParts
from megalite.config import CheckpointConfig, Config, ModelConfig, OptimConfig
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed


def make_config(a, tp=1, pp=1) -> Config:
    m = ModelConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=12 if a.hidden % 12 == 0 else 8,
        seq_length=64,
        vocab_size=a.vocab,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return mock_config(m, mbs=1, gbs=pp, seed=1, train_iters=10, tp=tp, pp=pp)


def trained(a, ps: ParallelState) -> Trainer:
    cfg = make_config(a, ps.tp_size, ps.pp_size)
    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())  # Adam state exists
    trainer.state.iteration = 1
    return trainer


def parts(t: Trainer) -> "RunParts":
    """The run objects save_checkpoint and load_checkpoint take (one bundle)."""
    return t.run_parts


def dir_bytes(path: str, rank_tag: str = None) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if rank_tag is None or rank_tag in f or rank_tag in root:
                total += os.path.getsize(os.path.join(root, f))
    return total


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_process(a, tmp: str) -> Dict[str, Dict[str, float]]:
    ps = ParallelState.single()
    trainer = trained(a, ps)
    n = sum(p.numel() for p in trainer.params)
    rows = {}
    for fmt in ("sharded", "torch"):
        root = os.path.join(tmp, f"one_{fmt}")
        save = timed(lambda: save_checkpoint(parts(trainer), root, fmt))
        fresh = Trainer(trainer.cfg, ps)
        load = timed(lambda: load_checkpoint(parts(fresh), root))
        rows[fmt] = {"save": save, "load": load, "bytes": dir_bytes(root)}
    state = {
        "model": trainer.chunks[0].state_dict(),
        "optimizer": {
            name: {k: v for k, v in trainer.optimizer.optimizer.state[p].items()}
            for name, p in trainer.chunks[0].named_parameters()
        },
    }
    path = os.path.join(tmp, "plain.pt")
    save = timed(lambda: torch.save(state, path))
    load = timed(lambda: torch.load(path, weights_only=True))
    rows["torch.save / torch.load"] = {"save": save, "load": load, "bytes": os.path.getsize(path)}
    rows["_params"] = {"n": n}
    return rows


def _four(ps: ParallelState, a, tmp: str) -> Dict[str, float]:
    trainer = trained(a, ps)
    out = {}
    for fmt in ("sharded", "torch"):
        root = os.path.join(tmp, f"four_{fmt}")
        ps.barrier()
        out[f"{fmt}_save"] = timed(lambda: save_checkpoint(parts(trainer), root, fmt))
        fresh = Trainer(trainer.cfg, ps)
        ps.barrier()
        out[f"{fmt}_load"] = timed(lambda: load_checkpoint(parts(fresh), root))
    fresh = Trainer(trainer.cfg, ps)
    ps.barrier()
    out["reshard_load"] = timed(lambda: load_checkpoint(parts(fresh), os.path.join(tmp, "one_sharded")))
    out["rank"] = ps.rank
    return out


# -- save rows: how long a save blocks training, and the distributed optimizer's owner-written shards ----
class PeakRSS:
    """Peak resident memory of this process above its level on entry, sampled every 2 ms by a thread."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.PAGE

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _trim() -> None:
    """Give freed heap back to the system, so the next peak is not hidden by the allocator's reuse."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _save_once(trainer: Trainer, root: str, fmt: str, background: bool, repeats: int = 3) -> Dict[str, float]:
    """Saves through the run's Checkpointer, best of ``repeats`` (this machine is shared): wall seconds a
    save blocks training, main-thread CPU seconds it blocks, seconds until published; the largest peak
    extra bytes."""
    trainer.checkpointer.cfg = trainer.cfg.with_(
        checkpoint=CheckpointConfig(save=root, ckpt_format=fmt, async_save=background)
    )
    best: Dict[str, float] = {}
    for _ in range(repeats):
        trainer.ps.barrier()
        _trim()
        with PeakRSS() as mem:
            cpu = time.thread_time()
            block = timed(trainer.checkpointer.save)
            cpu = time.thread_time() - cpu
            total = block + timed(trainer.checkpointer.wait)
        for k, v in {"block": block, "cpu": cpu, "total": total}.items():
            best[k] = min(best.get(k, v), v)
        best["extra"] = max(best.get("extra", 0), mem.extra)  # the worst: the async buffers' first allocation
    return best


def _save_rows(ps: ParallelState, a, tmp: str) -> Dict[str, object]:
    """Sync and async saves of both formats at this world's dp (tp 1, pp 1, --use-distributed-optimizer)."""
    m = make_config(a).model
    cfg = mock_config(
        m, mbs=1, gbs=ps.dp_size, seed=1, train_iters=10, optim=OptimConfig(use_distributed_optimizer=True)
    )
    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())  # Adam state exists
    trainer.state.iteration = 1
    out: Dict[str, object] = {"rank": ps.rank}
    for fmt in ("sharded", "torch"):
        for background in (False, True):
            root = os.path.join(tmp, f"dp{ps.dp_size}_{fmt}_{'async' if background else 'sync'}")
            out[(fmt, background)] = _save_once(trainer, root, fmt, background)
    return out


def save_tables(a, tmp: str) -> None:
    """The save rows: blocking time async vs sync, then save time and peak memory per rank at dp 1/2/4.

    Every time is the best of three saves, every memory figure the worst; the async snapshot's host buffers are allocated by the
    first and reused after (its peak extra memory is that first allocation, the rank's share)."""
    by_dp = {}
    for dp in (1, 2, 4):
        by_dp[dp] = (
            run_distributed(_save_rows, dp, a, tmp, timeout=3600)
            if dp > 1
            else [_save_rows(ParallelState.single(), a, tmp)]
        )
    print("\n## Time a save blocks training (--async-save vs synchronous; slowest rank)")
    print(
        "| dp | format | sync save s | async: blocks s | blocks / sync | async: main-thread CPU s | "
        "async: until published s |"
    )
    print("|---|---|---|---|---|---|---|")
    for dp, res in by_dp.items():
        for fmt in ("sharded", "torch"):
            sync = max(r[(fmt, False)]["block"] for r in res)
            blk = max(r[(fmt, True)]["block"] for r in res)
            cpu = max(r[(fmt, True)]["cpu"] for r in res)
            pub = max(r[(fmt, True)]["total"] for r in res)
            print(f"| {dp} | {fmt} | {sync:.2f} | {blk:.3f} | {100 * blk / sync:.0f}% | {cpu:.3f} | {pub:.2f} |")
    print("\n## Synchronous save per rank with --use-distributed-optimizer (tp 1, pp 1)")
    print(
        "| dp | format | save s (slowest rank) | peak extra memory per rank MB (max) | "
        "async snapshot: peak extra MB per rank (max) | bytes written per rank MB (max) |"
    )
    print("|---|---|---|---|---|---|")
    for dp, res in by_dp.items():
        for fmt in ("sharded", "torch"):
            root = os.path.join(tmp, f"dp{dp}_{fmt}_sync")
            tags = [f"__{r['rank']}_" for r in res] if fmt == "sharded" else ["mp_rank_00"]
            written = max(dir_bytes(root, tag) for tag in tags)
            print(
                f"| {dp} | {fmt}{' (DP gather to rank 0)' if fmt == 'torch' else ' (owner-written)'} | "
                f"{max(r[(fmt, False)]['block'] for r in res):.2f} | "
                f"{max(r[(fmt, False)]['extra'] for r in res) / 1e6:.0f} | "
                f"{max(r[(fmt, True)]['extra'] for r in res) / 1e6:.0f} | {written / 1e6:.0f} |"
            )


def load_table(a, tmp: str, repeats: int = 3) -> None:
    """Load rows: the one-process checkpoints of :func:`one_process` loaded again (the median of ``repeats``
    loads into a fresh run), next to one ``torch.load`` of the same tensors from one file."""
    ps = ParallelState.single()
    cfg = make_config(a)
    plain = os.path.join(tmp, "plain.pt")
    times: Dict[str, float] = {}
    dirs = {
        "sharded": os.path.join(tmp, "one_sharded"),
        "torch format": os.path.join(tmp, "one_torch"),
        "torch.load of the same tensors (one file)": None,
    }
    for name, root in dirs.items():
        runs = []
        for _ in range(repeats):
            fresh = None
            gc.collect()  # a Trainer holds reference cycles: free the previous one before the next
            fresh = Trainer(cfg, ps) if root else None
            runs.append(
                timed(
                    lambda: (
                        load_checkpoint(parts(fresh), root)
                        if fresh is not None
                        else torch.load(plain, weights_only=True)
                    )
                )
            )
        times[name] = sorted(runs)[len(runs) // 2]
    base = times["torch.load of the same tensors (one file)"]
    print(
        f"\n## Load, one process (median of {repeats}; checksums verified; target: sharded <= 2x torch.load "
        f"and <= torch format)"
    )
    print("| load | s | x torch.load | MB/s |")
    print("|---|---|---|---|")
    sizes = {n: dir_bytes(d) if d else os.path.getsize(plain) for n, d in dirs.items()}
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {t / base:.2f} | {sizes[name] / 1e6 / t:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only-save", action="store_true", help="only the save rows (async vs sync, dp 1/2/4)")
    a = p.parse_args()
    a.layers, a.hidden, a.vocab = (4, 256, 8000) if a.quick else (12, 768, 32000)
    tmp = tempfile.mkdtemp(prefix="megalite_ckpt_bench_")
    try:
        if a.only_save:
            print(f"model: GPT-2 style, {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, fp32 + AdamW state")
            return save_tables(a, tmp)
        one = one_process(a, tmp)
        n = one.pop("_params")["n"]
        print(
            f"model: GPT-2 style, {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}: {n / 1e6:.1f} M parameters, "
            f"fp32 + AdamW state; torch {torch.__version__}"
        )
        print("\n## One process")
        print("| format | save s | load s | bytes on disk (MB) |")
        print("|---|---|---|---|")
        for name, r in one.items():
            print(f"| {name} | {r['save']:.2f} | {r['load']:.2f} | {r['bytes'] / 1e6:.0f} |")
        load_table(a, tmp)
        res = run_distributed(_four, 4, a, tmp, tp=2, pp=2, timeout=3600)
        print("\n## tp=2 x pp=2 (4 processes): per rank and total")
        print("| format | rank | save s | load s | bytes written by the rank (MB) |")
        print("|---|---|---|---|---|")
        for fmt in ("sharded", "torch"):
            root = os.path.join(tmp, f"four_{fmt}")
            legacy = {0: "mp_rank_00_000", 1: "mp_rank_01_000", 2: "mp_rank_00_001", 3: "mp_rank_01_001"}
            for r in res:
                tag = f"__{r['rank']}_" if fmt == "sharded" else legacy[r["rank"]]
                print(
                    f"| {fmt} | {r['rank']} | {r[f'{fmt}_save']:.2f} | {r[f'{fmt}_load']:.2f} | "
                    f"{dir_bytes(root, tag) / 1e6:.0f} |"
                )
            print(
                f"| {fmt} | total (slowest rank) | {max(r[f'{fmt}_save'] for r in res):.2f} | "
                f"{max(r[f'{fmt}_load'] for r in res):.2f} | {dir_bytes(root) / 1e6:.0f} |"
            )
        same = max(r["sharded_load"] for r in res)
        other = max(r["reshard_load"] for r in res)
        print("\n## Layout change (sharded format)")
        print("| load into tp=2 x pp=2 | slowest rank s |")
        print("|---|---|")
        print(f"| saved at tp=2 x pp=2 (same layout) | {same:.2f} |")
        print(f"| saved in one process (tp=1, pp=1) | {other:.2f} (+{other - same:.2f}) |")
        save_tables(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
