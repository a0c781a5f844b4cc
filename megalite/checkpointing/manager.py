"""Saving and loading a whole run from explicit state objects, and the Checkpointer a run holds.

A run is one :class:`~megalite.checkpointing.run.RunParts`: the model chunks, the optimizer
(MegatronOptimizer: fp32 main weights, Adam moments and step counts, loss scaler), the LR
schedule, the TrainState counters and the random states (the RNGTracker plus the process-wide
generators), with the config and ParallelState. :func:`save_checkpoint` and
:func:`load_checkpoint` take exactly that bundle; :class:`Checkpointer` binds it to the run's
config (``--save``, ``--load``, ``--save-interval``, ``--ckpt-*``) and remembers the iteration
last on disk. The directory protocol is ``protocol.py``'s, the files the formats' (looked up in a
FormatRegistry, ``formats.py``; the run's own in ``run_formats.py``), ``meta.json`` and the
random states ``run_state.py``'s. A save is a snapshot then the writes (``async_save.py``): with
``--async-save`` the Checkpointer writes in a background thread, ``poll`` (each
iteration) publishes once every rank has written, ``wait`` finishes the one in flight.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from megalite.checkpointing.async_save import SaveJob, conclude, save_failed, start_save
from megalite.checkpointing.format_info import SHARDED_INFO
from megalite.checkpointing.formats import FormatRegistry
from megalite.checkpointing.protocol import (
    LATEST,
    iteration_dir,
    read_json,
    read_latest,
    read_latest_text,
    saved_iterations,
)
from megalite.checkpointing.run import RunParts
from megalite.checkpointing.run_formats import RUN_FORMATS
from megalite.checkpointing.run_state import RandomStates, check_meta, check_model_shape
from megalite.checkpointing.safe_load import CheckpointError
from megalite.checkpointing.save_lock import ensure_save_lock
from megalite.parallel.agreement import flags_on_any_rank
from megalite.tensor_parallel.fp8 import load_fp8_states

logger = logging.getLogger("megalite")

__all__ = ["Checkpointer", "save_checkpoint", "load_checkpoint"]


def save_checkpoint(
    run: RunParts,
    root: str,
    fmt: str = SHARDED_INFO.name,
    keep_last: Optional[int] = None,
    formats: FormatRegistry = RUN_FORMATS,
) -> str:
    """Save the run at ``run.train_state.iteration`` under ``root``; returns its directory (collective).

    Every rank writes the state it owns into ``iter_XXXXXXX.tmp`` in format ``fmt`` (a name in
    ``formats``), which is renamed into place before ``latest_checkpointed_iteration.txt`` names it;
    ``keep_last`` prunes older ones. A failure (a full disk, any OSError) is one CheckpointError line
    on every rank, ``latest`` unchanged. ``Checkpointer.save`` with ``--async-save`` writes in the
    background instead.
    """
    job = start_save(run, root, formats.get(fmt), keep_last)
    job.run()
    return conclude(job, run.ps)


def _read_meta(root: str, it: int) -> tuple:
    d = iteration_dir(root, it)
    meta_path = os.path.join(d, "meta.json")
    if not os.path.exists(meta_path):
        have = [x for x in saved_iterations(root) if int(x) != it]  # never the one just refused
        raise CheckpointError(
            f"{d} is not a complete megalite checkpoint (no meta.json; a Megatron-LM torch-format "
            f"one converts with tools/checkpoint/convert.py --loader megatron); other iterations "
            f"in {root}: {', '.join(have) or 'none'}; pick one with --ckpt-step or check --load"
        )
    return d, check_meta(read_json(meta_path), meta_path)


def load_checkpoint(
    run: RunParts,
    root: str,
    *,
    step: Optional[int] = None,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
    formats: FormatRegistry = RUN_FORMATS,
) -> Optional[int]:
    """Load ``root`` (latest, or iteration ``step``) into the run's objects; returns the iteration loaded.

    A directory one of ``formats``' load sources recognises (Megatron-Core's torch_dist, when the
    composition root added it) is read in place by that source; otherwise meta.json names the run
    format that reads it. With no checkpoint there, warns and returns None (the run starts from
    scratch, as Megatron does). ``finetune`` loads the weights only and leaves the counters,
    optimizer state, schedule and random states as they are (collective).
    """
    if step is None:
        read_latest_text(root)  # a damaged latest file is one line before anything reads it
    found = formats.find_source(root, step)
    if found is not None:  # another project's directory (Megatron-LM's default --ckpt-format): read in place
        source, d = found
        return source.load(run, d, finetune, load_optim and not finetune)
    it = step if step is not None else read_latest(root)
    if it is None:
        if finetune:
            raise CheckpointError(f"--finetune: no checkpoint in {root} (no {LATEST}); check --load")
        if run.ps.is_logging_rank:  # every rank finds the same: say it once per job
            logger.warning(f"no {LATEST} in {root}: starting from scratch")
        return None
    d, meta = _read_meta(root, it)
    check_model_shape(meta["model_shape"], run.cfg.model, d)
    load_optim = load_optim and not finetune
    if load_optim:  # changed LR settings are refused before gigabytes are read
        run.scheduler.load_state_dict(meta["scheduler"])
    run.optimizer.finish_param_gather()
    rng = formats.get(meta.get("format", SHARDED_INFO.name)).read(run, d, meta, load_optim)
    if load_optim:
        run.optimizer.load_step_state(meta)
    if not finetune:
        run.train_state.load_state_dict(meta)
    _load_fp8_histories(run, rng)
    if load_rng and not finetune:
        if rng is not None:
            RandomStates(run.rng_tracker, run.model_parts).load_state_dict(rng)
        else:
            logger.warning("checkpoint saved in another layout: random states are not restored")
    logger.info(f"loaded checkpoint {d} (iteration {meta['iteration']}, {meta.get('format')} format)")
    return it


def _load_fp8_histories(run, rng: Optional[dict]) -> None:
    """FP8 delayed scaling's amax histories are model state: restored with the weights (also under
    --no-load-rng and --finetune), from the per-rank file they are saved in beside the random states."""
    restored, total = load_fp8_states(run.model_parts, (rng or {}).get("fp8", {}))
    if total and restored == total:
        logger.info(f"fp8: amax histories restored for all {total} FP8 linears")
    elif total:
        why = "saved in another layout" if rng is None else "saved without them"
        logger.warning(
            f"fp8: amax histories restored for {restored} of {total} FP8 linears ({why}); the rest start empty"
        )


class Checkpointer:
    """When to save, saving and loading, for one rank's part of a run.

    Reads ``cfg.checkpoint`` at each call (``--save``, ``--save-interval``, ``--ckpt-format``,
    ``--ckpt-keep-last``; ``--load``, ``--ckpt-step``, ``--finetune``, ``--no-load-optim``,
    ``--no-load-rng``, ``--async-save``). ``saved_at`` is the iteration last saved to ``--save`` (or
    loaded from it: already on disk, not saved again at the end), None before. With ``--async-save``
    a save returns after its snapshot; ``poll`` (each iteration) publishes it once every rank has
    written, ``wait`` (the next save, the end of the run) finishes it.
    """

    def __init__(self, run: RunParts, formats: FormatRegistry = RUN_FORMATS):
        self.run, self.formats = run, formats
        self.cfg, self.ps, self.train_state = run.cfg, run.ps, run.train_state
        cfg, ps = run.cfg, run.ps
        self.saved_at: Optional[int] = None
        self.lock_error: Optional[CheckpointError] = None
        self._pending: Optional[SaveJob] = None  # the asynchronous save in flight
        self._buffers: Optional[dict] = None  # its host copies, reused by the next snapshot
        if cfg.checkpoint.save:  # one run per --save directory (save_lock.py): refused at load, or the first save
            try:
                ensure_save_lock(cfg.checkpoint.save, ps)
            except CheckpointError as e:
                self.lock_error = e

    def due(self, iteration: int) -> bool:
        """True when ``--save`` and ``--save-interval`` ask for a checkpoint after ``iteration``."""
        ck = self.cfg.checkpoint
        return bool(ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def save(self) -> str:
        """Save the run to ``--save`` at the current iteration (collective); returns the directory.

        With ``--async-save`` only the snapshot happens here (a save still in flight is finished
        first); the files are written in the background and published by :meth:`poll` or
        :meth:`wait`, so the directory returned exists once they ran.
        """
        ck = self.cfg.checkpoint
        if not ck.save:
            raise CheckpointError("no --save directory to save the checkpoint to")
        fmt = self.formats.get(ck.ckpt_format)
        self.wait()
        background = ck.async_save
        group = fmt.background_group(self.run) if background else None
        if background and self._buffers is None:
            self._buffers = {}  # host copies of this rank's state, reused by every later snapshot
        job = start_save(
            self.run,
            ck.save,
            fmt,
            ck.ckpt_keep_last,
            copy=background,
            group=group,
            buffers=self._buffers if background else None,
        )
        self.saved_at = self.train_state.iteration
        job.run(background=background)
        if background:
            self._pending = job
            return iteration_dir(ck.save, job.iteration)
        return conclude(job, self.ps)

    def poll(self) -> None:
        """Publish an asynchronous save once every rank's write finished (collective while one is in flight:
        one all-reduce of two flags; call it at the same point of every iteration on every rank).

        A failed write on any rank raises one CheckpointError line on every rank; ``latest`` keeps
        naming the previous checkpoint.
        """
        job: Optional[SaveJob] = self._pending
        if job is None:
            return
        running, failed = flags_on_any_rank([not job.done, job.done and job.error is not None], self.ps)
        if failed:
            self._pending = None
            raise save_failed(job.root, job.iteration, job.error if job.done else None)
        if not running:
            self.wait()

    def wait(self) -> None:
        """Finish the asynchronous save in flight, if any: wait for this rank's write, then publish (collective)."""
        job: Optional[SaveJob] = self._pending
        if job is not None:
            self._pending = None
            conclude(job, self.ps)

    def load(self) -> Optional[int]:
        """Resume from ``--load`` (collective); returns the iteration loaded, or None when there is none."""
        ck = self.cfg.checkpoint
        if self.lock_error is not None:
            raise self.lock_error
        if not ck.load:
            return None
        it = load_checkpoint(
            self.run,
            ck.load,
            step=ck.ckpt_step,
            finetune=ck.finetune,
            load_optim=not ck.no_load_optim,
            load_rng=not ck.no_load_rng,
            formats=self.formats,
        )
        if it is not None and not ck.finetune and os.path.abspath(ck.load) == os.path.abspath(ck.save or ""):
            self.saved_at = self.train_state.iteration  # already on disk: do not save it again at the end
        return it
