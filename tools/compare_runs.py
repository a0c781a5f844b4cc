#!/usr/bin/env python
"""Name the first layer and tensor where two runs part ("TP=2 gives a different loss than TP=1").

Examples:
  # run both sides on the same fixed batches (common pretrain_gpt.py flags after --), compare
  python tools/compare_runs.py --a "--tensor-model-parallel-size 1" --b "--tensor-model-parallel-size 2" \\
      --nproc-b 2 -- --mock-data --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
      --vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 1 --num-threads 1
  python tools/compare_runs.py --b "--bf16" -- <flags>                       # fp32 against bf16
  python tools/compare_runs.py --b "--sequence-parallel --tensor-model-parallel-size 2" --nproc-b 2 -- <flags>
  # one side now, the other later (another commit, another machine), then compare the two captures
  python tools/compare_runs.py --capture-dir cap_old --nproc 2 -- <flags>
  python tools/compare_runs.py --read cap_old cap_new

Each side runs one training iteration (forward and backward of every micro-batch, gradients
finalized, no optimizer step) in a fresh job (torchrun when --nproc > 1) on the first global
batch of the run's data (mock data: fixed by --seed; with --load, the batch after the
checkpoint's iteration). Every rank writes its part of the weights, each layer's output, the
gradient of each output and each parameter's main_grad as boxes of full tensors (tensor-parallel
shards joined, sequence- and context-parallel shards joined, distributed-optimizer shards gathered,
every pipeline stage's layers under their global names); megalite.analysis.divergence puts them back together and walks them in execution order:
forward (weights, embedding, layer 0 .. last, final norm, logits, loss), then backward from the
output. It prints the table (layer, tensor, max abs diff, relative diff, within/over the band) and,
last, one line naming the first tensor over the band.

The band: max|a - b| <= atol + rtol x (the largest magnitude of that kind of tensor in the same
layer). Defaults: rtol 1e-4 in fp32; 1e-2 when either side is fp16, 5e-2 when either is bf16
(atol 0); --rtol/--atol set them. Dropout is switched off on both sides (its masks depend on the
layout), unless --keep-dropout. --perturb NAME=EPS adds EPS x a fixed normal pattern to parameter
NAME on side B (or on the --capture-dir side): a self-test, the report must then name it first.

Exit codes: 0 the runs agree within the band, 1 they diverge, 2 bad input or a side that could not run
(one line).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.analysis.divergence import CaptureError, compare, load_capture  # noqa: E402
from megalite.config import ConfigError  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, number, one_line  # noqa: E402

PROG = "compare_runs.py"
TOOL = str(Path(__file__).resolve())
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str]):
    p = OneLineArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0], usage=f"{PROG} [options] -- <common pretrain_gpt.py flags>"
    )
    g = p.add_argument_group("run both sides")
    g.add_argument("--a", default="", metavar="FLAGS", help="side A's own flags (added to the common ones)")
    g.add_argument("--b", default="", metavar="FLAGS", help="side B's own flags")
    g.add_argument("--nproc-a", type=int, default=1, metavar="N", help="processes of side A (default 1)")
    g.add_argument("--nproc-b", type=int, default=1, metavar="N", help="processes of side B (default 1)")
    g.add_argument("--keep", metavar="DIR", help="keep the two captures in DIR/a and DIR/b (for --read)")
    g = p.add_argument_group("one side, or captures written earlier")
    g.add_argument("--capture-dir", metavar="DIR", help="capture one run into DIR and stop")
    g.add_argument("--nproc", type=int, default=1, metavar="N", help="processes of the --capture-dir run")
    g.add_argument("--read", nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two captures written earlier")
    g = p.add_argument_group("comparison")
    g.add_argument("--rtol", type=number(ge=0), help="relative band (default 1e-4 fp32, 1e-2 fp16, 5e-2 bf16)")
    g.add_argument("--atol", type=number(ge=0), help="absolute band added to it (default 0)")
    g.add_argument("--quiet", action="store_true", help="print only the verdict line")
    g.add_argument("--keep-dropout", action="store_true", help="keep the flags' dropout (off by default)")
    g.add_argument(
        "--perturb", metavar="NAME=EPS", help="self-test: add EPS x a fixed normal pattern to parameter NAME on side B"
    )
    g.add_argument("--timeout", type=number(gt=0), default=900.0, help="seconds a side may run (default 900)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ours, common = _split(list(argv))
    args = p.parse_args(ours)
    args.common = common
    return args


def _split(argv: List[str]):
    """(our options, the common flags after --); ``--a --bf16`` reads as ``--a=--bf16``."""
    ours, common = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    joined, i = [], 0
    while i < len(ours):
        if ours[i] in ("--a", "--b") and i + 1 < len(ours):
            joined.append(f"{ours[i]}={ours[i + 1]}")
            i += 2
            continue
        joined.append(ours[i])
        i += 1
    return joined, common


def _check_mode(args) -> None:
    for flag in ("nproc_a", "nproc_b", "nproc"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.read:
        extra = [
            f
            for f, v in (
                ("--a", args.a),
                ("--b", args.b),
                ("--capture-dir", args.capture_dir),
                ("--perturb", args.perturb),
                ("--keep", args.keep),
            )
            if v
        ] + (["--"] if args.common else [])
        if extra:
            raise ConfigError(f"--read compares captures written earlier; it takes no {extra[0]}")
    elif args.capture_dir:
        if args.a or args.b or args.keep:
            raise ConfigError("--capture-dir captures one run (its flags after --); give --a/--b/--keep without it")
    if args.perturb:
        from megalite.config.checks import parse_perturb

        parse_perturb(args.perturb)


def _side_flags(common: List[str], own: str, keep_dropout: bool) -> List[str]:
    try:
        flags = common + shlex.split(own)
    except ValueError as e:
        raise ConfigError(f"cannot split the flags {own!r}: {e}") from None
    return flags if keep_dropout else flags + NO_DROPOUT


def _check_side(label: str, flags: List[str], nproc: int) -> None:
    """The flags parse and the layout fits ``nproc`` processes (one line before anything is launched)."""
    from megalite.config.arguments import parse_args as parse_pretrain

    try:
        cfg = parse_pretrain(flags, world_size=nproc)
    except ValueError as e:
        raise ConfigError(f"{label}: {one_line(e)}") from None
    if cfg.optim.fsdp:  # the capture reads each parameter's gradient from the grad buffer
        raise ConfigError(
            f"{label}: --data-parallel-sharding-strategy {cfg.optim.sharding} is not captured (its gradients are "
            "FSDP shards); compare with optim or no_shard, which compute the same step"
        )


def _launch(label: str, flags: List[str], nproc: int, out: str, perturb: Optional[str], timeout: float) -> None:
    """Run one side's capture in a fresh job; ConfigError (one line) when it fails."""
    worker = [TOOL, "--worker", "--capture-dir", out] + (["--perturb", perturb] if perturb else []) + ["--"] + flags
    cmd = (
        [sys.executable]
        + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else [])
        + worker
    )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{label} ran past --timeout {timeout:g} s") from None
    if proc.returncode == 0:
        return
    prefix = f"{PROG}: error: "
    ours = [line[len(prefix) :] for line in proc.stderr.splitlines() if line.startswith(prefix)]
    if ours:
        raise ConfigError(f"{label}: {ours[0]}")
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["no output"]
    raise ConfigError(f"{label} failed (exit {proc.returncode}): {tail[0].strip()[:300]}")


