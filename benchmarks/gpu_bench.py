#!/usr/bin/env python
"""One-GPU benchmark: a 1.3B GPT (24 x 2048, seq 2048, bf16, SDPA flash) eager, with selective recompute
and with --compile, and a plain PyTorch model of the same shape eager and torch.compile'd (each block, as
--compile does), in tokens/s, TFLOP/s, MFU and peak memory.

Run through benchmarks/gpu_bench.sh (torchrun, one process). The megalite side goes through the
CUDA paths a cluster run uses: an NCCL process group (world 1; its collectives still run), the
device of LOCAL_RANK, pinned host memory for batches, the CUDA RNG states of the tracker (checked
by a save/restore round trip, as a checkpoint does) and the GPU memory report. The plain side is
bench_overhead.py's single-file GPT with torch.autocast(bf16), fp32 weights and fused AdamW: the
usual way to write it by hand. ``--cpu-smoke`` runs every step on CPU with a tiny shape (gloo).

Each row starts from a fresh allocator: the previous row's model is dropped, collected and its cached
blocks returned (``fresh_device``) before the next is built, so its peak memory is its own. ``ROWS`` lists
the rows: a row of other megalite flags (FP8, say) is one more entry.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Tuple

import common  # noqa: F401  (first: puts the repository on sys.path)
import torch
import torch.distributed as dist
from bench_overhead import PlainTrainer

from megalite.config.arguments import parse_args
from megalite.data.mock_dataset import MockGPTDataset
from megalite.observability.throughput import Throughput, device_peak_tflops, gather_memory_report
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed

FULL = dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, mbs=4, gbs=16, iters=30, warmup=3)
SMOKE = dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, mbs=2, gbs=4, iters=2, warmup=1)


class Row(NamedTuple):
    label: str
    plain: bool  # bench_overhead.py's PlainTrainer (else megalite's Trainer)
    flags: Tuple[str, ...] = ()  # megalite flags of the row (plain: ("--compile",) compiles its blocks)


FP8 = ("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")  # bf16 also in the CPU smoke run

ROWS = [
    Row("megalite", False),
    Row("megalite selective recompute", False, ("--recompute-activations",)),
    Row("megalite --compile", False, ("--compile",)),
    Row("plain PyTorch (autocast bf16)", True),
    Row("plain PyTorch, torch.compile", True, ("--compile",)),
    Row("megalite FP8 (hybrid, tensorwise)", False, FP8),
    Row("megalite FP8 + --compile", False, FP8 + ("--compile",)),
]
PLAIN, PLAIN_COMPILED = ROWS[3].label, ROWS[4].label  # the peers of the ratio columns


def flags(s: Dict[str, int], extra: Tuple[str, ...], cuda: bool) -> List[str]:
    argv = [
        "--mock-data",
        "--vocab-size",
        str(s["vocab"]),
        "--num-layers",
        str(s["layers"]),
        "--hidden-size",
        str(s["hidden"]),
        "--num-attention-heads",
        str(s["heads"]),
        "--seq-length",
        str(s["seq"]),
        "--max-position-embeddings",
        str(s["seq"]),
        "--micro-batch-size",
        str(s["mbs"]),
        "--global-batch-size",
        str(s["gbs"]),
        "--train-iters",
        str(s["iters"] + s["warmup"] + 10),
        "--eval-iters",
        "0",
        "--attention-backend",
        "auto",
        "--distributed-backend",
        "nccl" if cuda else "gloo",
    ]
    argv += ["--bf16"] if cuda else []  # bf16 on CPU is correct but slow: the smoke run stays fp32
    return argv + list(extra)


def fresh_device(cuda: bool) -> None:
    """Drop what the previous row left: its cycles collected, its cached blocks freed, the peak reset."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed_steps(step: Callable, batches: List, warmup: int, iters: int, cuda: bool) -> Tuple[List[float], float]:
    """Seconds per step after ``warmup`` untimed ones (CUDA synchronised around each), and the seconds of the
    first step (with --compile: its compilation)."""
    t0 = time.perf_counter()
    step(batches[0])
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for i in range(1, warmup):
        step(batches[i % len(batches)])
    out = []
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out, first


def check_rng_round_trip(trainer: Trainer) -> None:
    """A checkpoint's RNG capture (CUDA states included) restores the same random stream."""
    from megalite.checkpointing import RandomStates

    rng = RandomStates(trainer.tracker)
    state = rng.state_dict()
    device = trainer.ps.device
    with trainer.tracker.fork("tp"):
        first = torch.rand(4, device=device)
    rng.load_state_dict(state)
    with trainer.tracker.fork("tp"):
        again = torch.rand(4, device=device)
    assert torch.equal(first, again), "RNG state round trip changed the random stream"


