#!/usr/bin/env python
"""Loss and perplexity of a megalite checkpoint on a data split, as the training run's evaluation.

Examples:
  python tools/evaluate.py --load ckpt                                 # the run's own validation data
  python tools/evaluate.py --load ckpt --split-name test --eval-iters 20
  python tools/evaluate.py --load ckpt --data-path data/other_text_document --split 0,1,0

The checkpoint (either format, any tp/pp/vp layout) runs in one process. Data,
split, seed, batch sizes and --eval-iters default to the run's stored config,
and the samples are chosen exactly as pretrain_gpt.py chooses them, so with the
defaults the loss equals the one the training log printed at the checkpoint's
iteration. Prints Megatron's line:

  validation loss at iteration 200 | lm loss value: 4.73E+00 | lm loss PPL: 1.13E+02 |
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megalite.checkpointing import CheckpointError  # noqa: E402
from megalite.config import Config, ConfigError, OptimConfig, ParallelConfig  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, add_load_args, one_line  # noqa: E402
from megalite.data.batches import MicroBatches  # noqa: E402
from megalite.data.loading import resolve_default_corpus, split_dataset, validation_start  # noqa: E402
from megalite.inference import load_full_weights, read_checkpoint  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.training import Trainer, TrainingStopped  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None):
    p = OneLineArgumentParser(prog="evaluate.py", description=__doc__.split("\n")[0])
    add_load_args(p)
    g = p.add_argument_group("data (default: the run's)")
    g.add_argument("--split-name", choices=("valid", "test", "train"), default="valid")
    g.add_argument("--data-path", nargs="+", help="as pretrain_gpt.py: prefix, or weight prefix pairs")
    g.add_argument("--split", help="as pretrain_gpt.py, e.g. 969,30,1")
    g.add_argument("--train-data-path", nargs="+")
    g.add_argument("--valid-data-path", nargs="+")
    g.add_argument("--test-data-path", nargs="+")
    g.add_argument("--data-cache-path")
    g.add_argument("--mock-data", action="store_true")
    g = p.add_argument_group("evaluation (default: the run's)")
    g.add_argument("--eval-iters", type=int, help="global batches to average over")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--seed", type=int, help="the data shuffle seed")
    return p.parse_args(argv)


def eval_config(cfg: Config, args) -> Config:
    """The run's config with the flags given here, one process, no optimizer features."""
    data = resolve_default_corpus(cfg.data)
    given = {k: getattr(args, k) for k in ("split", "data_cache_path")}
    paths = {
        k: tuple(getattr(args, k))
        for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path")
        if getattr(args, k)
    }
    if paths or args.mock_data:  # new data replaces all of the run's (not one split's path of it)
        data = replace(
            data, mock_data=args.mock_data, data_path=(), train_data_path=(), valid_data_path=(), test_data_path=()
        )
    data = replace(data, **paths, **{k: v for k, v in given.items() if v is not None})
    train = replace(
        cfg.train,
        **{
            k: getattr(args, k)
            for k in ("eval_iters", "micro_batch_size", "global_batch_size", "seed")
            if getattr(args, k) is not None
        },
    )
    for flag, value in (
        ("--eval-iters", train.eval_iters),
        ("--micro-batch-size", train.micro_batch_size),
        ("--global-batch-size", train.global_batch_size),
    ):
        if value < 1:  # checked before any data is read, which would blame the data instead
            raise ConfigError(f"{flag} {value} must be >= 1")
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            f"--global-batch-size {train.global_batch_size} is not a multiple of "
            f"--micro-batch-size {train.micro_batch_size}"
        )
    return cfg.with_(
        data=data,
        train=train,
        parallel=ParallelConfig(),
        optim=OptimConfig(),
        model=replace(cfg.model, recompute_granularity=None, torch_compile=False),
    )


def evaluate(
    cfg: Config, full: dict, split: str, device: str = "cpu", dtype: Optional[str] = None, iteration: int = 0
) -> float:
    """Mean lm loss over ``eval_iters`` global batches of ``split``, computed by the Trainer's own evaluate().

    For the validation split the batches are those the training run's evaluation at ``iteration``
    read (each evaluation goes on where the last stopped); other splits start at their beginning.
    """
    if dtype:
        cfg = cfg.with_(model=replace(cfg.model, params_dtype=dtype))
    dataset = split_dataset(cfg, split)
    ps = ParallelState.single(torch.device(device))
    trainer = Trainer(cfg, ps)
    load_full_weights(trainer.chunks[0], full)
    t = cfg.train
    start = validation_start(iteration, t, len(dataset)) if split == "valid" and t.eval_interval > 0 else 0
    batches = MicroBatches(
        dataset, start, t.micro_batch_size, trainer.m, ps, cfg.data.num_workers, name=split, sequence=trainer.sequence
    )  # packed documents as the run trained on them
    try:
        return trainer.evaluate(batches)
    except TrainingStopped as e:  # a sample outside the vocabulary: another tokenizer's data
        raise ValueError(str(e)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the process exit code (2 for bad input, with one line on stderr)."""
    args = parse_args(argv)
    try:
        cfg, iteration, full = read_checkpoint(args.load, args.ckpt_step)
        cfg = eval_config(cfg, args)
        loss = evaluate(cfg, full, args.split_name, args.device, args.dtype, iteration)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"evaluate.py: error: {one_line(e)}", file=sys.stderr)
        return 2
    ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
    where = f"iteration {iteration}" + ("" if args.split_name == "valid" else f" for {args.split_name} data")
    line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
    print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