def worker(args) -> int:
    """One rank of a side (under torchrun, or alone): capture one iteration into --capture-dir."""
    from megalite.checkpointing import CheckpointError
    from megalite.config.arguments import parse_args as parse_pretrain
    from megalite.config.checks import parse_perturb
    from megalite.data.loading import DatasetError, build_datasets, resolve_data
    from megalite.parallel.state import ParallelState
    from megalite.testing.capture import capture_step
    from megalite.training import Trainer
    from megalite.training.mock import MockFeed

    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = resolve_data(parse_pretrain(args.common))
        perturb = parse_perturb(args.perturb) if args.perturb else None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if rank == 0:
            _error(one_line(e))
        return 2
    cfg = cfg.with_(checkpoint=replace(cfg.checkpoint, save=None))  # never writes a checkpoint
    ps = ParallelState.from_config(cfg)  # the expert groups too, when the model has experts
    try:
        trainer = Trainer(cfg, ps)
        if cfg.checkpoint.load:
            trainer.checkpointer.load()
            if trainer.state.iteration >= cfg.train.train_iters:
                raise ConfigError(
                    f"--load {cfg.checkpoint.load} is at iteration {trainer.state.iteration}, the "
                    f"end of --train-iters {cfg.train.train_iters}: no batch is left to capture; "
                    "raise --train-iters (with --use-checkpoint-opt_param-scheduler)"
                )
        feed = MockFeed(trainer, 1, consumed=trainer.state.consumed_samples, dataset=build_datasets(cfg, ps).train)
        capture_step(trainer, feed.next(), args.capture_dir, perturb, argv=args.common)
    except (ConfigError, CheckpointError, DatasetError, ValueError) as e:
        if getattr(e, "report", ps.rank == 0):
            _error(one_line(e))
        ps.destroy()
        return 2
    ps.destroy()
    return 0


