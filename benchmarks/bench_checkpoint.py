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
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Dict

from common import mock_config, run_distributed  # first: puts the repository on sys.path
import torch

from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.config import Config, ModelConfig
from megalite.parallel_state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed


def make_config(a, tp=1, pp=1) -> Config:
    m = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=12 if a.hidden % 12 == 0 else 8,
                    seq_length=64, vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    return mock_config(m, mbs=1, gbs=pp, seed=1, train_iters=10, tp=tp, pp=pp)


def trained(a, ps: ParallelState) -> Trainer:
    cfg = make_config(a, ps.tp_size, ps.pp_size)
    trainer = Trainer(cfg, ps)
    trainer.train_step(MockFeed(trainer, 1).next())  # Adam state exists
    trainer.state.iteration = 1
    return trainer


def parts(t: Trainer) -> tuple:
    """The explicit state objects save_checkpoint and load_checkpoint take."""
    return t.cfg, t.ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker


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
        save = timed(lambda: save_checkpoint(*parts(trainer), root, fmt))
        fresh = Trainer(trainer.cfg, ps)
        load = timed(lambda: load_checkpoint(*parts(fresh), root))
        rows[fmt] = {"save": save, "load": load, "bytes": dir_bytes(root)}
    state = {"model": trainer.chunks[0].state_dict(),
             "optimizer": {name: {k: v for k, v in trainer.optimizer.optimizer.state[p].items()}
                           for name, p in trainer.chunks[0].named_parameters()}}
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
        out[f"{fmt}_save"] = timed(lambda: save_checkpoint(*parts(trainer), root, fmt))
        fresh = Trainer(trainer.cfg, ps)
        ps.barrier()
        out[f"{fmt}_load"] = timed(lambda: load_checkpoint(*parts(fresh), root))
    fresh = Trainer(trainer.cfg, ps)
    ps.barrier()
    out["reshard_load"] = timed(lambda: load_checkpoint(*parts(fresh), os.path.join(tmp, "one_sharded")))
    out["rank"] = ps.rank
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    a.layers, a.hidden, a.vocab = (4, 256, 8000) if a.quick else (12, 768, 32000)
    tmp = tempfile.mkdtemp(prefix="megalite_ckpt_bench_")
    try:
        one = one_process(a, tmp)
        n = one.pop("_params")["n"]
        print(f"model: GPT-2 style, {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}: {n / 1e6:.1f} M parameters, "
              f"fp32 + AdamW state; torch {torch.__version__}")
        print("\n## One process")
        print("| format | save s | load s | bytes on disk (MB) |")
        print("|---|---|---|---|")
        for name, r in one.items():
            print(f"| {name} | {r['save']:.2f} | {r['load']:.2f} | {r['bytes'] / 1e6:.0f} |")
        res = run_distributed(_four, 4, a, tmp, tp=2, pp=2, timeout=3600)
        print("\n## tp=2 x pp=2 (4 processes): per rank and total")
        print("| format | rank | save s | load s | bytes written by the rank (MB) |")
        print("|---|---|---|---|---|")
        for fmt in ("sharded", "torch"):
            root = os.path.join(tmp, f"four_{fmt}")
            legacy = {0: "mp_rank_00_000", 1: "mp_rank_01_000", 2: "mp_rank_00_001", 3: "mp_rank_01_001"}
            for r in res:
                tag = f"__{r['rank']}_" if fmt == "sharded" else legacy[r["rank"]]
                print(f"| {fmt} | {r['rank']} | {r[f'{fmt}_save']:.2f} | {r[f'{fmt}_load']:.2f} | "
                      f"{dir_bytes(root, tag) / 1e6:.0f} |")
            print(f"| {fmt} | total (slowest rank) | {max(r[f'{fmt}_save'] for r in res):.2f} | "
                  f"{max(r[f'{fmt}_load'] for r in res):.2f} | {dir_bytes(root) / 1e6:.0f} |")
        same = max(r["sharded_load"] for r in res)
        other = max(r["reshard_load"] for r in res)
        print("\n## Layout change (sharded format)")
        print("| load into tp=2 x pp=2 | slowest rank s |")
        print("|---|---|")
        print(f"| saved at tp=2 x pp=2 (same layout) | {same:.2f} |")
        print(f"| saved in one process (tp=1, pp=1) | {other:.2f} (+{other - same:.2f}) |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
