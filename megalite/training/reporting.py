"""What a run says: Megatron's iteration log line and timers, validation lines, TensorBoard (and wandb),
stragglers, the summary; it also drives --profile around each iteration.

The logging rank (the last global rank) prints; every rank takes part in the few collectives
a log interval needs (the bubble mean over the pipeline, the one-time GPU memory report, the
straggler gather). Time spent evaluating or saving is not counted as iteration time.

A mixture of experts adds Megatron-LM's MoE fields: the balancing losses (without their coefficients,
mean over MoE layers) and the routed tokens per expert. Their statistics restart every iteration, so
every rank reduces them every iteration (``reduce_moe_stats``, one all-reduce over the world) and the
log line shows their mean over the interval, as Megatron's total_loss_dict does. So are the skipped and nan
iterations: the interval's count, reset at each log line as Megatron's (the run's totals stay in TrainState
and the checkpoint), so tools that read Megatron's logs read megalite's alike.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Dict, List, Optional, Sequence

import torch

from megalite.config import Config
from megalite.data.builder import default_cache_dir
from megalite.model.compile import CompileWatch
from megalite.moe import moe_layers
from megalite.moe.metrics import reduce_moe_stats
from megalite.observability.logging import (
    TensorBoard,
    format_duration,
    format_log_line,
    format_moe_fields,
    format_moe_layers,
    format_timers,
    mean_over_pipeline,
    moe_tensorboard,
)
from megalite.observability.profiling import Profiler, WandbWriter, trace_dir
from megalite.observability.stragglers import StragglerMonitor, rank_work
from megalite.observability.throughput import (
    Throughput,
    device_peak_tflops,
    gather_memory_report,
    memory_scalars,
    memory_stats,
)
from megalite.parallel.state import ParallelState
from megalite.training.evaluation import EvalResult
from megalite.training.state import TrainState

logger = logging.getLogger("megalite")
_TIMERS = (
    ("forward", "forward-compute"),
    ("backward", "backward-compute"),
    ("p2p", "p2p-wait"),
    ("grads_sync", "grads-all-reduce"),
    ("optimizer", "optimizer"),
)


class Reporter:
    """Collects each iteration's scalars and logs them every --log-interval (and at the last iteration)."""

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        state: TrainState,
        padded_vocab: int,
        has_scaler: bool,
        chunks: Sequence[torch.nn.Module] = (),
    ):
        self.cfg, self.ps, self.state, self.has_scaler = cfg, ps, state, has_scaler
        t, lg = cfg.train, cfg.logging
        self.tb = TensorBoard(lg.tensorboard_dir if ps.is_logging_rank else None)
        self.wandb = WandbWriter(cfg, ps.is_logging_rank)
        self.profiler = Profiler(lg, ps)
        # a collective (hostnames) when on: built at the same point on every rank
        self.stragglers = StragglerMonitor(
            lg.straggler_threshold, ps, rank_work(chunks, cfg.model) if chunks else 0.0, lg.log_interval, t.train_iters
        )
        self.flops = Throughput(
            cfg.model,
            t.global_batch_size,
            padded_vocab,
            ps.world_size,
            num_chunks=ps.pp_size * cfg.parallel.vp,
            peak_tflops=device_peak_tflops(ps.device, cfg.logging.peak_tflops),
        )
        # MoE: this rank's layers (possibly none: the reduction is over the world, every rank joins it)
        self.moe = moe_layers(chunks) if cfg.model.is_moe and chunks else None
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * ps.dp_size)
        self.memory_reported = False  # Megatron reports GPU memory once, after the first logged iterations
        self.history: List[Dict[str, float]] = []
        self.window: List[Dict[str, float]] = []
        self.run_start = self.t_last = time.perf_counter()
        self.first_iteration = state.iteration
        # --compile: compile time of the first iteration, then every recompilation (rank 0's own counts)
        self.compile_watch = CompileWatch() if cfg.model.torch_compile and ps.is_logging_rank else None
        self.last_logged = (state.iteration, None)  # (iteration, lm loss) of the last log line
        self.valid_loss: Optional[float] = None
        self.test_loss: Optional[float] = None

    def due(self, iteration: int) -> bool:
        return iteration % self.cfg.logging.log_interval == 0 or iteration == self.cfg.train.train_iters

    def before_step(self) -> bool:
        """An iteration starts: --profile may start tracing. True: time its actions with a device sync
        (CUDA, the iterations the straggler check uses)."""
        self.profiler.before_step(self.state.iteration)
        return self.stragglers.cuda and self.stragglers.timed(self.state.iteration + 1)

    def step(self, out: Dict[str, float], events: Sequence[dict] = ()) -> None:
        """Record the iteration just done (``events``: its executor events, for the straggler check); log the
        window when the interval is due (collective then)."""
        if not self.profiler.tracing:  # a traced iteration is slower on the traced ranks only
            self.stragglers.record(events, self.state.iteration)
        else:
            self.stragglers.pause()
        self.profiler.after_step(self.state.iteration)
        for line in self.compile_watch.after_step(self.state.iteration) if self.compile_watch else ():
            logger.info(line)
        if self.moe is not None:  # collective, every iteration: the layers' statistics restart now
            out = {**out, "moe": reduce_moe_stats(self.moe, self.ps, self.num_microbatches, self.cfg.model)}
            for layer in self.moe:
                layer.reset_stats()
        self.history.append(out)
        self.window.append(out)
        if self.due(self.state.iteration):
            self._log((time.perf_counter() - self.t_last) / len(self.window))
            self.window = []
            self.pause()

    def pause(self) -> None:
        """Evaluation, a save or the log line just ran: the next interval's time starts now."""
        self.t_last = time.perf_counter()
        self.stragglers.pause()

    def _log(self, sec_per_iter: float) -> None:
        t, it, window = self.cfg.train, self.state.iteration, self.window
        losses = [w["loss"] for w in window if w["loss"] is not None]
        loss = sum(losses) / len(losses) if losses else None
        bubble = mean_over_pipeline(sum(w["bubble"] for w in window) / len(window), self.ps)
        memory_lines = [] if self.memory_reported else gather_memory_report(self.ps, it)  # collective
        self.memory_reported = True
        rows = self.stragglers.check()  # collective (when on)
        self.profiler.log_interval()
        if not self.ps.is_logging_rank:
            return
        self.last_logged = (it, loss)
        figures = self.flops.figures(sec_per_iter)
        last = window[-1]
        moe = self._moe_means()
        run_time = time.perf_counter() - self.run_start
        eta = run_time / (it - self.first_iteration) * (t.train_iters - it)
        logger.info(
            format_log_line(
                it,
                t.train_iters,
                self.state.consumed_samples,
                sec_per_iter * 1e3,
                figures["tflops"],
                last["lr"],
                t.global_batch_size,
                loss,
                last["grad_norm"],
                sum(not w.get("updated", True) for w in window),  # per interval, as Megatron (it resets both)
                sum(w["loss"] is not None and not math.isfinite(w["loss"]) for w in window),
                figures["tokens_per_s"],
                last["loss_scale"],
                format_moe_fields(moe) if moe else "",
            )
            + self.flops.log_fields(figures)
            + f" elapsed: {format_duration(run_time)} | ETA: {format_duration(eta)} |"
        )
        if moe and self.cfg.logging.moe_per_layer_logging:
            logger.info("\n".join(format_moe_layers(moe)))
        for line in memory_lines:
            logger.info(line)
        if self.cfg.logging.log_timers:
            times = {name: 1e3 * sum(w[k] for w in window) / len(window) for k, name in _TIMERS}
            logger.info(format_timers(times) + f" | pipeline bubble: {100 * float(bubble):.1f}%")
        spread = self.stragglers.report(rows)  # names the stragglers
        scalars = {"loss-scale": last["loss_scale"]} if self.has_scaler else {}
        self._scalars(
            {
                **scalars,
                "lm loss": loss,
                "learning-rate": last["lr"],
                "grad-norm": last["grad_norm"],
                "batch-size": t.global_batch_size,
                "iteration-time": sec_per_iter,
                **self.flops.tensorboard(figures),
                **memory_scalars(memory_stats(self.ps.device)),
                **spread,
                **(moe_tensorboard(moe, self.cfg.logging.moe_per_layer_logging) if moe else {}),
            },
            it,
        )

    def _moe_means(self) -> Dict[str, float]:
        """Each MoE figure's mean over the interval's iterations ({} for a dense model)."""
        rows = [w["moe"] for w in self.window if w.get("moe")]
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}

    def _scalars(self, values: Dict[str, Optional[float]], step: int) -> None:
        self.tb.scalars(values, step)
        self.wandb.scalars(values, step)

    def evaluation(self, result: Optional[EvalResult]) -> None:
        """Megatron's validation lines (and TensorBoard points) for an evaluation's result."""
        self.pause()
        for line in self.compile_watch.after_evaluation(self.state.iteration) if self.compile_watch else ():
            logger.info(line)
        if result is None or result.loss is None or not self.ps.is_logging_rank:
            return
        loss = result.loss
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        if result.split == "validation":
            self.valid_loss = loss
            where = "the end of training for val data" if result.at_end else f"iteration {self.state.iteration}"
        else:
            self.test_loss, where = loss, "the end of training for test data"
        line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        logger.info("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        key = "lm loss validation" if result.split == "validation" else "lm loss test"
        if not self.cfg.train.skip_train:  # as Megatron: an evaluation-only run adds no point to the curves
            self._scalars({key: loss, key + " ppl": ppl}, self.state.iteration)

    def summary(self, stop_reason: Optional[str], saved_at: Optional[int], timeline: Optional[str]) -> None:
        """The last lines of a run: what was done and where its outputs went."""
        self.tb.close()
        self.wandb.close()
        self.profiler.close(self.state.iteration)
        if not self.ps.is_logging_rank:
            return
        cfg, t, it = self.cfg, self.cfg.train, self.state.iteration
        iters = it - self.first_iteration
        # the number the last log line printed; iterations after it (an early stop) are averaged instead
        logged_at, logged = self.last_logged
        unlogged = self.history[len(self.history) - (it - logged_at) :] if logged_at < it else []
        losses = [h["loss"] for h in unlogged if h["loss"] is not None] or ([logged] if logged is not None else [])
        tokens = iters * t.global_batch_size * cfg.model.seq_length
        status = "skipped (--skip-train)" if t.skip_train else f"stopped ({stop_reason})" if stop_reason else "done"
        lines = [
            f"training {status}: {iters} iterations ({it} in all), {tokens:,} tokens in "
            f"{format_duration(time.perf_counter() - self.run_start)}"
            + (f"; final lm loss {sum(losses) / len(losses):.4f}" if losses else "")
            + (f", validation lm loss {self.valid_loss:.4f}" if self.valid_loss is not None else "")
            + (f", test lm loss {self.test_loss:.4f}" if self.test_loss is not None else "")
        ]
        if cfg.checkpoint.save and saved_at is not None:
            lines.append(f"  checkpoint: {cfg.checkpoint.save} (iteration {saved_at})")
        if cfg.logging.tensorboard_dir:
            lines.append(f"  tensorboard: {cfg.logging.tensorboard_dir}")
        if timeline:
            lines.append(f"  pipeline timeline: {timeline}")
        lines += self._profile_lines()
        lines += self._cache_line()
        logger.info("\n".join(lines))

    def _profile_lines(self) -> List[str]:
        lg = self.cfg.logging
        lines = []
        if lg.profile and self.first_iteration < lg.profile_step_end and self.state.iteration > lg.profile_step_start:
            lines.append(
                f"  profiler traces: {trace_dir(lg)} (ranks {', '.join(map(str, lg.profile_ranks))}, "
                f"iterations {max(lg.profile_step_start, self.first_iteration) + 1}-"
                f"{min(lg.profile_step_end, self.state.iteration)})"
            )
        if lg.record_memory_history and self.ps.device.type == "cuda":
            lines.append(f"  memory snapshot: {lg.memory_snapshot_path}")
        return lines

    def _cache_line(self) -> List[str]:
        data = self.cfg.data
        if data.mock_data:
            return []
        paths = data.data_path or data.train_data_path
        prefix = next((p for p in paths if not p.replace(".", "", 1).isdigit()), None)
        if not (data.data_cache_path or prefix):
            return []
        return [f"  data index cache: {data.data_cache_path or os.path.dirname(default_cache_dir(prefix, 'x'))}"]
