"""Looking at a run from outside: torch.profiler traces, the CUDA memory snapshot, Weights & Biases.

Megatron's flags, with its meaning of the step range: ``--profile-step-start 10 --profile-step-end 12``
traces the iterations after the 10th, up to the 12th (the log lines' iterations 11 and 12), on the
ranks in ``--profile-ranks``. Each traced rank writes one Chrome/Perfetto trace (chrome://tracing,
ui.perfetto.dev, TensorBoard's profiler plugin) named ``rank<R>_iter<A>-<B>.pt.trace.json`` under
--profile-dir (default --tensorboard-dir, as Megatron, else ./profile); every iteration is a
``ProfilerStep#<iteration>`` span. Shapes are recorded, Python stacks are not (the traces stay small).

``--record-memory-history`` records the CUDA caching allocator's history on the last rank and writes
the snapshot (torch.cuda.memory._dump_snapshot; pytorch.org/memory_viz) at each log line and at the
end; on CPU it says so once and the run goes on.

``--wandb-project`` logs the scalars TensorBoard gets, on the logging rank, offline (``wandb sync``
later) when no API key is configured. wandb is optional: asking for it without it installed is a
one-line error before anything starts.
"""

from __future__ import annotations

import logging
import netrc
import os
from dataclasses import asdict
from typing import Dict, Optional

import torch

from megalite.config import Config, LoggingConfig
from megalite.config.checks import require_wandb
from megalite.parallel.state import ParallelState

logger = logging.getLogger("megalite")


def trace_dir(lg: LoggingConfig) -> str:
    return lg.profile_dir or lg.tensorboard_dir or "profile"


class Profiler:
    """--profile and --record-memory-history for one rank: the trainer calls ``before_step``/``after_step``
    around every iteration, ``log_interval`` at each log line and ``close`` at the end (whatever stopped it)."""

    def __init__(self, lg: LoggingConfig, ps: ParallelState):
        self.start_it, self.end_it = lg.profile_step_start, lg.profile_step_end
        self.traced = lg.profile and ps.rank in lg.profile_ranks
        self.dir, self.rank = trace_dir(lg), ps.rank
        self.prof = None
        self.first: Optional[int] = None
        self.written: Optional[str] = None
        self.snapshot_path: Optional[str] = None
        if lg.record_memory_history and ps.is_logging_rank:
            if ps.device.type != "cuda":
                logger.warning(f"--record-memory-history: the memory snapshot is CUDA-only; none on {ps.device.type}")
            else:
                torch.cuda.memory._record_memory_history(max_entries=100000)
                self.snapshot_path = lg.memory_snapshot_path

    @property
    def tracing(self) -> bool:
        return self.prof is not None

    def before_step(self, done: int) -> None:
        """``done`` iterations are complete: start tracing if the next one is in the range."""
        if not self.traced or self.prof is not None or self.written or not self.start_it <= done < self.end_it:
            return
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # a schedule that always records: with one, each iteration becomes a ProfilerStep#<n> span
        self.prof = profile(
            activities=activities, record_shapes=True, with_stack=False, schedule=lambda _step: ProfilerAction.RECORD
        )
        self.prof.step_num = done + 1  # spans named by the iteration numbers of the log
        self.first = done + 1
        self.prof.start()

    def after_step(self, done: int) -> None:
        """Iteration ``done`` finished: next span, or the end of the range (stop and write)."""
        if self.prof is None:
            return
        if done >= self.end_it:
            self._write(done)
        else:
            self.prof.step()

    def log_interval(self) -> None:
        if self.snapshot_path:
            self._dump_snapshot()

    def close(self, done: int) -> None:
        """End of the run: a trace cut short by an early stop is written with what it has."""
        if self.prof is not None:
            self._write(done)
        if self.snapshot_path:
            self._dump_snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_path = None

    def _write(self, last: int) -> None:
        prof, self.prof = self.prof, None
        prof.stop()
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank{self.rank}_iter{self.first}-{last}.pt.trace.json")
        prof.export_chrome_trace(path)
        self.written = path

    def _dump_snapshot(self) -> None:
        parent = os.path.dirname(self.snapshot_path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        torch.cuda.memory._dump_snapshot(self.snapshot_path)


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbWriter:
    """The TensorBoard scalars, to a wandb run (logging rank only; a no-op without --wandb-project)."""

    def __init__(self, cfg: Config, enabled: bool):
        self.run = None
        lg = cfg.logging
        if not (enabled and lg.wandb_project):
            return
        wandb = require_wandb()
        save_dir = lg.wandb_save_dir or (os.path.join(cfg.checkpoint.save, "wandb") if cfg.checkpoint.save else "wandb")
        os.makedirs(save_dir, exist_ok=True)
        offline = "WANDB_MODE" not in os.environ and not _has_api_key()
        config = {f"{section}.{k}": v for section, values in asdict(cfg).items() for k, v in values.items()}
        self.run = wandb.init(
            project=lg.wandb_project,
            name=lg.wandb_exp_name,
            dir=save_dir,
            config=config,
            mode="offline" if offline else None,
        )
        if offline:
            logger.info(
                f"wandb: no API key, logging offline to {self.run.dir} (upload later: wandb sync "
                f"{os.path.dirname(self.run.dir)})"
            )

    def scalars(self, values: Dict[str, Optional[float]], step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
