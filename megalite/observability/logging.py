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

from megalite.parallel.state import ParallelState

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
        ps.recorder.call("dp_cp", dist.all_reduce, loss, group=ps.dp_cp_group)
        loss /= ps.dp_cp_size
    return float(loss)


def loss_from_first_stage(loss: Optional[float], ps: ParallelState) -> Optional[float]:
    """A V-shaped schedule computes the loss on pipeline rank 0: pass it to the last pipeline rank,
    where the log line expects it (None stays None on the ranks in between)."""
    t = torch.tensor([loss if loss is not None else 0.0], device=ps.device)
    ps.recorder.call("pp", dist.broadcast, t, ps.pp.ranks[0], group=ps.pp_group)
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
    ps.recorder.call("pp", dist.all_reduce, t, group=ps.pp_group)
    return float(t) / ps.pp_size


def write_timeline(path: str, events: List[dict], ps: ParallelState, **meta) -> None:
    """Gather every pipeline rank's measured events and write the timeline JSON (logging rank)."""
    if ps.pp_size > 1:
        gathered: List[Optional[list]] = [None] * ps.pp_size
        ps.recorder.call("pp", dist.all_gather_object, gathered, events, group=ps.pp_group)
        events = [e for part in gathered for e in part]
    if ps.is_logging_rank:
        iteration = meta.pop("iteration", None)
        with open(path, "w") as f:
            json.dump({**meta, "pp": ps.pp_size, "source": "measured", "events": events}, f)
        logging.getLogger("megalite").info(f"wrote pipeline timeline of iteration {iteration} to {path}")


def format_log_line(
    it: int,
    train_iters: int,
    consumed: int,
    ms_per_iter: float,
    tflops_per_gpu: float,
    lr: float,
    gbs: int,
    loss: Optional[float],
    grad_norm: Optional[float],
    skipped: int,
    nans: int,
    tokens_per_s: float,
    loss_scale: float = 1.0,
    after_loss: str = "",
) -> str:
    """Megatron's iteration line (same keys and formats) plus tokens per second; ``after_loss``: fields
    that follow the lm loss (an MoE's, :func:`format_moe_fields`), as Megatron places them."""
    parts = [
        f" iteration {it:8d}/{train_iters:8d}",
        f" consumed samples: {consumed:12d}",
        f" elapsed time per iteration (ms): {ms_per_iter:.1f}",
        f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.3f}",
        f" learning rate: {lr:.6E}",
        f" global batch size: {gbs:5d}",
    ]
    if loss is not None:
        parts.append(f" lm loss: {loss:.6E}")
    head = "".join(part + " |" for part in parts) + after_loss
    parts = [f" loss scale: {loss_scale:.1f}"]
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    parts += [
        f" number of skipped iterations: {skipped:3d}",
        f" number of nan iterations: {nans:3d}",
        f" tokens per second: {tokens_per_s:.1f}",
    ]
    return head + "".join(part + " |" for part in parts)


MOE_TOKENS = ("tokens_per_expert_min", "tokens_per_expert_mean", "tokens_per_expert_max")


def format_moe_fields(values: Dict[str, float]) -> str:
    """An MoE's fields of the log line, from the interval's mean of ``reduce_moe_stats``' figures.

    Megatron-LM's formats: its losses (``load_balancing_loss``, ``z_loss``, ... : names ending in
    "loss") as the lm loss, ``' {name}: {value:.6E} |'``; its other MoE metrics ``' {name}: {value:.2f} |'``
    (here the routed tokens per expert: min, mean and max over the experts, averaged over MoE layers).
    Per-layer figures (keys ``"<name> layer <i>"``) go to TensorBoard and :func:`format_moe_layers`.
    """
    losses = [k for k in values if k.endswith("loss") and " layer " not in k]
    out = "".join(f" {k}: {values[k]:.6E} |" for k in losses)
    return out + "".join(f" {k}: {values[k]:.2f} |" for k in MOE_TOKENS if k in values)


def moe_layer_values(values: Dict[str, float]) -> Dict[int, Dict[str, float]]:
    """``{layer: {name: value}}`` from the ``"<name> layer <i>"`` keys of ``reduce_moe_stats``."""
    out: Dict[int, Dict[str, float]] = {}
    for key, v in values.items():
        name, sep, layer = key.rpartition(" layer ")
        if sep and layer.isdigit():
            out.setdefault(int(layer), {})[name] = v
    return dict(sorted(out.items()))


def format_moe_layers(values: Dict[str, float]) -> List[str]:
    """--moe-per-layer-logging's lines under the iteration line: one per MoE layer (0-based global index)."""
    return [
        f"    moe layer {i}:"
        + "".join(f" {k}: {v:.6E} |" if k.endswith("loss") else f" {k}: {v:.2f} |" for k, v in per.items())
        for i, per in moe_layer_values(values).items()
    ]


def moe_tensorboard(values: Dict[str, float], per_layer: bool) -> Dict[str, float]:
    """TensorBoard tags as Megatron-LM's MoE tracker writes them: the losses (and tokens per expert)
    under their names; with per-layer logging each MoE layer's as ``moe/<name>_layer_<i>``."""
    out = {k: v for k, v in values.items() if " layer " not in k}
    if per_layer:
        for i, per in moe_layer_values(values).items():
            out.update({f"moe/{k}_layer_{i}": v for k, v in per.items()})
    return out


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
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from e
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
