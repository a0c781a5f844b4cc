#!/usr/bin/env python
"""Pretrain a GPT: parse the command line, build the parallel run, train.

    python pretrain_gpt.py                      # small GPT on the default corpus, CPU
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

Exit codes: 0 done (or stopped on request after saving), 1 the run failed (a
non-finite loss, a bad sample, a lost or hung rank), 2 bad flags, data or paths,
128 + N killed by signal N without --exit-signal-handler.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Optional, Sequence

import torch.distributed as dist

from megalite.analysis.plan_check import preflight as plan_preflight
from megalite.checkpointing import CheckpointError
from megalite.checkpointing.save_lock import release_save_locks
from megalite.config import ConfigError
from megalite.config.arguments import parse_args
from megalite.config.checks import check_fault_injection
from megalite.config.preflight import check_output_paths
from megalite.config.validate_fp8 import check_fp8_device
from megalite.data.loading import DatasetError, build_datasets, resolve_data
from megalite.observability.hang_watch import start_hang_watch
from megalite.observability.logging import setup_logging
from megalite.observability.stop_line import say_stop
from megalite.parallel.state import ParallelState
from megalite.training import Trainer, TrainingStopped
from megalite.training.faults import ExitConditions, ExitSignals, InjectedFault, restart_round, watch_launcher

PROG = "pretrain_gpt.py"


def _error(message: str, knows: bool = True, chosen: bool = True) -> None:
    """Why the job stops, said once for the whole job (observability.stop_line: under torchrun the first
    rank that ``knows`` writes it; elsewhere the ``chosen`` rank does)."""
    say_stop(f"{PROG}: error: {message}", knows=knows, chosen=chosen)


def _is_comm_failure(e: RuntimeError) -> bool:
    """A collective or transfer failed because a peer died or hung (gloo reports these as RuntimeError)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        k in text
        for k in (
            "gloo/transport",
            "Timed out waiting",
            "Connection closed by peer",
            "Connection reset by peer",
            "NCCL communicator was aborted",
            "Broken pipe",
        )
    )


def _restart_line(load: Optional[str], iteration: int) -> str:
    """The log line of a round torchrun restarted: which round, and where training resumes."""
    head = (
        f"restart {restart_round()} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} "
        f"(torchrun --max-restarts): "
    )
    if not load:
        return head + "no --load: training starts again from iteration 0 (give --save and --load one directory)"
    if iteration == 0:
        return head + f"no checkpoint in --load {load} yet: training starts again from iteration 0"
    return head + f"resumed from iteration {iteration} of {load}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    start = time.time()  # --exit-duration-in-mins counts from here, as Megatron (startup included)
    rank = os.environ.get("RANK", "0")
    try:
        cfg = resolve_data(parse_args(argv))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _error(str(e), chosen=rank == "0")  # every rank finds the same error: said once
        return 2
    try:
        check_output_paths(cfg)
    except ConfigError as e:
        _error(str(e), chosen=os.environ.get("LOCAL_RANK", "0") == "0")  # paths may differ between nodes
        return 2
    signals = ExitSignals(save_on_signal=cfg.train.exit_signal_handler).install()
    launcher = watch_launcher()
    try:
        return _run(cfg, signals, start)
    except InjectedFault as e:  # --inject-fault-kind exception: this rank's one line; torchrun sees exit 1
        _error(str(e))
        return 1
    except RuntimeError as e:
        if not _is_comm_failure(e):
            raise
        if launcher is not None and launcher.gone():  # a rank that noticed first broke this one's transfer
            launcher.say_gone()
            return 1
        # A peer died or hung past --distributed-timeout-minutes: one line for the job, no traceback.
        first = re.sub(r"^\[[^\]]*\] ", "", (str(e).strip() or type(e).__name__).splitlines()[0])
        first = first.split(". ")[0]  # gloo appends generic advice after the first sentence
        if signals.watch is not None:  # before the line: the ranks that can still talk name the culprit
            signals.watch.on_failure(f"rank {rank}: {first[:80]}")
        # once for the job: the first rank that saw it (the hang watch's diagnosis names the lost rank)
        _error(
            f"rank {rank}: lost contact with another rank ({first[:160]}); the job cannot go on "
            f"(a rank that died first has its own message above)"
        )
        return 1
    finally:
        release_save_locks()  # an in-process run (tests, tools) must not keep --save locked
        if signals.watch is not None:
            signals.watch.stop()
        signals.uninstall()


def _run(cfg, signals: ExitSignals, start: float) -> int:
    par = cfg.parallel
    ps = ParallelState.from_config(cfg)  # the expert groups too, when the model has experts
    log = setup_logging(ps.is_logging_rank, ps.rank)
    start_hang_watch(cfg, ps, signals)  # flight recorder, SIGUSR1, diagnosis of a hang or a signal
    try:
        check_fault_injection(cfg.train, ps.world_size)
        check_fp8_device(cfg.model, ps.device)
    except ConfigError as e:
        _error(str(e), chosen=ps.rank == 0)
        ps.destroy()
        return 2
    m = cfg.model
    cp = f" x cp {ps.cp_size}" if ps.cp_size > 1 else ""
    log.info(
        f"megalite: world {ps.world_size} = tp {ps.tp_size}{cp} x dp {ps.dp_size} x pp {ps.pp_size} "
        f"(vp {par.vp}), backend {ps.backend or 'none'}, device {ps.device}"
    )
    log.info(
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}, "
        f"seq {m.seq_length}, vocab {m.vocab_size}; data: "
        f"{'mock' if cfg.data.mock_data else ' '.join(cfg.data.data_path or cfg.data.train_data_path)}"
    )
    refused = plan_preflight(cfg, ps)  # --plan-check: a layout that cannot fit stops every rank, one line
    if refused is not None:
        _error(str(refused), knows=refused.report)
        ps.destroy()
        return 2
    trainer = Trainer(cfg, ps)
    if cfg.checkpoint.load or cfg.checkpoint.save:  # a locked --save is refused here, before any iteration
        try:
            loaded = trainer.checkpointer.load()
        except CheckpointError as e:
            _error(str(e), knows=getattr(e, "report", True))  # the others wait for its line
            ps.destroy()
            return 2
        if loaded is None and cfg.train.skip_train and cfg.checkpoint.load:  # every rank finds the same
            _error(f"--skip-train: --load {cfg.checkpoint.load} holds no checkpoint to evaluate", chosen=ps.rank == 0)
            ps.destroy()
            return 2
    if restart_round() > 0:  # torchrun --max-restarts started this round after a failed one
        log.info(_restart_line(cfg.checkpoint.load, trainer.state.iteration))
    n_params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    log.info(
        f"schedule {trainer.schedule_name}, {trainer.m} micro-batches per step; parameters on this rank: {n_params:,}"
    )
    try:
        datasets = build_datasets(cfg, ps)
    except DatasetError as e:  # bad data files, split or caches: every rank stops, one says why
        _error(str(e), knows=e.report)
        ps.destroy()
        return 2
    try:
        trainer.train(
            datasets.train,
            datasets.valid,
            ExitConditions(signals, cfg.train.exit_duration_in_mins, start),
            test_ds=datasets.test,
        )
    except TrainingStopped as e:
        _error(str(e), knows=e.report)  # the rank that knows the problem says it once
        ps.destroy()
        return 1
    except CheckpointError as e:  # a save failed (a full disk...): latest still names the previous checkpoint
        _error(str(e), knows=getattr(e, "report", True))
        ps.destroy()
        return 1
    ps.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
