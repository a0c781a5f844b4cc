#!/usr/bin/env python
"""Mixture of experts on one GPU: MoE vs the dense model of equal active parameters, grouped GEMM vs the loop.

The configuration of issue 30's measurement (Llama-style: SwiGLU, RMSNorm, RoPE, no biases, bf16):
8 layers, hidden 1024, 16 heads, seq 2048, micro-batch 8, global batch 32; the MoE has 8 experts of
ffn 2816, top-2, aux loss 1e-2, alltoall dispatcher; the dense model of equal active parameters has
ffn 5632. Two tables:

1. training steps (Trainer, mock data): dense, MoE with --moe-grouped-gemm, MoE with the per-expert
   loop; ms per iteration, tokens/s, TFLOP/s of the active parameters (the log line's count), peak
   memory (each row in a fresh state: the previous row's trainer freed first), tokens/s vs dense;
2. the experts alone (one layer's LocalExperts, fwd+bwd on the rows top-2 routing gives them):
   grouped GEMM (torch._grouped_mm) vs the loop, CUDA-event timed.

    python benchmarks/bench_moe_gpu.py               # on a CUDA GPU, ~2 minutes on an H200
    python benchmarks/bench_moe_gpu.py --cpu-smoke   # tiny shapes on CPU (fp32): checks the script runs
    python benchmarks/bench_moe.py --gpu             # the same, from the CPU benchmark's entry point

Targets (issue 30): MoE >= 0.90x dense tokens/s; grouped >= 2x the loop.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from typing import Dict, List, Optional, Sequence

import common  # noqa: F401  (first: puts the repository on sys.path)
import torch
from gpu_bench import one_rank_state, timed_steps

from megalite.config.arguments import parse_args
from megalite.moe.experts import LocalExperts
from megalite.observability.throughput import Throughput, device_peak_tflops
from megalite.parallel.state import AxisGroup, ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed

FULL = dict(
    layers=8, hidden=1024, heads=16, seq=2048, mbs=8, gbs=32, experts=8, ffn=2816, topk=2, vocab=32000, iters=20
)
SMOKE = dict(layers=2, hidden=64, heads=4, seq=64, mbs=2, gbs=4, experts=4, ffn=64, topk=2, vocab=512, iters=2)
WARMUP = 3


def flags(s: Dict[str, int], moe: bool, grouped: bool, cuda: bool) -> List[str]:
    argv = f"""--mock-data --vocab-size {s["vocab"]} --num-layers {s["layers"]} --hidden-size {s["hidden"]}
        --num-attention-heads {s["heads"]} --seq-length {s["seq"]} --max-position-embeddings {s["seq"]}
        --micro-batch-size {s["mbs"]} --global-batch-size {s["gbs"]} --train-iters {s["iters"] + WARMUP + 10}
        --eval-iters 0 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
        --untie-embeddings-and-output-weights --ffn-hidden-size {s["ffn"] * s["topk"]}
        --distributed-backend {"nccl" if cuda else "gloo"}""".split()
    if moe:
        argv += f"""--num-experts {s["experts"]} --moe-ffn-hidden-size {s["ffn"]} --moe-router-topk {s["topk"]}
            --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall""".split()
        argv += ["--moe-grouped-gemm"] if grouped else []
    return argv + (["--bf16"] if cuda else [])


def fresh(cuda: bool) -> None:
    """Free what the previous row left (its trainer is unreachable once gc has run) and zero the peak."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def train_row(s: Dict[str, int], moe: bool, grouped: bool, ps: ParallelState, peak) -> Dict[str, float]:
    cuda = ps.device.type == "cuda"
    fresh(cuda)
    cfg = parse_args(flags(s, moe, grouped, cuda), world_size=1)
    trainer = Trainer(cfg, ps)
    feed = MockFeed(trainer, 4, seed=1)
    batches = [feed.next() for _ in range(4)]
    times, _ = timed_steps(trainer.train_step, batches, WARMUP, s["iters"], cuda)  # (per step, first step)
    sec = statistics.median(times)
    out = Throughput(cfg.model, s["gbs"], trainer.chunks[0].padded_vocab, 1, peak_tflops=peak).figures(sec)
    out["ms"] = 1e3 * sec
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del trainer, feed, batches
    return out


