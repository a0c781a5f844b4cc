"""Build one rank's part of a run from a Config and a ParallelState, then sequence its iterations.

::

    Trainer
      chunks        this rank's model chunks (one per virtual pipeline stage)
      executor      runs the schedule's actions for one global batch
      optimizer     MegatronOptimizer: grad buffer, main weights, finalize, clip, loss scale, step
      scheduler     LRScheduler
      state         TrainState: iteration, consumed samples, skipped and nan iterations
      checkpointer  Checkpointer: when to save, save, load (explicit state objects)
      evaluator     Evaluator: when to evaluate, the forward-only schedule
      stops         StopRules: non-finite values, --exit-interval, signals and time limit

One iteration: zero grads -> run the schedule over m micro-batches ->
optimizer.finalize_grads() -> optimizer.step() (skipped on overflow or a
non-finite norm; then the LR schedule does not advance, as Megatron) ->
checkpointer.poll() (publishes a finished --async-save write) -> stop rules -> log
-> evaluate / save when due. A save with --async-save blocks only for its snapshot;
the next save and the end of the run (``_finish``, whatever stopped it) wait for it.
The Trainer only sequences: each component owns its own interval rule, the
collectives live in the optimizer layer, logging.py and agreement.py.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import replace
from typing import Dict, List, Optional

import torch

from megalite.analysis.measure import balance_stages  # the composition root may use analysis
from megalite.analysis.plan_check import PlanCheck, timeline_meta
from megalite.checkpointing.manager import Checkpointer
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.run_state import saved_stage_layers
from megalite.config import Config
from megalite.config.checks import check_layout_matches
from megalite.config.settings import RunSettings, resolve_settings
from megalite.context_parallel.kernels import describe
from megalite.data.batches import MicroBatches, sequence_options
from megalite.data_parallel.fsdp import FSDPGrads, shard_chunks
from megalite.interop import checkpoint_formats
from megalite.model.compile import describe as describe_compile
from megalite.model.gpt import GPTModel
from megalite.moe import moe_layers, update_expert_bias
from megalite.observability.logging import logged_loss, write_timeline
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.optimizer import MegatronOptimizer
from megalite.parallel.state import ParallelState
from megalite.pipeline.executor import PipelineExecutor, StepStats
from megalite.pipeline.registry import build_schedule
from megalite.pipeline.stage_layout import StageLayout
from megalite.tensor_parallel.fp8 import check_scaled_mm, describe_fp8, fp8_recipe_of
from megalite.tensor_parallel.random import RNGTracker
from megalite.training.evaluation import Evaluator
from megalite.training.faults import ExitConditions, inject_fault
from megalite.training.reporting import Reporter
from megalite.training.state import TrainState
from megalite.training.stops import StopRules, TrainingStopped, check_tokens

logger = logging.getLogger("megalite")
__all__ = ["Trainer", "TrainingStopped", "build_model_chunks"]


def build_model_chunks(cfg: Config, ps: ParallelState, tracker: RNGTracker, layout: StageLayout) -> List[GPTModel]:
    """This rank's chunks: chunk c runs the global stage ``layout`` gives it
    (c*pp + pp_rank interleaved; pp_rank and 2pp-1-pp_rank in a V)."""
    par, chunks = cfg.parallel, []
    for c in range(par.vp):
        stage = layout.stage(ps.pp_rank, c)
        layers = layout.layers(
            cfg.model.num_layers,
            ps.pp_rank,
            c,
            par.decoder_first_pipeline_num_layers,
            par.decoder_last_pipeline_num_layers,
            par.pipeline_stage_layers,
        )
        chunks.append(
            GPTModel(
                cfg.model,
                ps,
                tracker,
                cfg.train.seed,
                layers,
                pre_process=stage == 0,
                post_process=stage == layout.num_stages - 1,
                sequence_parallel=par.sequence_parallel,
                cp_comm_type=par.cp_comm_type,
                moe_dispatcher=par.moe_token_dispatcher_type,
            ).to(ps.device)
        )
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process and not c.pre_process]
    if cfg.model.tied_embeddings and first and last:  # first and last stage on this rank (a V)
        last[0].tie_output_to(first[0])
    return chunks


def shard_data_parallel(cfg: Config, ps: ParallelState, chunks: List[GPTModel]) -> Optional[FSDPGrads]:
    """--data-parallel-sharding-strategy optim_grads / optim_grads_params: the chunks under FSDP2 (None: the
    grad buffers do the data-parallel work, as with one replica, where there is nothing to shard)."""
    o = cfg.optim
    if ps.is_logging_rank and o.sharding != "no_shard":
        replicas = f"{ps.dp_cp_size} data-parallel x context-parallel ranks"
        logger.info(f"data-parallel sharding: {o.sharding} over {replicas}" + (" (FSDP2)" if o.fsdp else ""))
    if not o.fsdp or ps.dp_cp_size == 1:
        return None
    return shard_chunks(chunks, ps, cfg)


def resolve_stage_split(cfg: Config, ps: ParallelState, settings: RunSettings) -> Config:
    """--pipeline-balance measured: the split of layers to train with, in the config (checkpoints store it).

    A resumed run keeps the split its checkpoint was balanced with (timing noise could choose
    another, which a torch-format checkpoint refuses); otherwise the layer kinds are timed on
    this device and the simulator picks the split (a collective).
    """
    par, ck = cfg.parallel, cfg.checkpoint
    if par.pipeline_balance != "measured" or par.pipeline_stage_layers is not None:
        return cfg
    saved = saved_stage_layers(ck.load, ck.ckpt_step, ps.pp_size, par.vp) if ck.load and not ck.finetune else None
    if saved is None:
        return balance_stages(cfg, ps, settings)
    if ps.is_logging_rank:
        logger.info(f"--pipeline-balance measured: resuming with the checkpoint's split {','.join(map(str, saved))}")
    return cfg.with_(parallel=replace(par, pipeline_stage_layers=saved))


def _run_forward_only(executor: PipelineExecutor, actions: list, m: int, batches: list) -> list:
    """One global batch forward only (evaluation) through ``actions``; this rank's micro-batch losses."""
    return executor.run(actions, lambda mb: batches[mb], m, forward_only=True).losses


