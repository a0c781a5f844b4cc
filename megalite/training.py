"""Build a run from a Config and a ParallelState, then train and evaluate it.

::

    Trainer
      chunks      this rank's model chunks (one per virtual pipeline stage)
      executor    runs the schedule's actions for one global batch
      optimizer   MegatronOptimizer: grad buffer, main weights, finalize, clip, loss scale, step
      scheduler   LRScheduler
      iteration, consumed_samples, tracker   (what a checkpoint will need)

One iteration: zero grads -> run the schedule over m micro-batches ->
optimizer.finalize_grads() -> optimizer.step() (skipped on overflow or a
non-finite norm; then the LR schedule does not advance, as Megatron) -> log.
The Trainer only sequences: its collectives live in the optimizer layer and, for
logging (loss over DP, bubble over PP, the timeline), in logging.py.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from megalite.config import Config, ConfigError
from megalite.data.mock_dataset import MockGPTDataset
from megalite.data.samplers import PretrainingSampler
from megalite.faults import ExitConditions
from megalite.logging import (TensorBoard, flag_on_any_rank, flags_on_any_rank, format_duration, format_log_line,
                              format_timers, loss_from_first_stage, lowest_rank_with, mean_over_data_parallel,
                              mean_over_pipeline, write_timeline)
from megalite.model.gpt import GPTModel
from megalite.optim.lr_scheduler import LRScheduler
from megalite.optim.optimizer import MegatronOptimizer
from megalite.parallel_state import ParallelState
from megalite.pipeline.executor import PipelineExecutor, StepStats
from megalite.pipeline.stage_layout import layout_for
from megalite.pipeline.schedules import build_schedule, default_schedule_name
from megalite.tensor_parallel.random import RNGTracker
from megalite.throughput import Throughput, device_peak_tflops, gather_memory_report, memory_scalars, memory_stats

logger = logging.getLogger("megalite")


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient, a bad sample); the message says why and what to do.

    ``report`` is true on the one rank that should print it (every rank raises it).
    """

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


def resolve_data(cfg: Config) -> Config:
    """Fill in the default corpus (when no data is given) and the vocabulary size from the tokenizer."""
    data = cfg.data
    if data.mock_data:
        return cfg
    if not (data.data_path or data.train_data_path):
        from megalite.data.default_corpus import prepare_default_corpus
        corpus = prepare_default_corpus()
        data = replace(data, data_path=(corpus["data_prefix"],), tokenizer_type=corpus["tokenizer_type"],
                       vocab_file=corpus["vocab_file"], merge_file=corpus["merge_file"])
    if not data.tokenizer_type:
        raise ConfigError("--data-path needs --tokenizer-type (e.g. GPT2BPETokenizer with --vocab-file "
                          "and --merge-file)")
    from megalite.data.tokenizers import build_tokenizer
    tokenizer = build_tokenizer(data, cfg.model.vocab_size or None)
    return cfg.with_(data=data, model=replace(cfg.model, vocab_size=tokenizer.vocab_size))


def build_model_chunks(cfg: Config, ps: ParallelState, tracker: RNGTracker) -> List[GPTModel]:
    """This rank's chunks: chunk c runs the global stage the schedule's StageLayout gives it
    (c*pp + pp_rank interleaved; pp_rank and 2pp-1-pp_rank in a V)."""
    par, chunks = cfg.parallel, []
    layout = layout_for(par.pipeline_schedule, ps.pp_size, par.vp)
    for c in range(par.vp):
        stage = layout.stage(ps.pp_rank, c)
        layers = layout.layers(cfg.model.num_layers, ps.pp_rank, c, par.decoder_first_pipeline_num_layers,
                               par.decoder_last_pipeline_num_layers, par.pipeline_stage_layers)
        chunks.append(GPTModel(cfg.model, ps, tracker, cfg.train.seed, layers,
                               pre_process=stage == 0, post_process=stage == layout.num_stages - 1,
                               sequence_parallel=par.sequence_parallel)
                      .to(ps.device))
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process and not c.pre_process]
    if cfg.model.tied_embeddings and first and last:  # first and last stage on this rank (a V)
        last[0].tie_output_to(first[0])
    return chunks