def _expert_counts(tokens: int, experts: int, gen: torch.Generator) -> List[int]:
    """Rows per expert for ``tokens`` routed rows, uneven as a router's are (about +-25%)."""
    w = 0.75 + 0.5 * torch.rand(experts, generator=gen)
    counts = (w / w.sum() * tokens).long()
    counts[-1] += tokens - int(counts.sum())
    return counts.tolist()


def experts_row(s: Dict[str, int], grouped: bool, device: torch.device, reps: int) -> float:
    """Milliseconds of one fwd+bwd of one layer's experts on the rows top-k routing hands them."""
    cuda = device.type == "cuda"
    fresh(cuda)
    cfg = parse_args(flags(s, True, grouped, cuda), world_size=1).model
    one = AxisGroup([0], 0)
    experts = LocalExperts(cfg, one, one, 1234, "decoder.layers.0.mlp.experts").to(device, cfg.torch_dtype)
    rows = s["mbs"] * s["seq"] * s["topk"]
    counts = _expert_counts(rows, s["experts"], torch.Generator().manual_seed(0))
    device_counts = torch.tensor(counts, device=device)
    x = torch.randn(rows, s["hidden"], device=device, dtype=cfg.torch_dtype, requires_grad=True)
    grad = torch.randn_like(x)
    if grouped != experts._grouped(x):
        return float("nan")  # this device, dtype or torch lacks the grouped kernel: no row to time

    def once() -> None:
        experts(x, counts, device_counts=device_counts).backward(grad)

    times, _ = timed_steps(lambda _: once(), [None], 2, reps, cuda)
    return 1e3 * statistics.median(times)


def report(s: Dict[str, int], ps: ParallelState, peak, reps: int) -> None:
    rows = {
        f"dense, ffn {s['ffn'] * s['topk']}": train_row(s, False, False, ps, peak),
        f"MoE {s['experts']} x {s['ffn']}, top-{s['topk']}, grouped GEMM": train_row(s, True, True, ps, peak),
        f"MoE {s['experts']} x {s['ffn']}, top-{s['topk']}, expert loop": train_row(s, True, False, ps, peak),
    }
    base = next(iter(rows.values()))["tokens_per_s"]
    print("\n[1] training steps (TFLOP/s of the active parameters; peak GiB per row from a fresh state)")
    print(f"    {'run':<52} {'ms/iter':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} {'GiB':>6} vs dense")
    for label, r in rows.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"    {label:<52} {r['ms']:>9.1f} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} {mfu:>7} "
            f"{r['peak_gib']:>6.1f} {r['tokens_per_s'] / base:>7.2f}"
        )
    loop, grouped = experts_row(s, False, ps.device, reps), experts_row(s, True, ps.device, reps)
    print(f"\n[2] one layer's experts, fwd+bwd, {s['mbs'] * s['seq'] * s['topk']} routed rows")
    print(f"    expert loop   {loop:8.2f} ms")
    if grouped != grouped:  # nan: not timed
        print("    grouped GEMM  not run: needs torch._grouped_mm, a Hopper or newer GPU and bf16")
    else:
        print(f"    grouped GEMM  {grouped:8.2f} ms   ({loop / grouped:.2f}x the loop)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (gloo, fp32): checks the script runs")
    p.add_argument("--iters", type=int, help="timed iterations per training row (default 20; smoke 2)")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: bf16 table by GPU name)")
    a = p.parse_args(argv)
    cuda = not a.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("bench_moe_gpu: no CUDA device; use --cpu-smoke to check the script on CPU", file=sys.stderr)
        return 2
    s = dict(SMOKE if a.cpu_smoke else FULL)
    s["iters"] = a.iters or s["iters"]
    ps = one_rank_state(cuda)
    peak = device_peak_tflops(ps.device, a.peak_tflops)
    name = torch.cuda.get_device_name(ps.device) if cuda else "CPU"
    print(
        f"device {name}, torch {torch.__version__}; {s['layers']} layers x {s['hidden']}, {s['heads']} heads, seq "
        f"{s['seq']}, micro-batch {s['mbs']}, global batch {s['gbs']}; median of {s['iters']} iterations"
    )
    report(s, ps, peak, reps=10 if cuda else 2)
    ps.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
