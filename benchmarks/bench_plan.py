#!/usr/bin/env python
"""The planner's memory estimate against measured CPU runs, layout by layout.

Measured per rank (as bench_memory.py counts it): the bytes of every distinct
storage autograd saves during each chunk's forward (and the loss), replayed in
the order of the rank's schedule (+ at its forward, - at its backward) for the
peak, plus parameter, gradient-buffer and optimizer-state bytes of the real
Trainer after one step. The row compares the most loaded rank's total with
``megalite.analysis.planner.estimate_memory`` for the same layout.

  python benchmarks/bench_plan.py            # 12 layouts (GPT-2 and Llama style), ~2-4 minutes on 2 cores
  python benchmarks/bench_plan.py --quick    # 4 layouts
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

from common import mock_config, run_distributed  # first: puts the repository on sys.path
import torch

from megalite.config import Config, ModelConfig, OptimConfig
from bench_memory import SavedBytes  # (the same saved-tensor meter)
from megalite.parallel_state import ParallelState
from megalite.analysis.planner import RECOMPUTE, Layout, estimate_memory
from megalite.pipeline.registry import build_compute
from megalite.training import Trainer
from megalite.training.mock import MockFeed

GPT2 = dict(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=2048,
            hidden_dropout=0.1, attention_dropout=0.1, params_dtype="bfloat16", attention_backend="unfused")
LLAMA = dict(num_layers=8, hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=128,
             vocab_size=2048, hidden_dropout=0.0, attention_dropout=0.0, params_dtype="bfloat16",
             normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False, attention_backend="auto")

# (model, layout, global batch): 1 to 8 ranks; every option of the planner appears at least once
LAYOUTS: List[Tuple[str, Layout, int]] = [
    ("gpt2", Layout(1, 1, 1, mbs=2), 4),
    ("gpt2", Layout(1, 1, 1, mbs=2, recompute="selective"), 4),
    ("gpt2", Layout(1, 1, 1, mbs=2, recompute="full"), 4),
    ("gpt2", Layout(2, 1, 1, mbs=2, sp=True), 4),
    ("gpt2", Layout(2, 1, 1, mbs=2), 4),
    ("gpt2", Layout(1, 2, 1, mbs=2), 8),
    ("gpt2", Layout(1, 2, 1, vp=2, mbs=1), 4),
    ("gpt2", Layout(1, 1, 2, mbs=2, dist_opt=True), 8),
    ("gpt2", Layout(2, 2, 2, mbs=1, sp=True, dist_opt=True), 8),
    ("llama", Layout(1, 1, 1, mbs=2), 4),
    ("llama", Layout(2, 2, 1, vp=2, mbs=1, sp=True, recompute="selective"), 4),
    ("llama", Layout(1, 4, 1, mbs=1), 8),
]
QUICK = [0, 2, 3, 5]


def make_config(model: Dict, layout: Layout, gbs: int) -> Config:
    mdl = ModelConfig(**model, **RECOMPUTE[layout.recompute])
    return mock_config(mdl, layout.mbs, gbs, seed=1, train_iters=10,
                       optim=OptimConfig(accumulate_allreduce_grads_in_fp32=True,
                                         use_distributed_optimizer=layout.dist_opt),
                       tp=layout.tp, pp=layout.pp, vp=layout.vp, sequence_parallel=layout.sp)


def measure(ps: ParallelState, model: Dict, layout: Layout, gbs: int) -> Dict[str, float]:
    """This rank's measured bytes: weights, grad buffer, optimizer state, peak saved activations."""
    torch.set_num_threads(1)
    cfg = make_config(model, layout, gbs)
    trainer = Trainer(cfg, ps)
    sizes: List[List[int]] = [[] for _ in trainer.chunks]  # per chunk, per micro-batch in forward order
    for c, chunk in enumerate(trainer.chunks):
        forward, loss = chunk.forward, chunk.loss

        def counted_forward(x, forward=forward, c=c):
            with SavedBytes(trainer.params) as counter:
                out = forward(x)
            sizes[c].append(counter.total)
            return out

        def counted_loss(*args, loss=loss, c=c):
            with SavedBytes(trainer.params) as counter:
                out = loss(*args)
            sizes[c][-1] += counter.total
            return out
        chunk.forward, chunk.loss = counted_forward, counted_loss
    trainer.train_step(MockFeed(trainer, 1).next())
    live, peak = 0, 0
    for act in build_compute(trainer.schedule_name, ps.pp_size, layout.vp, trainer.m)[ps.pp_rank]:
        size = sizes[act.chunk][act.mb]
        live += size if act.kind == "F" else -size
        peak = max(peak, live)
    grads = trainer.optimizer.grads.grad_data
    return {"weights": sum(p.numel() * p.element_size() for p in trainer.params),
            "grads": grads.numel() * grads.element_size(), "optimizer": trainer.optimizer.state_bytes(),
            "activations": peak, "params": sum(p.numel() for p in trainer.params)}


def measure_layout(model: Dict, layout: Layout, gbs: int) -> Dict[str, float]:
    """The most loaded rank's measured bytes (one process, or gloo workers for several ranks)."""
    if layout.world == 1:
        ranks = [measure(ParallelState.single(), model, layout, gbs)]
    else:
        ranks = run_distributed(measure, layout.world, model, layout, gbs, tp=layout.tp, pp=layout.pp)
    return max(ranks, key=lambda r: r["weights"] + r["grads"] + r["optimizer"] + r["activations"])


def compare(name: str, layout: Layout, gbs: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(measured, estimated) bytes by part for one row of the table."""
    model = GPT2 if name == "gpt2" else LLAMA
    got = measure_layout(model, layout, gbs)
    est = estimate_memory(ModelConfig(**model), layout, gbs, device="cpu")
    return got, {"weights": est.weights, "grads": est.grads, "optimizer": est.optimizer,
                 "activations": est.activations}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layouts")
    a = p.parse_args()
    rows = [LAYOUTS[i] for i in QUICK] if a.quick else LAYOUTS
    print("models (bf16, seq 128, hidden 128, 8 layers, vocab 2048): gpt2 = LayerNorm, GeLU, learned positions, "
          "dropout 0.1, unfused attention; llama = RMSNorm, SwiGLU, RoPE, GQA 4/2, untied, dropout 0, SDPA")
    print("| model | layout | gbs | weights+grads+optimizer MiB (est / measured) | activations MiB "
          "(est / measured) | total MiB est | total MiB measured | est / measured |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, layout, gbs in rows:
        got, est = compare(name, layout, gbs)
        state = [sum(d[k] for k in ("weights", "grads", "optimizer")) / 2 ** 20 for d in (est, got)]
        total_est, total_got = (sum(d[k] for k in ("weights", "grads", "optimizer", "activations"))
                                for d in (est, got))
        ratio = total_est / total_got
        worst = max(worst, abs(ratio - 1))
        print(f"| {name} | {layout.describe()} | {gbs} | {state[0]:.2f} / {state[1]:.2f} | "
              f"{est['activations'] / 2 ** 20:.2f} / {got['activations'] / 2 ** 20:.2f} | "
              f"{total_est / 2 ** 20:.2f} | {total_got / 2 ** 20:.2f} | {ratio:.3f} |")
    print(f"largest total error: {100 * worst:.1f}% (goal: within 10%)")


if __name__ == "__main__":
    main()
