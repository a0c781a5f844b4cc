#!/usr/bin/env python
"""Pretrain a GPT: parse the command line, build the parallel run, train.

    python pretrain_gpt.py                      # small GPT on the default corpus, CPU
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from megalite.arguments import parse_args
from megalite.logging import setup_logging
from megalite.checkpointing import CheckpointError
from megalite.config import ConfigError
from megalite.parallel_state import ParallelState
from megalite.training import Trainer, TrainingStopped, build_datasets, resolve_data


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = resolve_data(parse_args(argv))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same error: say it once
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    par = cfg.parallel
    ps = ParallelState.from_env(par.tp, par.pp, par.distributed_backend)
    log = setup_logging(ps.is_logging_rank, ps.rank)
    m = cfg.model
    log.info(f"megalite: world {ps.world_size} = tp {ps.tp_size} x dp {ps.dp_size} x pp {ps.pp_size} "
             f"(vp {par.vp}), backend {ps.backend or 'none'}, device {ps.device}")
    log.info(f"model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}, "
             f"seq {m.seq_length}, vocab {m.vocab_size}; data: "
             f"{'mock' if cfg.data.mock_data else ' '.join(cfg.data.data_path or cfg.data.train_data_path)}")
    trainer = Trainer(cfg, ps)
    if cfg.checkpoint.load:
        try:
            trainer.load()
        except CheckpointError as e:
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
            ps.destroy()
            return 2
    n_params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    log.info(f"schedule {trainer.schedule_name}, {trainer.m} micro-batches per step; "
             f"parameters on this rank: {n_params:,}")
    try:
        train_ds, valid_ds = build_datasets(cfg, ps)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # bad data files or split
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        ps.destroy()
        return 2
    try:
        trainer.train(train_ds, valid_ds)
    except TrainingStopped as e:
        if ps.is_logging_rank:  # the rank that knows the loss says it once
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        ps.destroy()
        return 1
    ps.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
