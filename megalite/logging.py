"""Rank-aware logging, Megatron's iteration log line, TensorBoard and FLOP counting.

Only the logging rank (the last global rank, which sits on the last pipeline
stage where the loss is known) prints the training log; other ranks report
warnings and errors only. The log line keeps Megatron's keys and number
formats so existing log parsers keep working, and adds tokens per second.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.flight_recorder import RECORDER
from megalite.parallel_state import ParallelState

_FORMAT = "%(message)s"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time of the record, not the stream of setup time
    (a caller that redirects or closes stdout between runs, e.g. a test runner, would break it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(is_logging_rank: bool, rank: int) -> logging.Logger:
    """Configure the ``megalite`` logger for this rank (INFO on the logging rank, else WARNING)."""
    logger = logging.getLogger("megalite")
    logger.handlers.clear()
    handler = _StdoutHandler()
    fmt = _FORMAT if is_logging_rank else f"[rank {rank}] %(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_logging_rank else logging.WARNING)
    logger.propagate = False
    return logger


def mean_over_data_parallel(losses: Sequence[torch.Tensor], ps: ParallelState) -> Optional[float]:
    """Mean of this rank's micro-batch losses, averaged over the replicas, dp x cp (None where no loss
    is computed). A CP rank's loss is its share of the sequence's loss times cp, so the mean over the
    CP ranks is the whole sequence's loss."""
    if not losses:
        return None
    loss = torch.stack(list(losses)).float().mean().reshape(1)
    if ps.dp_cp_size > 1:
        RECORDER.call("dp_cp", dist.all_reduce, loss, group=ps.dp_cp_group)
        loss /= ps.dp_cp_size
    return float(loss)


def loss_from_first_stage(loss: Optional[float], ps: ParallelState) -> Optional[float]:
    """A V-shaped schedule computes the loss on pipeline rank 0: pass it to the last pipeline rank,
    where the log line expects it (None stays None on the ranks in between)."""
    t = torch.tensor([loss if loss is not None else 0.0], device=ps.device)
    RECORDER.call("pp", dist.broadcast, t, ps.pp.ranks[0], group=ps.pp_group)
    return float(t) if ps.is_last_stage or loss is not None else None


def logged_loss(losses: Sequence[torch.Tensor], ps: ParallelState, v_shape: bool) -> Optional[float]:
    """The loss the log line shows: mean micro-batch loss over dp x cp, on the last pipeline rank (None elsewhere).

    A V puts the loss on pipeline rank 0; it is passed to the last pipeline rank, where the
    log line (and every caller) expects it.
    """
    loss = mean_over_data_parallel(losses, ps)
    if v_shape and ps.pp_size > 1:
        loss = loss_from_first_stage(loss, ps)
    return loss


def mean_over_pipeline(value: float, ps: ParallelState) -> float:
    """Mean of a per-stage scalar (e.g. the measured bubble) over the pipeline group."""
    if ps.pp_size == 1:
        return value
    t = torch.tensor([value], device=ps.device)
    RECORDER.call("pp", dist.all_reduce, t, group=ps.pp_group)
    return float(t) / ps.pp_size


def write_timeline(path: str, events: List[dict], ps: ParallelState, **meta) -> None:
    """Gather every pipeline rank's measured events and write the timeline JSON (logging rank)."""
    if ps.pp_size > 1:
        gathered: List[Optional[list]] = [None] * ps.pp_size
        RECORDER.call("pp", dist.all_gather_object, gathered, events, group=ps.pp_group)
        events = [e for part in gathered for e in part]
    if ps.is_logging_rank:
        iteration = meta.pop("iteration", None)
        with open(path, "w") as f:
            json.dump({**meta, "pp": ps.pp_size, "source": "measured", "events": events}, f)
        logging.getLogger("megalite").info(f"wrote pipeline timeline of iteration {iteration} to {path}")


def format_log_line(it: int, train_iters: int, consumed: int, ms_per_iter: float, tflops_per_gpu: float,
                    lr: float, gbs: int, loss: Optional[float], grad_norm: Optional[float], skipped: int,
                    nans: int, tokens_per_s: float, loss_scale: float = 1.0) -> str:
    """Megatron's iteration line (same keys and formats) plus tokens per second."""
    parts = [f" iteration {it:8d}/{train_iters:8d}",
             f" consumed samples: {consumed:12d}",
             f" elapsed time per iteration (ms): {ms_per_iter:.1f}",
             f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.3f}",
             f" learning rate: {lr:.6E}",
             f" global batch size: {gbs:5d}"]
    if loss is not None:
        parts.append(f" lm loss: {loss:.6E}")
    parts.append(f" loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    parts += [f" number of skipped iterations: {skipped:3d}",
              f" number of nan iterations: {nans:3d}",
              f" tokens per second: {tokens_per_s:.1f}"]
    return "".join(part + " |" for part in parts)


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (days as hours), for elapsed time and the ETA."""
    seconds = int(round(max(0.0, seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_timers(times_ms: Dict[str, float]) -> str:
    """One line of per-iteration timer averages (this rank), Megatron's timer names."""
    return "    timers (ms per iteration):" + " |".join(f" {k}: {v:.1f}" for k, v in times_ms.items())


class TensorBoard:
    """Writes the log line's scalars under Megatron's tag names (no-op without a directory)."""

    def __init__(self, log_dir: Optional[str]):
        self.writer = None
        if log_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: "
                                   "pip install tensorboard") from e
            self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, v in values.items():
            if v is not None:
                self.writer.add_scalar(tag, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