def validation_plan(t) -> tuple:
    """(train, valid, test) sample counts, as Megatron asks for them.

    Every evaluation reads the next ``eval_iters`` global batches of the validation split
    (not the same ones again), once per ``eval_interval`` and once at the end, so the
    split is sized (train_iters // eval_interval + 1) x eval_iters x global batch.
    """
    from megalite.data.builder import megatron_num_samples
    if t.eval_iters <= 0 or t.eval_interval <= 0:
        return t.train_iters * t.global_batch_size, 0, 0
    return megatron_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)


def valid_samples_before(iteration: int, t) -> int:
    """Validation samples read by the evaluations before the one logged at ``iteration``.

    An evaluation on the interval, or the one at the end of a run whose last iteration is
    off the interval, which comes after every interval one: both give this formula.
    """
    return max(0, (iteration - 1) // t.eval_interval) * t.eval_iters * t.global_batch_size


def validation_start(iteration: int, t, available: int) -> int:
    """Where the evaluation logged at ``iteration`` starts reading a split of ``available`` samples:
    after the earlier evaluations' samples, or over from 0 when a capped split (a blend smaller
    than Megatron's plan) cannot hold this evaluation there."""
    start = valid_samples_before(iteration, t)
    return start if start + t.eval_iters * t.global_batch_size <= available else 0


class DatasetError(ValueError):
    """The datasets could not be built; ``report`` is true on the one rank that should print why."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


class Datasets(NamedTuple):
    train: Optional[object]
    valid: Optional[object]
    test: Optional[object]


def build_datasets(cfg: Config, ps: ParallelState) -> Datasets:
    """Train, validation and test datasets (samples of seq_length + 1 ids), built once per node.

    Rank 0 builds the index caches while the others wait; a failure there is agreed on
    (the builder's barrier is an all-reduce of a failure flag) so that every rank stops
    at once and only one prints, instead of the others waiting out the timeout.
    """
    t = cfg.train
    n_train, n_valid, n_test = validation_plan(t)
    if t.skip_train:  # only evaluates: the validation split keeps the training run's size (its order)
        n_train = 0
    if cfg.data.mock_data:
        make = lambda n, salt: MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size,  # noqa: E731
                                              cfg.train.seed + salt, n) if n else None
        return Datasets(make(n_train, 0), make(n_valid, 1), make(n_test, 2))
    from megalite.data.builder import build_train_valid_test_datasets
    agreed = []

    def barrier() -> None:  # phase 1: has the primary rank failed?
        agreed.append(True)
        if flag_on_any_rank(False, ps):
            raise DatasetError("the dataset build failed on rank 0", report=False)

    error: Optional[str] = None
    try:
        train, valid, test = build_train_valid_test_datasets(cfg.data, (n_train, n_valid, n_test),
                                                          seq_length=cfg.model.seq_length, seed=cfg.train.seed,
                                                          is_primary=ps.rank == 0, barrier=barrier)
        if train is None and n_train > 0:
            raise ConfigError(f"--split {cfg.data.split!r} leaves no training documents; give the train "
                              f"part a weight or pass --train-data-path")
    except DatasetError:
        raise
    except (ValueError, OSError) as e:  # bad files, split or cache (ConfigError is a ValueError)
        if not agreed:  # the primary failed before its barrier: tell the waiting ranks
            flag_on_any_rank(True, ps)
            raise DatasetError(str(e), report=True) from None
        error = str(e)
    if error is None and valid is not None and len(valid) < n_valid and len(valid) < t.eval_iters * t.global_batch_size:
        error = (f"the validation split has {len(valid)} samples, fewer than one evaluation reads (--eval-iters "
                 f"{t.eval_iters} x --global-batch-size {t.global_batch_size}); lower --eval-iters or give more "
                 f"validation data (--split / --valid-data-path)")
    reporter = lowest_rank_with(error is not None, ps)  # phase 2: did any rank fail loading?
    if reporter is not None:
        raise DatasetError(error or "the dataset build failed on another rank", report=reporter == ps.rank)
    if test is not None and len(test) < t.eval_iters * t.global_batch_size:  # a capped blend: too small to read
        if ps.rank == 0:
            logger.warning(f"the test split has {len(test)} samples, fewer than one evaluation reads (--eval-iters "
                           f"{t.eval_iters} x --global-batch-size {t.global_batch_size}): it is not evaluated")
        test = None
    return Datasets(train, valid, test)


def _collate(samples: List[dict]) -> torch.Tensor:
    return torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))


class MicroBatches:
    """Global batches for this DP rank, as lists of m micro-batch dicts (tokens, labels, loss_mask).

    Samples are read by a DataLoader over the pretraining sampler; ``num_workers``
    > 0 reads them in worker processes ahead of the training loop (``--num-workers``).
    The sampler is walked a second time alongside, so a bad sample can be named.
    """

    def __init__(self, dataset, consumed: int, mbs: int, m: int, ps: ParallelState, num_workers: int = 0,
                 name: str = "train"):
        self.m, self.device, self.dataset, self.name = m, ps.device, dataset, name
        sampler = PretrainingSampler(len(dataset), consumed, mbs, ps.dp_rank, ps.dp_size)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                             collate_fn=_collate, pin_memory=ps.device.type == "cuda",
                                             # its own generator: starting a loader must not draw from
                                             # the global RNG, or a resumed run's dropout would differ
                                             generator=torch.Generator())
        self.it = iter(loader)
        self.indices = iter(PretrainingSampler(len(dataset), consumed, mbs, ps.dp_rank, ps.dp_size))
        self.last_indices: List[List[int]] = []
        self.last_host: List[torch.Tensor] = []

    def next(self) -> List[Dict[str, torch.Tensor]]:
        out, self.last_indices, self.last_host = [], [], []
        for _ in range(self.m):
            host = next(self.it)
            self.last_host.append(host)  # checked on the host: no device sync per micro-batch
            text = host.to(self.device, non_blocking=True)
            self.last_indices.append(list(next(self.indices)))
            out.append({"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
                        "loss_mask": torch.ones(text.shape[0], text.shape[1] - 1, device=self.device)})
        return out

    def bad_token(self, batches: List[Dict[str, torch.Tensor]], vocab: int) -> Optional[str]:
        """A one-line description of the first token id outside [0, vocab) in ``batches``, the last ones
        ``next()`` returned (None: all fine)."""
        for mb, text in enumerate(self.last_host[:len(batches)]):
            if int(text.min()) >= 0 and int(text.max()) < vocab:
                continue
            row = int(((text < 0) | (text >= vocab)).any(dim=1).nonzero()[0])
            ids = text[row]
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            sample = self.last_indices[mb][row]
            return (f"{self.name} sample {sample} ({describe_sample(self.dataset, sample)}) holds token id {bad}, "
                    f"outside the model's vocabulary [0, {vocab}): the data was tokenized with another "
                    f"tokenizer than the one given (--tokenizer-type / --vocab-file / --vocab-size)")
        return None


def describe_sample(dataset, idx: int) -> str:
    """Where sample ``idx`` of a (blended) dataset comes from, for error messages."""
    if hasattr(dataset, "dataset_index"):  # a blend: find the part and its own sample number
        part, inner = int(dataset.dataset_index[idx]), int(dataset.dataset_sample_index[idx])
        return f"blend part {part}, its sample {inner}, " + describe_sample(dataset.datasets[part], inner)
    indexed = getattr(dataset, "indexed", None)
    return f"from {indexed.prefix}.bin" if indexed is not None else f"from a {type(dataset).__name__}"


class Trainer:
    """Everything one rank needs to train: model chunks, optimizer, data, schedule, counters."""

    def __init__(self, cfg: Config, ps: ParallelState):
        self.cfg, self.ps = cfg, ps
        t, par = cfg.train, cfg.parallel
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        if par.pipeline_balance == "measured" and par.pipeline_stage_layers is None:
            from megalite.checkpointing import saved_stage_layers
            from megalite.pipeline.measure import balance_stages  # times layer kinds: a collective
            ck = cfg.checkpoint
            saved = saved_stage_layers(ck.load, ck.ckpt_step, ps.pp_size, par.vp) \
                if ck.load and not ck.finetune else None
            if saved is not None:  # resuming: keep the split the run was balanced with (same file, every rank)
                self.cfg = cfg = cfg.with_(parallel=replace(par, pipeline_stage_layers=saved))
                if ps.is_logging_rank:
                    logger.info(f"--pipeline-balance measured: resuming with the checkpoint's split "
                                f"{','.join(map(str, saved))}")
            else:
                self.cfg = cfg = balance_stages(cfg, ps)  # the split goes into checkpoints' config
            par = cfg.parallel
        self.tracker = RNGTracker(t.seed, ps.tp_rank, ps.pp_rank, ps.device)
        self.chunks = build_model_chunks(cfg, ps, self.tracker)
        named = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.params = [p for _, p in named]
        shared = [w for w in (c.shared_embedding_weight() for c in self.chunks) if w is not None]
        self.optimizer = MegatronOptimizer(
            named, cfg.optim, ps, shared=shared,
            sequence_parallel_params=[p for p in self.params if getattr(p, "sequence_parallel", False)])
        self.optimizer.install_param_gather_hooks(self.chunks)
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, t.train_iters)
        self.m = t.global_batch_size // (t.micro_batch_size * ps.dp_size)
        self.schedule_name = par.pipeline_schedule or default_schedule_name(ps.pp_size, par.vp)
        self.actions = build_schedule(self.schedule_name, ps.pp_size, par.vp, self.m,
                                      overlap_p2p=par.overlap_p2p_comm)[ps.pp_rank]
        self.eval_actions = build_schedule(self.schedule_name, ps.pp_size, par.vp, self.m, forward_only=True,
                                           overlap_p2p=par.overlap_p2p_comm)[ps.pp_rank]
        s = cfg.model.seq_length // (ps.tp_size if par.sequence_parallel else 1)
        self.executor = PipelineExecutor(self.chunks, ps, (s, t.micro_batch_size, cfg.model.hidden_size),
                                         dtype=cfg.model.torch_dtype,
                                         layout=layout_for(self.schedule_name, ps.pp_size, par.vp))
        self.needs_data = any(c.pre_process or c.post_process for c in self.chunks)
        self.iteration, self.consumed_samples = 0, 0
        self.skipped_iters = self.nan_iters = 0
        self.last_stats: Optional[StepStats] = None
        self.saved_at: Optional[int] = None

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self) -> None:
        """Save the run to --save (collective)."""
        from megalite.checkpointing import save_checkpoint
        ck = self.cfg.checkpoint
        save_checkpoint(self, ck.save, ck.ckpt_format, ck.ckpt_keep_last)
        self.saved_at = self.iteration

    def load(self) -> Optional[int]:
        """Resume from --load (collective); returns the iteration loaded, or None when there is none."""
        from megalite.checkpointing import load_checkpoint
        ck = self.cfg.checkpoint
        it = load_checkpoint(self, ck.load, step=ck.ckpt_step, finetune=ck.finetune,
                             load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng)
        if it is not None and not ck.finetune and os.path.abspath(ck.load) == os.path.abspath(ck.save or ""):
            self.saved_at = self.iteration  # already on disk: do not save it again at the end
        return it

    # -- one iteration ---------------------------------------------------------------------------
    def train_step(self, batches: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
        """Forward/backward over all micro-batches, finalize, clip and update. Returns scalars."""
        for c in self.chunks:
            c.train()
        self.optimizer.zero_grad(self.m)
        stats = self.executor.run(self.actions, lambda mb: batches[mb], self.m,
                                  loss_scale=self.optimizer.loss_scale)
        t0 = time.perf_counter()
        self.optimizer.finalize_grads()
        t1 = time.perf_counter()
        updated, grad_norm = self.optimizer.step()
        if updated:
            self.scheduler.step()
        else:
            self.skipped_iters += 1
        t2 = time.perf_counter()
        self.last_stats = stats
        loss = self._reduce_loss(stats.losses)
        if loss is not None and not math.isfinite(loss):
            self.nan_iters += 1
        return {"loss": loss, "grad_norm": grad_norm, "forward": stats.forward, "backward": stats.backward,
                "p2p": stats.p2p, "grads_sync": t1 - t0, "optimizer": t2 - t1,
                "bubble": self._bubble(stats), "loss_scale": self.optimizer.loss_scale, "updated": updated}

    def _non_finite_error(self, out: Dict[str, float]) -> TrainingStopped:
        """Megatron's --check-for-nan-in-loss-and-grad: every rank stops at the first non-finite value.

        An fp16 overflow is not one: the loss scaler skips that step (its norm is None).
        """
        return TrainingStopped(
            f"iteration {self.iteration}: the loss or gradient norm is not finite (lm loss {out['loss']}, grad "
            f"norm {out['grad_norm']} on this rank); stopping, with the weights of iteration "
            f"{self.iteration - 1}. Lower --lr or check the data; --no-check-for-nan-in-loss-and-grad counts "
            f"such steps and skips their updates instead", report=self.ps.is_logging_rank)

    def _check_tokens(self, data: Optional[MicroBatches], batches) -> None:
        """Stop every rank before the step when a sample holds an id outside the tokenizer's vocabulary.

        Checked against the unpadded size, so every tp size (each pads differently) stops the same
        way: unchecked, an id past the padding crashes the lookup at tp=1, and an id inside it trains
        on an infinite loss (padding logits are masked) at tp>1. One all-reduce.
        """
        problem = data.bad_token(batches, self.cfg.model.vocab_size) if data is not None else None
        reporter = lowest_rank_with(problem is not None, self.ps)
        if reporter is not None:
            where = f"iteration {self.iteration + 1}" if data is None or data.name == "train" else \
                f"evaluation at iteration {self.iteration}"
            raise TrainingStopped(f"{where}: {problem}", report=reporter == self.ps.rank)

    def _reduce_loss(self, losses: List[torch.Tensor]) -> Optional[float]:
        """Mean micro-batch loss over DP ranks (last stage only; None elsewhere).

        A V puts the loss on pipeline rank 0; it is passed to the last pipeline rank,
        where the log line (and every caller) expects it.
        """
        loss = mean_over_data_parallel(losses, self.ps)
        if self.executor.layout.v_shape and self.ps.pp_size > 1:
            loss = loss_from_first_stage(loss, self.ps)
        return loss

    @staticmethod
    def _bubble(stats: StepStats) -> float:
        """Measured idle fraction: (schedule time - compute) / compute, Megatron's bubble definition."""
        wall = stats.events[-1]["end"] if stats.events else 0.0
        return max(0.0, wall - stats.compute) / stats.compute if stats.compute > 0 else 0.0

    @torch.no_grad()
    def evaluate(self, valid) -> Optional[float]:
        """Mean validation loss over ``eval_iters`` global batches (always the same samples)."""
        for c in self.chunks:
            c.eval()
        losses = []
        for _ in range(self.cfg.train.eval_iters):
            batches = valid.next() if valid is not None else [None] * self.m
            self._check_tokens(valid, batches)
            stats = self.executor.run(self.eval_actions, lambda mb: batches[mb], self.m, forward_only=True)
            losses += stats.losses
        return self._reduce_loss(losses)

    # -- the loop -------------------------------------------------------------------------------
    def train(self, train_ds, valid_ds, exits: Optional[ExitConditions] = None,
              test_ds=None) -> List[Dict[str, float]]:
        """Run ``train_iters`` iterations with logging and evaluation; return per-iteration scalars.

        Stops early, after saving, at --exit-interval or when ``exits`` asks (a signal under
        --exit-signal-handler, --exit-duration-in-mins). A completed run evaluates once more at
        the end when the last iteration was not an evaluation one, then once on the test split
        (as Megatron). --skip-train runs no iteration: only those two evaluations, no save.
        """
        cfg, t = self.cfg, self.cfg.train
        training = not t.skip_train and self.iteration < t.train_iters
        data = MicroBatches(train_ds, self.consumed_samples, t.micro_batch_size, self.m, self.ps,
                            cfg.data.num_workers) if self.needs_data and training else None
        evaluating = t.eval_iters > 0 and t.eval_interval > 0
        if valid_ds is None and evaluating and self.ps.is_logging_rank:
            logger.warning("no validation samples (see --split / --valid-data-path): validation is skipped")
        tb = TensorBoard(cfg.logging.tensorboard_dir if self.ps.is_logging_rank else None)
        flops = Throughput(cfg.model, t.global_batch_size, self.chunks[0].padded_vocab, self.ps.world_size,
                           num_chunks=self.ps.pp_size * cfg.parallel.vp,
                           peak_tflops=device_peak_tflops(self.ps.device, cfg.logging.peak_tflops))
        self.memory_reported = False  # Megatron reports GPU memory once, after the first logged iterations
        history: List[Dict[str, float]] = []
        window: List[Dict[str, float]] = []
        self.run_start, self.first_iteration, self.stop_reason = time.perf_counter(), self.iteration, None
        self.last_valid_loss, self.test_loss, evaluated_at = None, None, None
        self.last_logged: Tuple[int, Optional[float]] = (self.iteration, None)  # (iteration, lm loss)
        t_last = time.perf_counter()
        while training and self.iteration < t.train_iters:
            lr = self.scheduler.get_lr()
            batches = data.next() if data is not None else [None] * self.m
            self._check_tokens(data, batches)
            out = self.train_step(batches)
            self.iteration += 1
            self.consumed_samples += t.global_batch_size
            bad = t.check_for_nan_in_loss_and_grad and any(
                v is not None and not math.isfinite(v) for v in (out["loss"], out["grad_norm"]))
            reason = exits.local_reason() if exits is not None and exits.active else None
            stop_bad, stop_asked = flags_on_any_rank([bad, reason is not None], self.ps)
            if stop_bad:
                raise self._non_finite_error(out)
            out["lr"] = lr
            history.append(out)
            window.append(out)
            if self.iteration % cfg.logging.log_interval == 0 or self.iteration == t.train_iters:
                elapsed = (time.perf_counter() - t_last) / len(window)
                self._log(window, elapsed, flops, tb)
                window, t_last = [], time.perf_counter()
            if evaluating and self.iteration % t.eval_interval == 0:
                self._log_eval(valid_ds, tb)
                evaluated_at, t_last = self.iteration, time.perf_counter()
            ck = cfg.checkpoint
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                self.stop_reason = f"--exit-interval {t.exit_interval} reached"
            elif stop_asked:
                self.stop_reason = reason or "another rank asked to stop"
            if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0 and not self.stop_reason:
                self.save()
                t_last = time.perf_counter()  # saving is not iteration time
            if self.stop_reason:
                break
        if cfg.checkpoint.save and self.saved_at != self.iteration and not t.skip_train:
            self.save()
        self.optimizer.finish_param_gather()
        if evaluating and self.stop_reason is None and (self.iteration > self.first_iteration or t.skip_train):
            if evaluated_at != self.iteration:
                self._log_eval(valid_ds, tb, at_end=True)
            self._log_eval(test_ds, tb, at_end=True, split="test")
        if cfg.logging.timeline_out and self.last_stats is not None:
            self.write_timeline(cfg.logging.timeline_out)
        tb.close()
        self._log_summary(history)
        return history

    def _log_summary(self, history: List[Dict[str, float]]) -> None:
        """The last lines of a run: what was done and where its outputs went."""
        if not self.ps.is_logging_rank:
            return
        cfg, t = self.cfg, self.cfg.train
        iters = self.iteration - self.first_iteration
        # the number the last log line printed; iterations after it (an early stop) are averaged instead
        logged_at, logged = self.last_logged
        unlogged = history[len(history) - (self.iteration - logged_at):] if logged_at < self.iteration else []
        losses = [h["loss"] for h in unlogged if h["loss"] is not None] or ([logged] if logged is not None else [])
        tokens = iters * t.global_batch_size * cfg.model.seq_length
        status = ("skipped (--skip-train)" if t.skip_train else
                  f"stopped ({self.stop_reason})" if self.stop_reason else "done")
        lines = [f"training {status}: "
                 f"{iters} iterations ({self.iteration} in all), {tokens:,} tokens in "
                 f"{format_duration(time.perf_counter() - self.run_start)}"
                 + (f"; final lm loss {sum(losses) / len(losses):.4f}" if losses else "")
                 + (f", validation lm loss {self.last_valid_loss:.4f}" if self.last_valid_loss is not None else "")
                 + (f", test lm loss {self.test_loss:.4f}" if self.test_loss is not None else "")]
        if cfg.checkpoint.save and self.saved_at is not None:
            lines.append(f"  checkpoint: {cfg.checkpoint.save} (iteration {self.saved_at})")
        if cfg.logging.tensorboard_dir:
            lines.append(f"  tensorboard: {cfg.logging.tensorboard_dir}")
        if cfg.logging.timeline_out and self.last_stats is not None:
            lines.append(f"  pipeline timeline: {cfg.logging.timeline_out}")
        if not cfg.data.mock_data:
            from megalite.data.builder import default_cache_dir
            paths = cfg.data.data_path or cfg.data.train_data_path
            prefix = next((p for p in paths if not p.replace(".", "", 1).isdigit()), None)
            if cfg.data.data_cache_path or prefix:
                cache = cfg.data.data_cache_path or os.path.dirname(default_cache_dir(prefix, "x"))
                lines.append(f"  data index cache: {cache}")
        logger.info("\n".join(lines))

    def _log(self, window: List[Dict[str, float]], sec_per_iter: float, flops: Throughput, tb: TensorBoard) -> None:
        t = self.cfg.train
        losses = [w["loss"] for w in window if w["loss"] is not None]
        loss = sum(losses) / len(losses) if losses else None
        bubble = mean_over_pipeline(sum(w["bubble"] for w in window) / len(window), self.ps)
        memory_lines = [] if self.memory_reported else gather_memory_report(self.ps, self.iteration)  # collective
        self.memory_reported = True
        if not self.ps.is_logging_rank:
            return
        self.last_logged = (self.iteration, loss)
        figures = flops.figures(sec_per_iter)
        tokens_per_s, tflops = figures["tokens_per_s"], figures["tflops"]
        last = window[-1]
        run_time = time.perf_counter() - self.run_start
        done = self.iteration - self.first_iteration
        eta = run_time / done * (t.train_iters - self.iteration)
        logger.info(format_log_line(self.iteration, t.train_iters, self.consumed_samples, sec_per_iter * 1e3,
                                    tflops, last["lr"], t.global_batch_size, loss, last["grad_norm"],
                                    self.skipped_iters, self.nan_iters, tokens_per_s, last["loss_scale"])
                    + flops.log_fields(figures)
                    + f" elapsed: {format_duration(run_time)} | ETA: {format_duration(eta)} |")
        for line in memory_lines:
            logger.info(line)
        if self.cfg.logging.log_timers:
            keys = ("forward", "backward", "p2p", "grads_sync", "optimizer")
            names = ("forward-compute", "backward-compute", "p2p-wait", "grads-all-reduce", "optimizer")
            times = {n: 1e3 * sum(w[k] for w in window) / len(window) for n, k in zip(names, keys)}
            logger.info(format_timers(times) + f" | pipeline bubble: {100 * float(bubble):.1f}%")
        scalars = {"loss-scale": last["loss_scale"]} if self.optimizer.scaler is not None else {}
        tb.scalars({**scalars, "lm loss": loss, "learning-rate": last["lr"], "grad-norm": last["grad_norm"],
                    "batch-size": t.global_batch_size, "iteration-time": sec_per_iter,
                    **flops.tensorboard(figures), **memory_scalars(memory_stats(self.ps.device))}, self.iteration)

    def _log_eval(self, ds, tb: TensorBoard, at_end: bool = False, split: str = "validation") -> None:
        """Evaluate on the next batches of ``split`` and log Megatron's validation lines."""
        if ds is None:  # the same on every rank: no such split, nothing to run
            return
        t = self.cfg.train
        # Each validation goes on where the last stopped (Megatron's order); resumed runs skip
        # the batches the evaluations before the checkpoint read. The test split is read once, from 0.
        start = validation_start(self.iteration, t, len(ds)) if split == "validation" else 0
        batches = MicroBatches(ds, start, t.micro_batch_size, self.m, self.ps, self.cfg.data.num_workers,
                               name=split) if self.needs_data else None
        loss = self.evaluate(batches)
        if self.ps.is_logging_rank and loss is not None:
            ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
            if split == "validation":
                self.last_valid_loss = loss
                where = "the end of training for val data" if at_end else f"iteration {self.iteration}"
            else:
                self.test_loss, where = loss, "the end of training for test data"
            line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
            logger.info("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
            key = "lm loss validation" if split == "validation" else "lm loss test"
            if not t.skip_train:  # as Megatron: an evaluation-only run adds no point to the training curves
                tb.scalars({key: loss, key + " ppl": ppl}, self.iteration)

    def write_timeline(self, path: str) -> None:
        """Gather the last iteration's measured events of this pipeline and write the timeline JSON."""
        write_timeline(path, self.last_stats.events, self.ps, schedule=self.schedule_name,
                       vp=self.cfg.parallel.vp, m=self.m, iteration=self.iteration)