def _log_kernels(m, ps: ParallelState) -> None:
    """Which attention kernels run (kernels.py; a fallback warns once when it happens) and, with FP8, its start
    line; every rank probes its own GPU's FP8 GEMM once, eagerly (a failing kernel: one warning, emulated)."""
    if ps.is_logging_rank:
        logger.info(describe(m.attention_backend, ps.device, m.torch_dtype, m.head_dim))
        if m.fp8_format is not None:
            logger.info(describe_fp8(m, ps.device))
    if m.fp8_format is not None:
        why = check_scaled_mm(ps.device, fp8_recipe_of(m))
        if why:
            logger.warning(why)


class Trainer:
    """Everything one rank needs to train: model chunks, optimizer, schedule, counters, and the
    components that decide when to log, evaluate, save and stop."""

    def __init__(self, cfg: Config, ps: ParallelState):
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        check_layout_matches(
            cfg,
            ps.tp_size,
            ps.pp_size,
            ps.cp_size,
            ps.ep_size if cfg.model.is_moe else 1,
            ps.etp_size if cfg.model.is_moe else 1,
        )
        settings = resolve_settings(cfg, ps.world_size)
        balanced = resolve_stage_split(cfg, ps, settings)
        if balanced is not cfg:
            cfg, settings = balanced, resolve_settings(balanced, ps.world_size)
        self.cfg, self.settings, self.ps, t, par = cfg, settings, ps, cfg.train, cfg.parallel
        self.m, self.schedule_name, layout = settings.num_microbatches, settings.schedule, settings.layout
        self.tracker = RNGTracker(t.seed, ps.tp_rank, ps.pp_rank, ps.device)
        _log_kernels(cfg.model, ps)
        self.chunks = build_model_chunks(cfg, ps, self.tracker, layout)
        if cfg.model.torch_compile and ps.is_logging_rank:
            layers, moe = sum(len(c.decoder.layers) for c in self.chunks), len(moe_layers(self.chunks))
            skipped, recompute = self.chunks[0].compile_skipped, cfg.model.recompute_granularity
            logger.info(describe_compile(layers, moe, skipped, recompute, pipeline=ps.pp_size > 1))
        grads = shard_data_parallel(cfg, ps, self.chunks)  # FSDP2: replaces the parameters (before they are read)
        named = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.params = [p for _, p in named]
        shared = [w for w in (c.shared_embedding_weight() for c in self.chunks) if w is not None]
        self.optimizer = MegatronOptimizer(
            named,
            cfg.optim,
            ps,
            shared=shared,
            sequence_parallel_params=[p for p in self.params if getattr(p, "sequence_parallel", False)],
            moe=cfg.model.is_moe,
            grads=grads,
        )
        self.optimizer.install_param_gather_hooks(self.chunks)
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, t.train_iters)
        self.actions, self.eval_actions = (
            build_schedule(
                self.schedule_name,
                ps.pp_size,
                par.vp,
                self.m,
                forward_only=fwd,
                overlap_p2p=par.overlap_p2p_comm or par.overlap_moe_expert_parallel_comm,
            )[ps.pp_rank]
            for fwd in (False, True)
        )
        s = cfg.model.seq_length // ps.cp_size // (ps.tp_size if par.sequence_parallel else 1)  # p2p shape
        self.executor = PipelineExecutor(
            self.chunks, ps, (s, t.micro_batch_size, cfg.model.hidden_size), dtype=cfg.model.torch_dtype, layout=layout
        )
        if par.overlap_moe_expert_parallel_comm:  # DualPipeV's F/B pairs side by side (executor.py)
            ps.init_shadow_groups()
            self.executor.pair_forward_backward = True
        # packed documents: every stage's attention (and RoPE) reads the micro-batch's segments (positions)
        d = cfg.data
        self.needs_data = (
            any(c.pre_process or c.post_process for c in self.chunks)
            or d.reset_attention_mask
            or (d.reset_position_ids and cfg.model.position_embedding_type == "rope")
        )
        self.sequence = sequence_options(cfg, ps)  # packed documents / CP chunks of each micro-batch
        self.state = TrainState()
        self.last_stats: Optional[StepStats] = None
        self.run_parts = RunParts(cfg, ps, self.chunks, self.optimizer, self.scheduler, self.state, self.tracker)
        self.checkpointer = Checkpointer(self.run_parts, checkpoint_formats())  # with Megatron's torch_dist
        # functions of the parts, not bound methods of self: a Trainer in a cycle with its evaluator would keep
        # the model's memory after the caller dropped it, until Python's cycle collector happened to run
        fwd = functools.partial(_run_forward_only, self.executor, self.eval_actions, self.m)
        loss = functools.partial(logged_loss, ps=ps, v_shape=self.executor.layout.v_shape)
        self.evaluator = Evaluator(cfg, ps, self.chunks, self.m, self.needs_data, fwd, loss)
        self.plan_check = PlanCheck(cfg, ps, settings)  # --plan-check: the planner's figures beside the measured

    # -- one iteration ---------------------------------------------------------------------------
    def train_step(self, batches: List[Optional[Dict[str, torch.Tensor]]]) -> Dict[str, float]:
        """Forward/backward over all micro-batches, finalize, clip and update. Returns scalars."""
        for c in self.chunks:
            c.train()
        self.optimizer.zero_grad(self.m)
        self.ps.recorder.enter_phase("schedule")  # the flight recorder's phases (hang diagnosis)
        stats = self.executor.run(self.actions, lambda mb: batches[mb], self.m, loss_scale=self.optimizer.loss_scale)
        t0 = time.perf_counter()
        self.ps.recorder.enter_phase("grad reduce")
        self.optimizer.finalize_grads()
        t1 = time.perf_counter()
        self.ps.recorder.enter_phase("optimizer")
        updated, grad_norm = self.optimizer.step()
        if self.cfg.model.moe_router_enable_expert_bias:  # DeepSeek-V3 balancing, every step (as Megatron)
            update_expert_bias(self.chunks, self.ps)
        if updated:
            self.scheduler.step()
        else:
            self.state.skipped_iters += 1
        t2 = time.perf_counter()
        self.last_stats = stats
        loss = self._loss(stats.losses)
        if loss is not None and not math.isfinite(loss):
            self.state.nan_iters += 1
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "forward": stats.forward,
            "backward": stats.backward,
            "p2p": stats.p2p,
            "grads_sync": t1 - t0,
            "optimizer": t2 - t1,
            "bubble": stats.bubble,
            "loss_scale": self.optimizer.loss_scale,
            "updated": updated,
        }

    def _forward_only(self, batches: list) -> list:
        return _run_forward_only(self.executor, self.eval_actions, self.m, batches)

    def _loss(self, losses: list) -> Optional[float]:
        return logged_loss(losses, self.ps, self.executor.layout.v_shape)

    def evaluate(self, data: Optional[MicroBatches]) -> Optional[float]:
        """Mean loss over ``eval_iters`` global batches of ``data`` (tools/evaluate.py's entry)."""
        return self.evaluator.evaluate(data, self.state.iteration)

    # -- the loop -------------------------------------------------------------------------------
    def train(self, train_ds, valid_ds, exits: Optional[ExitConditions] = None, test_ds=None) -> List[Dict[str, float]]:
        """Run up to ``train_iters`` iterations with logging, evaluation and saving; return per-iteration scalars.

        Stops early, after saving, at --exit-interval or when ``exits`` asks (a signal under
        --exit-signal-handler, --exit-duration-in-mins). A completed run evaluates once more at
        the end when the last iteration was not an evaluation one, then once on the test split
        (as Megatron). --skip-train runs no iteration: only those two evaluations, no save.
        """
        t, state = self.cfg.train, self.state
        training = not t.skip_train and state.iteration < t.train_iters
        data = (
            MicroBatches(
                train_ds,
                state.consumed_samples,
                t.micro_batch_size,
                self.m,
                self.ps,
                self.cfg.data.num_workers,
                sequence=self.sequence,
            )
            if self.needs_data and training
            else None
        )
        self.evaluator.warn_if_missing(valid_ds)
        report = Reporter(
            self.cfg, self.ps, state, self.chunks[0].padded_vocab, self.optimizer.scaler is not None, chunks=self.chunks
        )
        stops, stop = StopRules(t, self.ps, exits), None
        try:
            while training and state.iteration < t.train_iters and stop is None:
                inject_fault(t, state.iteration + 1, self.ps.rank, self.executor)  # --inject-fault-*: tests
                lr = self.scheduler.get_lr()
                self.ps.recorder.enter_phase("data")
                batches = data.next() if data is not None else [None] * self.m
                check_tokens(data, batches, self.cfg.model.vocab_size, self.ps, f"iteration {state.iteration + 1}")
                self.executor.sync = report.before_step()  # --profile; straggler timing on CUDA
                self.plan_check.before_step(self, state.iteration + 1)
                out = self.train_step(batches)
                self.plan_check.after_step(self, state.iteration + 1, out)
                state.advance(t.global_batch_size)
                self.ps.recorder.enter_phase("report")
                self.checkpointer.poll()  # publishes a background save every rank has finished writing
                stop = stops.after_step(out, state)
                report.step({**out, "lr": lr}, self.last_stats.events)
                if self.evaluator.due(state.iteration):
                    self.ps.recorder.enter_phase("evaluation")
                    report.evaluation(self.evaluator.validate(valid_ds, state.iteration))
                if stop is None and self.checkpointer.due(state.iteration):
                    self.ps.recorder.enter_phase("checkpoint")
                    self.checkpointer.save()  # with --async-save: the snapshot only (after the save in flight)
                    report.pause()
        except TrainingStopped:  # raised on every rank at the same point: the last good save still lands
            self.checkpointer.wait()
            raise
        self._finish(report, stop, valid_ds, test_ds)
        return report.history

    def _finish(self, report: Reporter, stop: Optional[str], valid_ds, test_ds) -> None:
        """After the loop: the final save, the end-of-training evaluations, the timeline, the summary."""
        t, it = self.cfg.train, self.state.iteration
        self.ps.recorder.enter_phase("end of training")
        if self.cfg.checkpoint.save and self.checkpointer.saved_at != it and not t.skip_train:
            self.checkpointer.save()
        self.checkpointer.wait()  # the end of training, --exit-interval, a signal, the time limit: all written
        self.optimizer.finish_param_gather()
        if self.evaluator.enabled and stop is None and (it > report.first_iteration or t.skip_train):
            if self.evaluator.evaluated_at != it:
                report.evaluation(self.evaluator.validate(valid_ds, it, at_end=True))
            report.evaluation(self.evaluator.test(test_ds, it))
        timeline = self.cfg.logging.timeline_out if self.last_stats is not None else None
        if timeline:
            self.write_timeline(timeline)
        report.summary(stop, self.checkpointer.saved_at, timeline)

    def write_timeline(self, path: str) -> None:
        """Gather the last iteration's measured events of this pipeline and write the timeline JSON."""
        write_timeline(
            path,
            self.last_stats.events,
            self.ps,
            schedule=self.schedule_name,
            vp=self.cfg.parallel.vp,
            m=self.m,
            iteration=self.state.iteration,
            **timeline_meta(self),
        )