def _report(a_dir: str, b_dir: str, args, labels=("A", "B")) -> int:
    a, b = load_capture(a_dir), load_capture(b_dir)
    if a.meta["global_batch_size"] != b.meta["global_batch_size"]:
        raise ConfigError(
            f"the captures ran different global batches ({a.meta['global_batch_size']} and "
            f"{b.meta['global_batch_size']} samples); compare runs of one --global-batch-size"
        )
    report = compare(a, b, args.rtol, args.atol)
    if not args.quiet:
        for label, c in zip(labels, (a, b)):
            perturbed = f", perturbed {'='.join(map(str, c.meta['perturb']))}" if c.meta.get("perturb") else ""
            print(f"side {label}: {c.describe()}{perturbed} ({c.path})")
        if report.loss_a is not None and report.loss_b is not None:
            print(f"loss: A {report.loss_a:.6f}, B {report.loss_b:.6f}")
        print(report.table())
    print(report.verdict(), flush=True)
    return 0 if report.first is None else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse's one line (or --help) was printed
        return e.code if isinstance(e.code, int) else 2
    if args.worker:
        return worker(args)
    try:
        _check_mode(args)
        if args.read:
            return _report(args.read[0], args.read[1], args)
        if args.capture_dir:
            flags = _side_flags(args.common, "", args.keep_dropout)
            _check_side("the run", flags, args.nproc)
            _launch("the run", flags, args.nproc, args.capture_dir, args.perturb, args.timeout)
            print(f"captured into {args.capture_dir}; compare with {PROG} --read {args.capture_dir} <other capture>")
            return 0
        sides = [
            ("side A", _side_flags(args.common, args.a, args.keep_dropout), args.nproc_a, None),
            ("side B", _side_flags(args.common, args.b, args.keep_dropout), args.nproc_b, args.perturb),
        ]
        for label, flags, nproc, _ in sides:
            _check_side(label, flags, nproc)
        root = args.keep or tempfile.mkdtemp(prefix="compare_runs_")
        dirs = [os.path.join(root, "a"), os.path.join(root, "b")]
        try:
            for (label, flags, nproc, perturb), d in zip(sides, dirs):
                shutil.rmtree(d, ignore_errors=True)  # a stale capture of another world must not mix in
                _launch(label, flags, nproc, d, perturb, args.timeout)
            return _report(dirs[0], dirs[1], args)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    except (ConfigError, CaptureError) as e:
        _error(one_line(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
