"""What every benchmark script shares: the repository on sys.path, the multi-process launcher and
the config builders.

The scripts run as ``python benchmarks/<name>.py`` (so this directory is on sys.path); their first
import, ``import common``, puts the repository root there too, once, before any ``megalite`` import.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megalite.config import (  # noqa: E402
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from megalite.testing import run_distributed  # noqa: E402  (the benchmarks' launcher)

__all__ = ["REPO", "mock_config", "pipeline_config", "run_distributed"]


def mock_config(
    model: ModelConfig, mbs: int, gbs: int, seed: int, train_iters: int, optim: Optional[OptimConfig] = None, **parallel
) -> Config:
    """A mock-data run of ``model`` without evaluation: micro-batch ``mbs``, global batch ``gbs``;
    ``parallel`` are ParallelConfig fields (tp, pp, vp, schedule, ...), ``optim`` defaults to OptimConfig()."""
    return Config(
        model=model,
        parallel=ParallelConfig(**parallel),
        optim=optim or OptimConfig(),
        data=DataConfig(mock_data=True),
        train=TrainConfig(
            micro_batch_size=mbs, global_batch_size=gbs, train_iters=train_iters, seed=seed, eval_iters=0
        ),
    )


def pipeline_config(
    a: argparse.Namespace,
    pp: int,
    schedule: str,
    vp: int,
    m: int,
    heads: int,
    overlap: bool = False,
    split: Optional[Sequence[int]] = None,
) -> Config:
    """The pipeline benchmarks' model (bench_pipeline.py, bench_balance.py): GPT-2 style (tied embeddings),
    dropout 0.1, shape from the command line (--num-layers, --hidden-size, --seq-length, --vocab-size,
    --micro-batch-size), ``m`` micro-batches per step on one pipeline of ``pp`` ranks, AdamW lr 1e-3."""
    model = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=heads,
        seq_length=a.seq_length,
        vocab_size=a.vocab_size,
    )
    return mock_config(
        model,
        a.micro_batch_size,
        a.micro_batch_size * m,
        seed=1234,
        train_iters=10_000,
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, clip_grad=1.0),
        pp=pp,
        vp=vp,
        pipeline_schedule=schedule,
        overlap_p2p_comm=overlap,
        pipeline_stage_layers=split,
    )