def run_megalite(s: Dict[str, int], extra: Tuple[str, ...], ps: ParallelState, peak) -> Dict[str, float]:
    cuda = ps.device.type == "cuda"
    cfg = parse_args(flags(s, extra, cuda), world_size=1)
    trainer = Trainer(cfg, ps)
    check_rng_round_trip(trainer)
    feed = MockFeed(trainer, 4, seed=1)  # pin_memory=True on CUDA
    batches = [feed.next() for _ in range(4)]
    times, first = timed_steps(trainer.train_step, batches, s["warmup"], s["iters"], cuda)
    for line in gather_memory_report(ps, s["warmup"] + s["iters"]):  # NCCL-free: an object gather
        print("   ", line)
    tp = Throughput(cfg.model, s["gbs"], trainer.chunks[0].padded_vocab, 1, peak_tflops=peak)
    result = tp.figures(statistics.median(times))
    result["ms"], result["first_s"] = 1e3 * statistics.median(times), first
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return result


def run_plain(s: Dict[str, int], compiled: bool, device: torch.device, peak) -> Dict[str, float]:
    cuda = device.type == "cuda"
    cfg = parse_args(flags(s, (), cuda), world_size=1)
    plain = PlainTrainer(cfg)
    plain.model.to(device)
    for block in plain.model.blocks if compiled else ():  # regional, like --compile
        block.compile()
    if cuda:  # hand-written mixed precision: fp32 weights, bf16 autocast, fused AdamW
        plain.optimizer = torch.optim.AdamW(plain.optimizer.param_groups, lr=cfg.optim.lr, fused=True)
    ds = MockGPTDataset(s["seq"], s["vocab"], 1, 4 * s["gbs"])
    batches = []
    for k in range(4):
        rows = torch.stack([torch.from_numpy(ds[k * s["gbs"] + i]["text"].astype("int64")) for i in range(s["gbs"])])
        batches.append(
            [{"tokens": mb[:, :-1].to(device), "labels": mb[:, 1:].to(device)} for mb in rows.split(s["mbs"])]
        )

    def step(b):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            return plain.train_step(b)

    times, first = timed_steps(step, batches, s["warmup"], s["iters"], cuda)
    padded = cfg.model.padded_vocab_size(1)
    result = Throughput(cfg.model, s["gbs"], padded, 1, peak_tflops=peak).figures(statistics.median(times))
    result["ms"], result["first_s"] = 1e3 * statistics.median(times), first
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return result


def one_rank_state(cuda: bool) -> ParallelState:
    """A one-rank process group of the cluster's backend (NCCL on CUDA, else gloo), so the NCCL path (groups,
    collectives, the device of LOCAL_RANK) is the one a multi-GPU run takes; from_env() finds it initialised.
    Without torchrun's rendezvous variables, a local one."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", world_size=1, rank=0)
    return ParallelState.from_env(1, 1, "nccl" if cuda else "gloo")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (gloo): checks the script runs")
    p.add_argument("--iters", type=int, help="timed iterations (default 30; smoke 2)")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: bf16 table by GPU name)")
    p.add_argument("--rows", help="comma-separated row numbers to run (0-based, in the table's order; default all)")
    a = p.parse_args()
    cuda = not a.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; use --cpu-smoke to check the script on CPU", file=sys.stderr)
        return 2
    s = dict(SMOKE if a.cpu_smoke else FULL)
    s["iters"] = a.iters or s["iters"]
    ps = one_rank_state(cuda)
    peak = device_peak_tflops(ps.device, a.peak_tflops)
    name = torch.cuda.get_device_name(ps.device) if cuda else "CPU"
    print(
        f"device {name} (peak {peak} TFLOP/s), backend {ps.backend}, torch {torch.__version__}; GPT "
        f"{s['layers']} x {s['hidden']}, heads {s['heads']}, seq {s['seq']}, micro-batch {s['mbs']}, global "
        f"batch {s['gbs']}; median of {s['iters']} iterations after {s['warmup']}"
    )
    rows = {}
    chosen = ROWS if a.rows is None else [ROWS[int(i)] for i in a.rows.split(",")]
    for row in chosen:
        fresh_device(cuda)
        if row.plain:
            rows[row.label] = run_plain(s, "--compile" in row.flags, ps.device, peak)
        else:
            rows[row.label] = run_megalite(s, row.flags, ps, peak)
    print_table(rows)
    ps.destroy()
    return 0


def print_table(rows: Dict[str, Dict[str, float]]) -> None:
    """One line per row; the ratio columns are tokens/s over the eager and the compiled plain PyTorch row
    ("-" when that row was not run)."""

    def ratio(r: Dict[str, float], peer: str) -> str:
        return f"{r['tokens_per_s'] / rows[peer]['tokens_per_s']:.2f}" if peer in rows else "-"

    print(
        f"{'run':<34} {'ms/iter':>9} {'1st iter s':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'hw TFLOP/s':>10} "
        f"{'MFU':>7} {'peak GiB':>9} {'vs plain':>9} {'vs compiled':>11}"
    )
    for label, r in rows.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{label:<34} {r['ms']:>9.1f} {r['first_s']:>10.1f} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} "
            f"{r['hw_tflops']:>10.1f} {mfu:>7} {r['peak_gib']:>9.1f} {ratio(r, PLAIN):>9} "
            f"{ratio(r, PLAIN_COMPILED):>11}"
        )


if __name__ == "__main__":
    sys.exit(main())
